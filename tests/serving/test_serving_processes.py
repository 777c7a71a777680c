"""The one process-group stop ladder (serving.processes.stop_group), on real child processes.

The escalation needs a group that ignores SIGINT and SIGTERM, which a real vLLM server never
does on demand (it shuts down on SIGINT), so a python child with those signals caught and
ignored stands in; it forks a grandchild into its group to show the whole group is stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from m3patch.serving.processes import StopRung, group_members, start_group, stop_group

STUBBORN = """
import os, signal, sys, time
def note(signum, frame):
    print(signal.Signals(signum).name, os.getpid(), flush=True)
signal.signal(signal.SIGINT, note)
signal.signal(signal.SIGTERM, note)
if os.fork() == 0:
    time.sleep(600)  # the grandchild inherits the handlers and the group
    sys.exit(0)
print("ready", flush=True)
time.sleep(600)
"""


def _start(script: str, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60  # generous: the machine may be busy with a real server
    while time.monotonic() < deadline and not (
            "ready" in log.read_text() and len(group_members(proc.pid)) == 2):
        time.sleep(0.05)
    assert len(group_members(proc.pid)) == 2, log.read_text()
    return proc


def test_a_group_ignoring_sigint_and_sigterm_is_escalated_to_sigkill(tmp_path: Path) -> None:
    log = tmp_path / "stubborn.log"
    proc = _start(STUBBORN, log)
    # Graces long enough for both processes to run their handlers on a loaded machine.
    ladder = (StopRung(signal.SIGINT, 2.0), StopRung(signal.SIGTERM, 2.0),
              StopRung(signal.SIGKILL, 10.0))
    started = time.monotonic()
    status = stop_group(proc, ladder)
    took = time.monotonic() - started
    assert status == -signal.SIGKILL
    assert group_members(proc.pid) == []  # the grandchild too, not just the leader
    assert 4.0 <= took < 14.0, took  # both graces were waited out, then SIGKILL ended it
    # Both processes share the log; their lines may interleave, so count words, not lines.
    noted = log.read_text()
    assert noted.count("SIGINT") == 2 and noted.count("SIGTERM") == 2  # both processes, each rung


def test_a_group_that_goes_on_the_first_signal_gets_no_other(tmp_path: Path) -> None:
    log = tmp_path / "polite.log"
    proc = _start("import os, time\nif os.fork() == 0:\n    time.sleep(600)\n"
                  "print('ready', flush=True)\ntime.sleep(600)\n", log)
    started = time.monotonic()
    status = stop_group(proc, (StopRung(signal.SIGTERM, 5.0), StopRung(signal.SIGKILL, 5.0)))
    assert status == -signal.SIGTERM and group_members(proc.pid) == []
    assert time.monotonic() - started < 2.0


def test_a_stopped_group_is_continued_to_act_on_the_graceful_signal(tmp_path: Path) -> None:
    """A hung node's processes may be stopped (SIGSTOP, or a debugger): SIGINT stays pending on
    a stopped process, so without a SIGCONT the ladder waits out the rung and ends in SIGKILL."""
    log = tmp_path / "stopped.log"
    proc = _start("import os, time\nif os.fork() == 0:\n    time.sleep(600)\n"
                  "print('ready', flush=True)\ntime.sleep(600)\n", log)
    os.killpg(proc.pid, signal.SIGSTOP)
    started = time.monotonic()
    status = stop_group(proc, (StopRung(signal.SIGINT, 10.0), StopRung(signal.SIGKILL, 5.0)))
    assert status != -signal.SIGKILL and group_members(proc.pid) == []
    assert time.monotonic() - started < 5.0


def test_a_leader_already_gone_is_not_signalled(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"], start_new_session=True)
    proc.wait()
    assert stop_group(proc, (StopRung(signal.SIGKILL, 1.0),)) == 3


@contextlib.contextmanager
def sigint_ignored() -> Iterator[None]:
    """This process as a shell's background job starts it: SIGINT ignored, which exec keeps."""
    before = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, before)


SLEEPER = "print('ready', flush=True)\nimport time\ntime.sleep(600)\n"
LADDER = (StopRung(signal.SIGINT, 5.0), StopRung(signal.SIGKILL, 5.0))


def _ready(proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and "ready" not in log.read_text():
        time.sleep(0.05)


def test_a_child_started_while_sigint_is_ignored_still_goes_on_the_first_rung(
        tmp_path: Path) -> None:
    log = tmp_path / "child.log"
    with sigint_ignored(), log.open("wb") as out:
        proc = start_group([sys.executable, "-c", SLEEPER], stdout=out, stderr=subprocess.STDOUT)
        plain = subprocess.Popen([sys.executable, "-c", SLEEPER], stdout=out,
                                 stderr=subprocess.STDOUT, start_new_session=True)
    _ready(proc, log)
    started = time.monotonic()
    status = stop_group(proc, LADDER)
    assert status != -signal.SIGKILL and time.monotonic() - started < 4.0, status
    assert group_members(proc.pid) == []
    # Without start_group the child inherits the ignore: SIGINT is lost and only SIGKILL ends it.
    started = time.monotonic()
    assert stop_group(plain, LADDER) == -signal.SIGKILL
    assert time.monotonic() - started >= 5.0


ODD_NAME = """
import ctypes, time
# PR_SET_NAME: any process may call itself anything, bytes that are no UTF-8 included
ctypes.CDLL(None).prctl(15, ctypes.c_char_p(b"\\xff\\xfe) Z 1"), 0, 0, 0)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_process_named_with_bytes_that_are_no_utf8_breaks_no_scan(tmp_path: Path) -> None:
    """Before: /proc/PID/stat was read as UTF-8, and any process on the host (any user's) that
    named itself so made every scan of /proc raise: a group whose leader had exited was never
    stopped, and the stop ended in a traceback."""
    log = tmp_path / "odd.log"
    with log.open("wb") as out:
        odd = subprocess.Popen([sys.executable, "-c", ODD_NAME], stdout=out,
                               start_new_session=True)
    try:
        _ready(odd, log)
        assert group_members(odd.pid) == [odd.pid]  # its name's ")" and "Z" fool no field
        # a group whose leader is gone and whose member still runs: the stop scans /proc
        leader = start_group([sys.executable, "-c", "import os, time\nif os.fork():\n"
                              "    raise SystemExit(0)\ntime.sleep(600)\n"])
        leader.wait(timeout=30)
        deadline = time.monotonic() + 30
        while not group_members(leader.pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert stop_group(leader, (StopRung(signal.SIGKILL, 5.0),)) == 0
        assert group_members(leader.pid) == []
    finally:
        odd.kill()
        odd.wait(timeout=30)
