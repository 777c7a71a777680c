"""stdout on a full device (/dev/full: every write fails with ENOSPC) ends in the documented
OutputFailed code (27), never 70 or a traceback, for every tree command and both outputs; what
the command did stands. With the closed pipe, LANG=C, bad M3PATCH_* values and SIGTERM
(test_patching_status.py -k process_edges) every process edge has its documented code."""

from __future__ import annotations

import contextlib
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


def _closed(args: list[str], crash_dir: Path, close: tuple[int, ...] = (1,)) -> tuple[int, str]:
    """The command run with these descriptors closed before it starts (`>&-`, `2>&-`)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env["M3PATCH_CRASH_DIR"] = str(crash_dir)
    closes = " ".join(f"{fd}>&-" for fd in close)
    script = 'exec "$@" ' + closes
    proc = subprocess.run(["sh", "-c", script, "sh", sys.executable, "-m", "m3patch", *args],
                          stderr=None if 2 in close else subprocess.PIPE, text=True, env=env,
                          cwd=REPO, check=False, timeout=120)
    return proc.returncode, proc.stderr or ""


def test_a_closed_stdout_exits_27_for_every_command_that_reports(
        vllm_tree: Path, tmp_path: Path) -> None:
    """Before: with stdout closed (`>&-`) Python leaves sys.stdout None; `status`, `recipe show`,
    `matrix` ended in 70 (AttributeError on None) with a crash log, and `status --json`,
    `locate`, `series list` exited 0 with their report lost. Now every write fails as a
    write to a closed descriptor: OutputFailed (27), with a hint."""
    crash = tmp_path / "crash"
    tree = ["--vllm-root", str(vllm_tree), "--series", SERIES]
    for args in (["status", *tree], ["status", "--json", *tree], ["locate", *tree[:2]],
                 ["series", "list"], ["recipe", "show", "mi300x_tp8"], ["matrix", "mi300x_tp8"],
                 ["bench", "compare", *(str(REPO / "tests/data/bench/runs" / r)
                                        for r in ("base", "new"))], ["--version"]):
        code, stderr = _closed(args, crash)
        assert code == errors.OutputFailed.exit_code, (args, stderr)
        assert "cannot write the output: stdout is closed" in stderr, args
        assert "Traceback" not in stderr and "internal error" not in stderr, args
    assert not crash.exists() or not list(crash.iterdir())


def test_a_file_opened_with_stdout_closed_never_takes_its_number(
        vllm_tree: Path, tmp_path: Path) -> None:
    """The next file opened after a closed descriptor takes its number: an apply with stdout
    and stderr closed would have printed its report into the tree lock or the ledger. The
    standard descriptors get /dev/null first: the apply completes (its report lost: 27), and
    the tree is exactly the series' (verify passes)."""
    tree = ["--vllm-root", str(vllm_tree), "--series", SERIES]
    code, _ = _closed(["apply", *tree], tmp_path / "crash", close=(1, 2))
    assert code == errors.OutputFailed.exit_code
    ledger = read_ledger(vllm_tree)
    assert ledger is not None and ledger.series == "vllm-0.33.0"
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    check = subprocess.run([sys.executable, "-m", "m3patch", "verify", *tree], env=env,
                           capture_output=True, text=True, check=False, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


def test_a_reader_that_left_exits_141_for_rich_output_too(tmp_path: Path) -> None:
    """Before: `bench compare A B | head -1` exited 1 with no word: rich's own broken-pipe
    handler raises SystemExit(1). Now a closed pipe is 141 for rich's output as for the rest."""
    runs = REPO / "tests" / "data" / "bench" / "runs"
    env = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    env["M3PATCH_CRASH_DIR"] = str(tmp_path / "crash")
    for args in (["bench", "compare", str(runs / "base"), str(runs / "new")],
                 ["recipe", "show", "mi300x_tp8"], ["series", "list"]):
        read, write = os.pipe()
        os.close(read)  # the reader has left before the first write
        try:
            proc = subprocess.run([sys.executable, "-m", "m3patch", *args], stdout=write,
                                  stderr=subprocess.PIPE, text=True, env=env, cwd=REPO,
                                  check=False, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == 141, (args, proc.returncode, proc.stderr)
        assert "Traceback" not in proc.stderr, args


def test_rich_output_to_a_reader_that_left_raises_a_broken_pipe(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `bench compare A B | head -1` exited 1 with no word when the reader left after
    the table: the summary goes through rich, whose own broken-pipe handler raises
    SystemExit(1). Now it raises BrokenPipeError, which the error handler makes 141."""
    from m3patch import output

    read, write = os.pipe()
    os.close(read)
    stream = os.fdopen(write, "w")
    monkeypatch.setattr(sys, "stdout", stream)
    output.stdout_console.cache_clear()
    try:
        with pytest.raises(BrokenPipeError):
            output.stdout_console().print("the summary")
    finally:
        output.stdout_console.cache_clear()
        monkeypatch.undo()
        with contextlib.suppress(BrokenPipeError):
            stream.close()


@pytest.mark.parametrize("args", [["--help"], ["apply", "--help"], ["series", "--help"],
                                  ["markers", "check", "--help"], ["--version"]])
def test_help_and_version_to_a_stream_that_refuses_them(args: list[str], tmp_path: Path) -> None:
    """Before (a second hostile review): argparse's own printing swallows a failed write, so
    `--help` to a closed stdout or /dev/full exited 0 with the help lost; `--version` to a
    reader that left was 27, not 141. Now: 27 for a closed stdout or a full device, 141 for
    a reader that left, as for every other output."""
    crash = tmp_path / "crash"
    code, stderr = _closed(args, crash)
    assert code == errors.OutputFailed.exit_code, (args, stderr)
    assert "cannot write the output" in stderr
    if FULL.exists():
        assert to_full(args, crash)[0] == errors.OutputFailed.exit_code, args
    read, write = os.pipe()
    os.close(read)
    try:
        proc = subprocess.run([sys.executable, "-m", "m3patch", *args], stdout=write,
                              stderr=subprocess.PIPE, text=True, check=False, timeout=120)
    finally:
        os.close(write)
    assert proc.returncode == 141, (args, proc.stderr)
    assert not crash.exists() or not list(crash.iterdir())
