"""Folders on the real tree: a series that deletes the last file of a folder removes the folder
(and the ones above it it leaves empty), as `git apply` does; revert re-creates them; revert
removes every folder the series created. Renames stay refused with a hint (docs say so)."""

from __future__ import annotations

import json
from pathlib import Path

from core_helpers import (
    REPO,
    CliRunner,
    append_diff,
    delete_diff,
    make_series,
    new_file_diff,
    tree_listing,
)

from m3patch import errors
from m3patch.patching.ledger import read_ledger

LONE = "vllm/vllm_flash_attn/ops/triton/rotary.py"  # the only file of ops/triton; ops holds triton
ADDED = "vllm/m3patch_pkg/sub/new.py"  # vllm/m3patch_pkg/ does not exist in vLLM
EDITED = "vllm/version.py"


def run(cli: CliRunner, command: str, root: Path, series: Path, *extra: str) -> tuple[int, str]:
    proc = cli(command, *extra, "--vllm-root", str(root), "--series", str(series))
    return proc.returncode, proc.stdout + proc.stderr


def test_deleting_a_folders_last_file_removes_it_and_revert_recreates_it(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    series = make_series(tmp_path / "s", pristine_033, [
        delete_diff(pristine_033, LONE), new_file_diff(ADDED, ["X = 1"]),
        append_diff(pristine_033, EDITED, "M3PATCH_FOLDERS = 1")])
    before = tree_listing(vllm_tree)
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    assert not (vllm_tree / "vllm/vllm_flash_attn/ops").exists()  # triton/ and ops/ both gone
    assert (vllm_tree / "vllm/vllm_flash_attn/layers").is_dir()
    ledger = read_ledger(vllm_tree)
    assert ledger is not None
    dirs = {f.path: f.dirs for f in ledger.files}
    assert dirs[LONE] == ("vllm/vllm_flash_attn/ops", "vllm/vllm_flash_attn/ops/triton")
    assert dirs[ADDED] == ("vllm/m3patch_pkg", "vllm/m3patch_pkg/sub")
    for command in ("apply", "status", "verify"):
        assert run(m3patch_cli, command, vllm_tree, series)[0] == 0, command
    code, out = run(m3patch_cli, "revert", vllm_tree, series, "--json")
    assert code == 0, out
    assert tree_listing(vllm_tree) == before  # every folder back, none left over
    assert (vllm_tree / LONE).read_bytes() == (pristine_033 / LONE).read_bytes()
    assert json.loads(out)["deleted"] == [ADDED]


def test_a_folder_that_keeps_another_entry_stays(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    series = make_series(tmp_path / "s", pristine_033, [delete_diff(pristine_033, LONE)])
    (vllm_tree / "vllm/vllm_flash_attn/ops/README").write_text("someone else's\n")
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    assert not (vllm_tree / "vllm/vllm_flash_attn/ops/triton").exists()
    assert (vllm_tree / "vllm/vllm_flash_attn/ops/README").is_file()
    assert run(m3patch_cli, "revert", vllm_tree, series)[0] == 0
    assert (vllm_tree / LONE).is_file()


def test_a_delete_and_an_add_in_one_folder_keep_it(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    other = "vllm/vllm_flash_attn/ops/triton/m3patch_rotary.py"
    series = make_series(tmp_path / "s", pristine_033, [
        delete_diff(pristine_033, LONE) + new_file_diff(other, ["Y = 2"])])
    assert run(m3patch_cli, "apply", vllm_tree, series)[0] == 0
    assert (vllm_tree / other).is_file() and not (vllm_tree / LONE).exists()
    assert run(m3patch_cli, "revert", vllm_tree, series)[0] == 0
    assert (vllm_tree / LONE).is_file() and not (vllm_tree / other).exists()
    assert (vllm_tree / "vllm/vllm_flash_attn/ops/triton").is_dir()


def test_a_rename_is_refused_with_the_delete_plus_add_hint(
        vllm_tree: Path, pristine_033: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    series = make_series(tmp_path / "s", pristine_033, [append_diff(pristine_033, EDITED, "Z = 1")])
    rename = ("diff --git a/vllm/version.py b/vllm/version2.py\nsimilarity index 100%\n"
              "rename from vllm/version.py\nrename to vllm/version2.py\n")
    patch = next(series.glob("0001-*.patch"))
    patch.write_text(rename)
    proc = m3patch_cli("series", "lock", "--series", str(series), "--tree", str(pristine_033))
    assert proc.returncode == errors.UsageError.exit_code, proc.stderr
    assert "rename vllm/version.py -> vllm/version2.py is not supported" in proc.stderr
    assert "express a rename as a delete plus an add" in proc.stderr


def test_a_folder_where_a_file_is_pinned_is_a_conflict_not_a_permission_problem(
        vllm_tree: Path, m3patch_cli: CliRunner) -> None:
    shipped = REPO / "patches" / "vllm-0.33.0"
    target = vllm_tree / "vllm/model_executor/layers/quantization/modelopt.py"
    target.unlink()
    target.mkdir()
    for command in ("status", "verify", "apply", "revert"):
        code, out = run(m3patch_cli, command, vllm_tree, shipped)
        assert code == errors.PatchConflict.exit_code, (command, out)
        assert "modelopt.py: a folder stands where the series pins a file" in out, command
        assert "permissions" not in out, command
