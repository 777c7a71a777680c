"""verify compiles patched .py files with the interpreter that will import the tree.

A real second CPython is needed: `type X = int` (PEP 695) is valid from 3.12 on and a
SyntaxError before, so the verdict shows which interpreter compiled.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import CliRunner, make_series, new_file_diff

from m3patch import errors
from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.series import load_series

PEP695 = "vllm/m3patch_pep695.py"


def accepts_pep695(version: tuple[int, int]) -> bool:
    return version >= (3, 12)


def _version(python: str) -> tuple[int, int] | None:
    try:
        out = subprocess.run([python, "-I", "-S", "-c", "import sys; print(*sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30, check=False).stdout
        major, minor = out.split()
        return int(major), int(minor)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def other_interpreter() -> str:
    """A CPython >= 3.8 that disagrees with this one about PEP 695 syntax."""
    mine = accepts_pep695(sys.version_info[:2])
    names = [shutil.which(f"python3.{minor}") for minor in range(8, 15)]
    candidates = sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.*/bin/python3")))
    for path in [*candidates, *[n for n in names if n]]:
        version = _version(path)
        if version is not None and version >= (3, 8) and accepts_pep695(version) != mine:
            return path
    pytest.skip("needs a second CPython on the other side of 3.12 (e.g. pyenv install 3.12)")


@pytest.fixture
def pep695_tree(vllm_tree: Path, tmp_path: Path) -> tuple[Path, Path]:
    series = make_series(tmp_path / "series", vllm_tree,
                         [new_file_diff(PEP695, ["type Alias = int"])])
    apply_series(tree_at(vllm_tree), load_series(series))
    return vllm_tree, series


def test_verify_compiles_with_the_interpreter_given_by_python(
        pep695_tree: tuple[Path, Path], m3patch_cli: CliRunner) -> None:
    root, series = pep695_tree
    other = other_interpreter()
    proc = m3patch_cli("verify", "--vllm-root", str(root), "--python", other,
                       "--series", str(series))
    if accepts_pep695(sys.version_info[:2]):  # m3patch's own would pass; the target's fails
        assert proc.returncode == errors.VerifyFailed.exit_code, proc.stderr
        assert f"{PEP695}: does not compile with {other}" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr
        assert f"compiled with {other} (Python 3.1" in proc.stdout


def test_verify_uses_the_interpreter_the_tree_was_found_through(
        pep695_tree: tuple[Path, Path], m3patch_cli: CliRunner) -> None:
    root, series = pep695_tree
    other = other_interpreter()
    env = {"PYTHONPATH": str(root)}  # so `other` imports vllm from this tree
    where = m3patch_cli("locate", "--python", other, env=env)
    assert where.returncode == 0 and str(root) in where.stdout, where.stderr
    proc = m3patch_cli("apply", "--verify", "--python", other, "--series", str(series), env=env)
    ok = not accepts_pep695(sys.version_info[:2])
    assert (proc.returncode == 0) is ok, proc.stderr
    assert other in (proc.stdout if ok else proc.stderr)


def test_without_a_known_interpreter_verify_falls_back_to_its_own_and_says_so(
        pep695_tree: tuple[Path, Path], m3patch_cli: CliRunner) -> None:
    root, series = pep695_tree
    proc = m3patch_cli("verify", "--vllm-root", str(root), "--series", str(series))
    if accepts_pep695(sys.version_info[:2]):
        assert proc.returncode == 0, proc.stderr
        assert "m3patch's own; no interpreter known for this tree" in proc.stdout
    else:
        assert proc.returncode == errors.VerifyFailed.exit_code
        assert f"{PEP695}: does not compile with {sys.executable}" in proc.stderr
        assert "m3patch's own; no interpreter known for this tree" in proc.stderr


def test_a_missing_interpreter_fails_closed(pep695_tree: tuple[Path, Path],
                                             m3patch_cli: CliRunner, tmp_path: Path) -> None:
    root, series = pep695_tree
    gone = str(tmp_path / "no-such-python")
    proc = m3patch_cli("verify", "--vllm-root", str(root), "--python", gone,
                       "--series", str(series))
    assert proc.returncode == errors.VerifyFailed.exit_code, proc.stderr
    assert f"cannot compile the patched files with {gone}" in proc.stderr
