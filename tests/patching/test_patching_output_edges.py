"""stdout on a full device (/dev/full: every write fails with ENOSPC) ends in the documented
OutputFailed code (27), never 70 or a traceback, for every tree command and both outputs; what
the command did stands. With the closed pipe, LANG=C, bad M3PATCH_* values and SIGTERM
(test_patching_status.py -k process_edges) every process edge has its documented code."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import REPO, CliRunner

from m3patch import errors
from m3patch.patching.ledger import read_ledger

SERIES = str(REPO / "patches" / "vllm-0.33.0")
FULL = Path("/dev/full")


def to_full(args: list[str], crash_dir: Path, stderr_to_full: bool = False) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env["M3PATCH_CRASH_DIR"] = str(crash_dir)
    with FULL.open("w") as full:
        proc = subprocess.run([sys.executable, "-m", "m3patch", *args], stdout=full,
                              stderr=full if stderr_to_full else subprocess.PIPE, text=True,
                              env=env, cwd=REPO, check=False, timeout=120)
    return proc.returncode, proc.stderr or ""


@pytest.mark.skipif(not FULL.exists(), reason="no /dev/full on this system")
def test_stdout_on_a_full_device_exits_27_for_every_command(
        vllm_tree: Path, tmp_path: Path, m3patch_cli: CliRunner) -> None:
    crash = tmp_path / "crash"
    tree = ["--vllm-root", str(vllm_tree), "--series", SERIES]
    for args in (["status", *tree], ["status", "--json", *tree], ["apply", "--dry-run", *tree],
                 ["apply", "--json", "--dry-run", *tree], ["revert", "--dry-run", *tree],
                 ["locate", "--vllm-root", str(vllm_tree)], ["series", "show", "--series", SERIES],
                 ["--version"]):
        code, stderr = to_full(args, crash)
        assert code == errors.OutputFailed.exit_code, (args, stderr)
        assert "cannot write the output: No space left on device" in stderr, args
        assert "Traceback" not in stderr and "internal error" not in stderr, args
    code, stderr = to_full(["apply", *tree], crash)  # the apply is done; its report is lost
    assert code == errors.OutputFailed.exit_code, stderr
    ledger = read_ledger(vllm_tree)
    assert ledger is not None and ledger.series == "vllm-0.33.0"
    assert m3patch_cli("verify", *tree).returncode == 0
    assert to_full(["status", *tree], crash, stderr_to_full=True)[0] == 27  # both streams full
    assert not crash.exists() or not list(crash.iterdir())  # no crash log: not a bug


def test_an_error_with_stderr_on_a_full_device_keeps_its_own_code(tmp_path: Path) -> None:
    code, _ = to_full(["status", "--vllm-root", str(tmp_path / "none")], tmp_path / "crash",
                      stderr_to_full=True)
    assert code == errors.VllmNotFound.exit_code
