"""A refusal on a wrong base stays short whatever the size of the series: the counts (files,
hunks), the first few files with their first hunks, and `status --json` for the rest. Real tree:
a series appending a line to 40 real files, every one of them drifted at its end."""

from __future__ import annotations

import json
from pathlib import Path

from core_helpers import CliRunner, append_diff, make_series, replace_file

from m3patch import errors

COUNT = 40
MAX_LINES = 30  # generous: the summary itself is about 25 lines


def targets(root: Path) -> list[str]:
    files = sorted(p for p in (root / "vllm" / "entrypoints").rglob("*.py")
                   if p.stat().st_size > 400)
    return [str(p.relative_to(root)) for p in files[:COUNT]]


def drift(root: Path, rel: str) -> None:
    lines = (root / rel).read_bytes().splitlines(keepends=True)
    replace_file(root / rel, b"".join([*lines[:-1], b"# drifted\n"]))


def test_a_refusal_on_a_wrong_base_is_a_summary_that_points_to_status_json(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    paths = targets(pristine_033)
    assert len(paths) == COUNT
    series = make_series(tmp_path / "s", pristine_033,
                         ["".join(append_diff(pristine_033, rel, "M3PATCH_LONG = 1") for rel in paths)])
    for rel in paths:
        drift(vllm_tree, rel)
    args = ("--vllm-root", str(vllm_tree), "--series", str(series))
    applied = m3patch_cli("apply", *args)
    assert applied.returncode == errors.PatchConflict.exit_code, applied.stderr
    assert len(applied.stderr.splitlines()) <= MAX_LINES, applied.stderr
    assert f"match no pinned image: {COUNT} file(s), {COUNT} hunk(s)" in applied.stderr
    assert paths[0] in applied.stderr and paths[-1] not in applied.stderr
    assert f"{COUNT - 5} more file(s)" in applied.stderr
    assert "`m3patch status --json` lists every file and hunk" in applied.stderr
    status = m3patch_cli("status", *args)
    assert status.returncode == errors.PatchConflict.exit_code
    assert len(status.stderr.splitlines()) <= 3, status.stderr
    assert f"and {COUNT - 5} more (`m3patch status --json` lists them)" in status.stderr
    assert len(status.stdout.splitlines()) <= 2 * COUNT + 40  # tables + clipped diagnosis
    full = m3patch_cli("status", "--json", *args)
    assert sorted(json.loads(full.stdout)["conflicts"]) == sorted(paths)  # every one, in JSON
    verified = m3patch_cli("verify", *args)
    assert verified.returncode == errors.VerifyFailed.exit_code
    assert len(verified.stderr.splitlines()) <= MAX_LINES + 2, verified.stderr
    assert f"{COUNT} problem(s) in the patched tree: {COUNT} file(s), {COUNT} hunk(s)" in verified.stderr
