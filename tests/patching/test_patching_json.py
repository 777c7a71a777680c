"""`--json` on apply, verify, revert, status and locate: one versioned object on stdout, on
success and on error, with stable state names and per-hunk fields; run on the real 0.33.0 tree
with the shipped series."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from core_helpers import REPO, CliRunner, replace_file

from m3patch import __version__, errors
from m3patch.patching.report_json import SCHEMA
from m3patch.patching.states import FileState, Mode, PatchState, state_name

SERIES = REPO / "patches" / "vllm-0.33.0"
MODELOPT = "vllm/model_executor/layers/quantization/modelopt.py"
ENVELOPE = {"schema", "command", "tool_version", "exit_code", "ok", "tree_root", "vllm_version",
            "series_id", "mode", "ledger_sha256"}


def run_json(cli: CliRunner, command: str, root: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    series = () if command == "locate" else ("--series", str(SERIES))
    proc = cli(command, "--json", *extra, "--vllm-root", str(root), *series)
    report = json.loads(proc.stdout)  # exactly one object, whatever the exit code
    assert report.keys() >= ENVELOPE, proc.stdout
    assert report["schema"] == SCHEMA and report["command"] == command
    assert report["tool_version"] == __version__
    assert report["exit_code"] == proc.returncode and report["ok"] is (proc.returncode == 0)
    return proc.returncode, report


def ledger_digest(root: Path) -> str:
    return hashlib.sha256((root / "vllm/.m3patch/ledger.json").read_bytes()).hexdigest()


def test_every_command_prints_the_one_envelope(vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    code, located = run_json(m3patch_cli, "locate", vllm_tree)
    assert code == 0 and located["tree_root"] == str(vllm_tree) == located["root"]
    assert located["ledger_sha256"] is None and located["mode"] is None
    code, applied = run_json(m3patch_cli, "apply", vllm_tree)
    assert code == 0, applied
    digest = ledger_digest(vllm_tree)
    assert applied["ledger_sha256"] == digest and applied["mode"] == "strict"
    assert applied["series_id"] == "vllm-0.33.0" and applied["vllm_version"] == "0.33.0"
    assert MODELOPT in applied["files_written"] and applied["already_applied"] == []
    for command in ("status", "verify", "locate"):
        code, report = run_json(m3patch_cli, command, vllm_tree)
        assert code == 0, report
        assert report["ledger_sha256"] == digest and report["mode"] == "strict", command
    _, status = run_json(m3patch_cli, "status", vllm_tree)
    assert {f["state"] for f in status["files"]} == {"applied"}
    code, again = run_json(m3patch_cli, "apply", vllm_tree, "--verify")
    assert code == 0 and again["applied"] == [] and again["verify"]["problem_count"] == 0
    code, reverted = run_json(m3patch_cli, "revert", vllm_tree)
    assert code == 0 and reverted["mode"] == "revert" and reverted["ledger_sha256"] == digest
    assert MODELOPT in reverted["files_written"] and reverted["not_applied"] == []
    assert not (vllm_tree / "vllm/.m3patch/ledger.json").exists()


def test_an_error_prints_the_object_with_code_message_and_hint(
        vllm_tree: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    assert m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series",
                       str(SERIES)).returncode == 0
    (vllm_tree / MODELOPT).unlink()
    code, status = run_json(m3patch_cli, "status", vllm_tree)
    assert code == errors.PatchConflict.exit_code
    assert status["error"]["type"] == "PatchConflict" and MODELOPT in status["error"]["message"]
    assert status["error"]["hint"] and status["conflicts"] == [MODELOPT]
    assert {f["path"]: f["state"] for f in status["files"]}[MODELOPT] == "missing"
    code, verify = run_json(m3patch_cli, "verify", vllm_tree)
    assert code == errors.VerifyFailed.exit_code and verify["problem_count"] == 1
    code, nowhere = run_json(m3patch_cli, "status", tmp_path / "no-such-tree")
    assert code == errors.VllmNotFound.exit_code and nowhere["tree_root"] is None
    assert nowhere["error"]["type"] == "VllmNotFound" and nowhere["error"]["message"]


def test_a_crlf_file_shows_its_carriage_return_and_counts_as_one_problem(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    """A CRLF copy of a patched file: the human message escapes the \\r that was invisible,
    the JSON hunk carries it in `found`, and verify counts one file, not its diagnosis lines."""
    args = ("--vllm-root", str(vllm_tree), "--series", str(SERIES))
    assert m3patch_cli("apply", *args).returncode == 0
    path = vllm_tree / MODELOPT
    replace_file(path, path.read_bytes().replace(b"\n", b"\r\n"))
    human = m3patch_cli("verify", *args)
    assert human.returncode == errors.VerifyFailed.exit_code
    assert "1 problem(s) in the patched tree" in human.stderr
    assert "expected '        )', found '        )\\r'" in human.stderr
    code, verify = run_json(m3patch_cli, "verify", vllm_tree)
    assert code == errors.VerifyFailed.exit_code and verify["problem_count"] == 1
    (item,) = verify["files"]
    assert item["path"] == MODELOPT and item["state"] == "modified-after-apply"
    first = item["hunks"][0]
    assert first["state"] == "conflict" and first["differs_at"] == first["line"]
    assert first["expected"] == "        )" and first["found"] == "        )\r"
    _, status = run_json(m3patch_cli, "status", vllm_tree)
    hunks = {f["path"]: f["hunks"] for f in status["files"]}[MODELOPT]
    assert hunks == item["hunks"]


def test_offset_apply_reports_each_hunk_with_its_offset(
        vllm_tree: Path, pristine_033: Path, m3patch_cli: CliRunner) -> None:
    replace_file(vllm_tree / MODELOPT,
                 b"# a line a nightly added\n" + (pristine_033 / MODELOPT).read_bytes())
    code, applied = run_json(m3patch_cli, "apply", vllm_tree, "--offset")
    assert code == 0 and applied["mode"] == "offset", applied
    moved = [h for h in applied["hunks"] if h["path"] == MODELOPT]
    assert moved and all(h["offset"] == 1 and h["state"] == "applied" for h in moved)
    _, status = run_json(m3patch_cli, "status", vllm_tree)
    assert status["mode"] == "offset" and status["ledger_sha256"] == ledger_digest(vllm_tree)
    assert {f["path"]: f["state"] for f in status["files"]}[MODELOPT] == "applied-offset"


def test_state_names_have_no_spaces() -> None:
    names = {state_name(s) for enum in (FileState, PatchState, Mode) for s in enum}
    assert all(" " not in n and "(" not in n for n in names)
    assert state_name(FileState.MODIFIED) == "modified-after-apply"
    assert state_name(FileState.APPLIED_OFFSET) == "applied-offset"
    assert state_name(PatchState.NO_FILES) == "no-files"


def test_a_change_outside_every_hunk_says_where_the_file_differs(
        vllm_tree: Path, pristine_033: Path, m3patch_cli: CliRunner) -> None:
    """Line 10 of modelopt.py (no hunk near it) edited in place: before apply the file is
    drifted with every hunk pending, after apply it is modified after apply with every hunk
    applied; either way status and verify name line 10, against the pristine file and against
    the post-image, read from the cached pristine tree."""
    args = ("--vllm-root", str(vllm_tree), "--series", str(SERIES))
    path = vllm_tree / MODELOPT

    def edit_line_10() -> None:
        lines = path.read_bytes().splitlines(keepends=True)
        lines[9] = b"import torch  # edited by hand\n"
        replace_file(path, b"".join(lines))

    edit_line_10()
    code, status = run_json(m3patch_cli, "status", vllm_tree)
    item = {f["path"]: f for f in status["files"]}[MODELOPT]
    assert code == errors.PatchConflict.exit_code and item["state"] == "drifted"
    assert item["differs_at"] == 10, item
    human = m3patch_cli("status", *args)
    assert "first differs from the pristine file at line 10" in human.stdout, human.stdout
    replace_file(path, (pristine_033 / MODELOPT).read_bytes())
    assert m3patch_cli("apply", *args).returncode == 0
    edit_line_10()
    code, verify = run_json(m3patch_cli, "verify", vllm_tree)
    (item,) = verify["files"]
    assert code == errors.VerifyFailed.exit_code and item["state"] == "modified-after-apply"
    assert item["differs_at"] == 10 and verify["problem_count"] == 1, item
    human = m3patch_cli("verify", *args)
    assert "first differs from the post-image file at line 10" in human.stderr, human.stderr
