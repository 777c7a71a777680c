"""File-level effects on the real tree: modes and owners, folders for new files, delete wording."""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path

import pytest
from core_helpers import CliRunner, append_diff, make_series, new_file_diff, replace_file

from m3patch import errors
from m3patch.patching.api import apply_series, revert_series, verify_tree
from m3patch.patching.ledger import state_dir
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import verify_against_record
from m3patch.patching.series import load_series

TOOL = "vllm/m3patch_newpkg/sub/tool.py"  # vllm/m3patch_newpkg/ does not exist in vLLM
KEPT = "vllm/m3patch_keep"  # made empty by the test before the apply: must survive revert
INNER = f"{KEPT}/inner/x.py"
VERSION = "vllm/version.py"


def mode_of(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def dirs_series(tmp_path: Path, vllm_tree: Path) -> Path:
    """An executable new file in two new folders, a new file under a pre-existing empty folder,
    and an edit of a real file."""
    return make_series(tmp_path / "series", vllm_tree, [
        new_file_diff(TOOL, ["#!/usr/bin/env python3", "TOOL = 1"], mode="100755")
        + new_file_diff(INNER, ["X = 1"]),
        append_diff(vllm_tree, VERSION, "M3PATCH_MODE_TEST = 1"),
    ])


def test_new_file_mode_is_honoured_and_modified_files_keep_mode_and_owner(
        vllm_tree: Path, dirs_series: Path) -> None:
    version = vllm_tree / VERSION
    replace_file(version, version.read_bytes())  # own inode: chmod must not reach the cache
    version.chmod(0o640)
    os.chown(version, 1234, 2345)  # the tests run as root in CI; a vLLM owned by someone else
    tree, series = tree_at(vllm_tree), load_series(dirs_series)
    apply_series(tree, series)
    assert mode_of(vllm_tree / TOOL) == 0o755
    assert mode_of(vllm_tree / INNER) == 0o644
    info = version.stat()
    assert b"M3PATCH_MODE_TEST" in version.read_bytes()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o640, 1234, 2345)
    revert_series(tree, series)
    info = version.stat()
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o640, 1234, 2345)


def test_revert_removes_exactly_the_folders_the_apply_created(
        vllm_tree: Path, dirs_series: Path) -> None:
    (vllm_tree / KEPT).mkdir()
    tree, series = tree_at(vllm_tree), load_series(dirs_series)
    apply_series(tree, series)
    assert (vllm_tree / TOOL).is_file() and (vllm_tree / INNER).is_file()
    revert_series(tree, series)
    assert not (vllm_tree / "vllm/m3patch_newpkg").exists()
    assert not (vllm_tree / KEPT / "inner").exists()
    assert (vllm_tree / KEPT).is_dir(), "revert removed a folder that existed before the apply"
    (vllm_tree / KEPT).rmdir()
    assert verify_against_record(vllm_tree) == []


def test_revert_leaves_a_created_folder_that_holds_someone_elses_file(
        vllm_tree: Path, dirs_series: Path) -> None:
    tree, series = tree_at(vllm_tree), load_series(dirs_series)
    apply_series(tree, series)
    (vllm_tree / "vllm/m3patch_newpkg/sub/notes.txt").write_text("not m3patch's\n")
    revert_series(tree, series)
    assert (vllm_tree / "vllm/m3patch_newpkg/sub/notes.txt").is_file()
    assert not (vllm_tree / TOOL).exists()


@pytest.mark.parametrize("step", range(1, 12))  # every step before the ledger
def test_failed_apply_removes_the_folders_it_created(
        vllm_tree: Path, dirs_series: Path, step: int, monkeypatch: pytest.MonkeyPatch) -> None:
    (vllm_tree / KEPT).mkdir()
    monkeypatch.setenv("M3PATCH_FAULT", f"fail-after:{step}")
    with pytest.raises(errors.TreeIOError, match="every file restored"):
        apply_series(tree_at(vllm_tree), load_series(dirs_series))
    assert not (vllm_tree / "vllm/m3patch_newpkg").exists()
    assert not (vllm_tree / KEPT / "inner").exists() and (vllm_tree / KEPT).is_dir()


def test_sigkill_mid_apply_then_recovery_removes_the_created_folders(
        vllm_tree: Path, dirs_series: Path, m3patch_cli: CliRunner) -> None:
    """Kill at every write step up to the commit journal; the next run (a revert) rolls back."""
    args = ("--vllm-root", str(vllm_tree), "--series", str(dirs_series))
    tree, series = tree_at(vllm_tree), load_series(dirs_series)
    rolled_back = 0
    for step in range(1, 40):
        fault = m3patch_cli("apply", *args, env={"M3PATCH_FAULT": f"kill-after:{step}"})
        if fault.returncode == 0:
            break
        assert fault.returncode == -signal.SIGKILL, fault.stderr
        journal = state_dir(vllm_tree) / "journal.json"
        body = journal.read_text() if journal.exists() else ""
        report = revert_series(tree, series)
        rolled_back += any("rolled back" in n for n in report.notes)
        assert not (vllm_tree / "vllm/m3patch_newpkg").exists(), (step, body)
        assert not (vllm_tree / KEPT).exists(), step
        assert verify_against_record(vllm_tree) == [], step
    assert rolled_back >= 5  # journal, staging, mkdir and commit-journal steps were all hit
    apply_series(tree, series)
    assert verify_tree(tree, series).ok


def test_apply_and_revert_say_deleted_and_removed(
        vllm_tree: Path, test_series: Path, m3patch_cli: CliRunner) -> None:
    args = ("--vllm-root", str(vllm_tree), "--series", str(test_series))
    dry = m3patch_cli("apply", "--dry-run", *args)
    assert "would delete vllm/tool_parsers/beam_tool_parser.py" in dry.stdout, dry.stdout
    done = m3patch_cli("apply", *args)
    assert done.returncode == 0, done.stderr
    assert "deleted vllm/tool_parsers/beam_tool_parser.py" in done.stdout.splitlines()
    assert "wrote vllm/tool_parsers/beam_tool_parser.py" not in done.stdout
    assert "wrote vllm/m3patch_test_added.py" in done.stdout.splitlines()
    back = m3patch_cli("revert", *args)
    lines = back.stdout.splitlines()
    assert "removed vllm/m3patch_test_added.py" in lines
    assert "restored vllm/tool_parsers/beam_tool_parser.py" in lines
