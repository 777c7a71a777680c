"""Hostile patches are refused before anything is written (HostilePatch, exit 9)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
from core_helpers import CliRunner

from m3patch import errors
from m3patch.patching.diffs import parse_patch, split_lines

LOG_HUNK = """@@ -31,6 +31,7 @@ _FORMAT = (
     "[%(fileinfo)s:%(lineno)d] %(message)s"
 )
 _DATE_FORMAT = "%m-%d %H:%M:%S"
+EVIL = 1
 _vllm_process_info: tuple[str, int] | None = None
""" + " \n" * 2  # two blank context lines (a space each: the diff prefix)


def one_patch_series(tmp_path: Path, patch: str) -> Path:
    """A one-patch series in tmp_path (lock not needed: hostile checks come first)."""
    series = tmp_path / "series"
    series.mkdir()
    (series / "0001-x.patch").write_text(patch)
    (series / "series.yaml").write_text(
        "schema: 1\nid: hostile\ntarget: {vllm-version: '0.33.0'}\npatches:\n"
        "  - {id: x, file: 0001-x.patch, summary: s, why: w, upstream: [], drop-when: never}\n")
    return series


@pytest.mark.parametrize(("old", "new", "needle"), [
    ("a/../../etc/passwd", "b/../../etc/passwd", "climbs out"),
    ("a/vllm/../../outside.py", "b/vllm/../../outside.py", "climbs out"),
    ("/etc/passwd", "/etc/passwd", "absolute path"),
    ("a/setup.py", "b/setup.py", "not under vllm/"),
])
def test_paths_outside_the_tree(tmp_path: Path, vllm_tree: Path, m3patch_cli: CliRunner,
                                old: str, new: str, needle: str) -> None:
    series = one_patch_series(tmp_path, f"--- {old}\n+++ {new}\n{LOG_HUNK}")
    proc = m3patch_cli("series", "lock", "--series", str(series), "--tree", str(vllm_tree))
    assert proc.returncode == errors.HostilePatch.exit_code, proc.stderr
    assert needle in proc.stderr and "Traceback" not in proc.stderr
    assert not (series / "series.lock.json").exists()


def test_binary_patch_refused() -> None:
    patch = ("diff --git a/vllm/x.bin b/vllm/x.bin\nindex 1..2 100644\n"
             "GIT binary patch\nliteral 4\nLcmZ?d00001\n\n")
    with pytest.raises(errors.HostilePatch, match="binary"):
        parse_patch(patch.encode(), "0001-bin.patch")
    with pytest.raises(errors.HostilePatch, match="NUL"):
        parse_patch(b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1 +1 @@\n-\x00\n+a\n", "nul.patch")


def test_symlink_escape_refused(tmp_path: Path, vllm_tree: Path, test_series: Path,
                                m3patch_cli: CliRunner) -> None:
    outside = tmp_path / "outside"
    shutil.copytree(vllm_tree / "vllm" / "tool_parsers", outside)
    shutil.rmtree(vllm_tree / "vllm" / "tool_parsers")
    os.symlink(outside, vllm_tree / "vllm" / "tool_parsers")  # a parent dir pointing out
    proc = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert proc.returncode == errors.HostilePatch.exit_code, proc.stderr
    assert "symlink points outside the tree" in proc.stderr
    assert (outside / "beam_tool_parser.py").exists()
    assert "m3patch_test_banner" not in (vllm_tree / "vllm/version.py").read_text()


def test_symlinked_target_file_refused(tmp_path: Path, vllm_tree: Path, test_series: Path,
                                       m3patch_cli: CliRunner) -> None:
    real = tmp_path / "logger.py"
    shutil.copyfile(vllm_tree / "vllm/logger.py", real)
    (vllm_tree / "vllm/logger.py").unlink()
    os.symlink(real, vllm_tree / "vllm/logger.py")
    proc = m3patch_cli("apply", "--vllm-root", str(vllm_tree), "--series", str(test_series))
    assert proc.returncode == errors.HostilePatch.exit_code, proc.stderr
    assert "the patch target is a symlink" in proc.stderr


def test_symlink_in_patch_refused() -> None:
    patch = ("diff --git a/vllm/link.py b/vllm/link.py\nnew file mode 120000\n"
             "--- /dev/null\n+++ b/vllm/link.py\n@@ -0,0 +1 @@\n+/etc/passwd\n"
             "\\ No newline at end of file\n")
    with pytest.raises(errors.HostilePatch, match="symlink"):
        parse_patch(patch.encode(), "link.patch")


def test_malformed_patch_is_a_usage_error() -> None:
    with pytest.raises(errors.UsageError, match="not a valid unified diff"):
        parse_patch(b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,3 +1,3 @@\n a\n", "short.patch")


def test_lines_split_on_newline_only() -> None:
    # str.splitlines() would also split at the form feed and shift every later hunk
    assert split_lines("a\x0cb\nc\u2028d\ne") == ["a\x0cb\n", "c\u2028d\n", "e"]


def test_no_newline_at_end_of_file_is_kept() -> None:
    patch = (b"--- a/vllm/x.py\n+++ b/vllm/x.py\n@@ -1,2 +1,2 @@\n a\n-b\n"
             b"\\ No newline at end of file\n+c\n\\ No newline at end of file\n")
    hunk = parse_patch(patch, "x.patch").files[0].hunks[0]
    assert hunk.old_lines == ("a\n", "b") and hunk.new_lines == ("a\n", "c")
