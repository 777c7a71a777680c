"""Filesystem faults on the real vLLM 0.33.0 tree with the test series, through the CLI.

How each fault is made (tests run as root, so plain chmod proves nothing):
- read-only tree: a read-only bind mount of the tree (mount --bind; mount -o remount,ro,bind);
- permission denied on one file: `chattr +i` (immutable: even root gets EPERM on rename/link);
- disk full during staging: the tree on a small tmpfs filled up to the last few KiB, so the
  journal still fits and the staged post-images do not (a real ENOSPC, nothing injected);
- the tree on another filesystem than $TMPDIR: the same tmpfs while $TMPDIR stays on disk.
Tests that need mount or chattr skip (saying why) where the sandbox forbids them.
Every fault must end in exit 7 (TreeIOError) or 9 (HostilePatch) with one m3patch message, the
tree byte-identical, no leftovers, and the next run (fault removed) applied and verified.
"""

from __future__ import annotations

import contextlib
import io
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from core_helpers import fill, mounted

from m3patch import errors
from m3patch.main import main
from m3patch.patching.pristine import verify_against_record

TOUCHED = ("vllm/__init__.py", "vllm/_version.py", "vllm/version.py", "vllm/logger.py",
           "vllm/tool_parsers/beam_tool_parser.py",
           "vllm/model_executor/layers/quantization/utils/configs/"
           "N=7168,K=256,device_name=NVIDIA_L20,dtype=fp8_w8a8,block_shape=[128,128].json")


def cli(*args: str) -> tuple[int, str]:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(list(args))
    return code, err.getvalue()


def files_of(root: Path) -> dict[str, bytes]:
    """Every file's bytes; the documented lock file may appear on a refused run."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "lock"}


def leftovers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob("*")
            if p.name.endswith((".m3patch-new", ".m3patch-pre")) or ".tmp" in p.name or p.suffix in (".orig", ".rej") or p.name == "journal.json"]


def assert_clean_failure(code: int, stderr: str, expected: type[errors.M3PatchError]) -> None:
    assert code == expected.exit_code, stderr
    assert stderr.startswith("m3patch: error: ") and "Traceback" not in stderr


def apply_args(root: Path, series: Path) -> tuple[str, ...]:
    return ("apply", "--verify", "--vllm-root", str(root), "--series", str(series))


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def immutable(path: Path) -> Iterator[None]:
    done = _sh("chattr", "+i", str(path))
    if done.returncode != 0:
        pytest.skip(f"chattr +i not supported here ({done.stderr.strip()})")
    try:
        yield
    finally:
        _sh("chattr", "-i", str(path))


def test_read_only_tree_refused_cleanly(vllm_tree: Path, test_series: Path,
                                        tmp_path: Path) -> None:
    with mounted("--bind", str(vllm_tree), target=tmp_path / "ro") as ro:
        assert _sh("mount", "-o", "remount,ro,bind", str(ro)).returncode == 0
        code, stderr = cli(*apply_args(ro, test_series))
        assert_clean_failure(code, stderr, errors.TreeIOError)
        assert "Read-only file system" in stderr
    assert verify_against_record(vllm_tree) == [] and leftovers(vllm_tree) == []
    assert cli(*apply_args(vllm_tree, test_series))[0] == 0  # writable again: it applies


def test_verify_and_status_work_on_a_read_only_patched_tree(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    """A container image patched at build time and mounted read-only at run time."""
    assert cli(*apply_args(vllm_tree, test_series))[0] == 0
    with mounted("--bind", str(vllm_tree), target=tmp_path / "ro") as ro:
        assert _sh("mount", "-o", "remount,ro,bind", str(ro)).returncode == 0
        assert cli("verify", "--vllm-root", str(ro), "--series", str(test_series))[0] == 0
        assert cli("status", "--vllm-root", str(ro), "--series", str(test_series))[0] == 0


def test_dry_runs_on_a_read_only_tree_exit_0(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    """A dry run writes nothing, so it needs no write access: no lock file, no state folder."""
    with mounted("--bind", str(vllm_tree), target=tmp_path / "ro") as ro:
        assert _sh("mount", "-o", "remount,ro,bind", str(ro)).returncode == 0
        code, stderr = cli("apply", "--dry-run", "--vllm-root", str(ro), "--series", str(test_series))
        assert code == 0, stderr
    assert not (vllm_tree / "vllm/.m3patch").exists()
    assert cli(*apply_args(vllm_tree, test_series))[0] == 0
    with mounted("--bind", str(vllm_tree), target=tmp_path / "ro2") as ro:
        assert _sh("mount", "-o", "remount,ro,bind", str(ro)).returncode == 0
        code, stderr = cli("revert", "--dry-run", "--vllm-root", str(ro), "--series", str(test_series))
        assert code == 0, stderr


# Regression (found by this suite, fixed by the owner):
# "bug: apply_api.apply_series takes txn.tree_lock (opens vllm/.m3patch/lock O_RDWR) before "
# "it knows there is nothing to write, so `m3patch apply` (and serve's apply+verify) on an "
# "already patched READ-ONLY tree exits 7 instead of 0 'already applied'"
def test_apply_on_a_read_only_already_patched_tree_is_a_no_op(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    assert cli(*apply_args(vllm_tree, test_series))[0] == 0
    with mounted("--bind", str(vllm_tree), target=tmp_path / "ro") as ro:
        assert _sh("mount", "-o", "remount,ro,bind", str(ro)).returncode == 0
        code, stderr = cli(*apply_args(ro, test_series))
        assert code == 0, stderr


@pytest.mark.parametrize("victim", ["vllm/logger.py", "vllm/tool_parsers/beam_tool_parser.py",
                                    "vllm/tool_parsers", "vllm"])
def test_permission_denied_on_one_path_restores_every_file(
        vllm_tree: Path, test_series: Path, victim: str) -> None:
    before = files_of(vllm_tree)
    with immutable(vllm_tree / victim):
        code, stderr = cli(*apply_args(vllm_tree, test_series))
        assert_clean_failure(code, stderr, errors.TreeIOError)
        assert "Operation not permitted" in stderr
        assert files_of(vllm_tree) == before and leftovers(vllm_tree) == []
    code, stderr = cli(*apply_args(vllm_tree, test_series))  # the next run recovers
    assert code == 0, stderr
    assert cli("revert", "--vllm-root", str(vllm_tree), "--series", str(test_series))[0] == 0
    assert verify_against_record(vllm_tree) == []


@pytest.mark.parametrize("victim", ["vllm/logger.py", "vllm/m3patch_test_added.py",
                                    "vllm/tool_parsers/beam_tool_parser.py"])
def test_target_replaced_by_a_directory(vllm_tree: Path, test_series: Path, victim: str) -> None:
    path = vllm_tree / victim
    saved = path.read_bytes() if path.exists() else None
    if saved is not None:
        path.unlink()
    path.mkdir()
    (path / "inner.py").write_text("x = 1\n")
    before = files_of(vllm_tree)
    code, stderr = cli(*apply_args(vllm_tree, test_series))
    assert code in (errors.TreeIOError.exit_code, errors.PatchConflict.exit_code), stderr
    assert stderr.startswith("m3patch: error: ") and victim in stderr
    assert files_of(vllm_tree) == before and leftovers(vllm_tree) == []
    shutil.rmtree(path)
    if saved is not None:
        path.write_bytes(saved)
    assert cli(*apply_args(vllm_tree, test_series))[0] == 0


def test_tree_reached_through_a_symlinked_root(vllm_tree: Path, test_series: Path,
                                               tmp_path: Path) -> None:
    link = tmp_path / "site-packages-link"
    link.symlink_to(vllm_tree)
    for command in ("apply", "verify", "revert"):
        code, stderr = cli(command, "--vllm-root", str(link), "--series", str(test_series))
        assert code == 0, (command, stderr)
    assert verify_against_record(vllm_tree) == [] and link.is_symlink()


def test_symlinked_package_dir_is_refused_and_the_real_path_works(
        vllm_tree: Path, test_series: Path, tmp_path: Path) -> None:
    """An editable-style layout: site-packages/vllm -> checkout/vllm. Writing through that link
    is refused (exit 9, named); --vllm-root at the checkout patches the same files."""
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (vllm_tree / "vllm").rename(checkout / "vllm")
    (vllm_tree / "vllm").symlink_to(checkout / "vllm")
    code, stderr = cli(*apply_args(vllm_tree, test_series))
    assert_clean_failure(code, stderr, errors.HostilePatch)
    assert "symlink" in stderr and not (checkout / "vllm/m3patch_test_added.py").exists()
    assert cli(*apply_args(checkout, test_series))[0] == 0


def small_tree(pristine: Path, root: Path) -> None:
    for rel in TOUCHED:
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(pristine / rel, root / rel)


def test_disk_full_during_staging(pristine_033: Path, test_series: Path, tmp_path: Path) -> None:
    with mounted("-t", "tmpfs", "-o", "size=1m", "tmpfs", target=tmp_path / "small") as fs:
        root = fs / "site-packages"
        small_tree(pristine_033, root)
        before = files_of(root)
        filler = fill(fs, 8192)  # room for the lock and journal, not for logger.py's stage
        code, stderr = cli(*apply_args(root, test_series))
        assert_clean_failure(code, stderr, errors.TreeIOError)
        assert "No space left on device" in stderr and "every file restored" in stderr
        assert files_of(root) == before and leftovers(root) == []
        filler.unlink()
        code, stderr = cli(*apply_args(root, test_series))  # space again: the next run applies
        assert code == 0, stderr


def test_tree_on_another_filesystem_than_tmpdir(pristine_033: Path, test_series: Path,
                                                tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TMPDIR", str(tmp_path))  # on the disk; the tree is on tmpfs
    with mounted("-t", "tmpfs", "-o", "size=8m", "tmpfs", target=tmp_path / "other") as fs:
        root = fs / "site-packages"
        small_tree(pristine_033, root)
        before = files_of(root)
        assert os.stat(root).st_dev != os.stat(tmp_path).st_dev
        monkeypatch.setenv("M3PATCH_FAULT", "fail-after:6")  # an I/O error mid-staging
        code, stderr = cli(*apply_args(root, test_series))
        assert_clean_failure(code, stderr, errors.TreeIOError)
        assert files_of(root) == before and leftovers(root) == []
        monkeypatch.delenv("M3PATCH_FAULT")
        for command in ("apply", "verify", "revert"):
            code, stderr = cli(command, "--vllm-root", str(root), "--series", str(test_series))
            assert code == 0, (command, stderr)
        assert files_of(root) == before


# Regression (found by this suite, fixed by the owner):
# "bug: txn._stage mkdir(parents=True)s the folders of an added file; neither txn._rollback "
# "(failed apply) nor revert removes them, so an empty vllm/<new>/ stays behind (importable "
# "as a namespace package) and the tree is not restored"
def test_failed_apply_and_revert_leave_no_new_folders(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    from test_patching_props import FileCase, make_series, write_tree

    from m3patch.patching.api import apply_series, revert_series
    from m3patch.patching.locate import tree_at
    from m3patch.patching.series import load_series

    cases = [FileCase("vllm/a.py", ["a\n"], ["b\n"]),
             FileCase("vllm/newpkg/sub/x.py", None, ["x = 1\n"])]
    tree_root = tmp_path / "tree"
    write_tree(tree_root, {"vllm/a.py": ["a\n"]})
    tree, series = tree_at(tree_root), load_series(make_series(tmp_path, cases))
    monkeypatch.setenv("M3PATCH_FAULT", "fail-after:4")  # after the new file was staged
    with pytest.raises(errors.TreeIOError):
        apply_series(tree, series)
    monkeypatch.delenv("M3PATCH_FAULT")
    assert not (tree_root / "vllm/newpkg").exists(), "failed apply left vllm/newpkg/"
    apply_series(tree, series)
    revert_series(tree, series)
    assert not (tree_root / "vllm/newpkg").exists(), "revert left vllm/newpkg/"
