"""Process groups: how a child starts (`start_group`), who is still alive (from /proc; Linux,
no psutil) and the one stop ladder.

`stop_group` is the only place that stops a child's process group: each rung sends one signal
to the whole group and waits its grace period for the leader and every member to go, so the
server (SIGINT 20 s, SIGTERM 10 s, SIGKILL 5 s) and the bench client (SIGTERM 5 s, SIGKILL)
escalate the same way, each with its own rungs.
"""

from __future__ import annotations

import contextlib
import math
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

WAIT_POLL_S = 0.1


class ProcEntry(NamedTuple):
    pid: int
    state: str
    ppid: int
    pgid: int


class StopRung(NamedTuple):
    sig: signal.Signals
    grace_s: float  # how long the group gets to go after this signal; math.inf: until it does


def start_group(argv: Sequence[str], **popen: Any) -> subprocess.Popen[bytes]:
    """Start `argv` as the leader of its own process group, with SIGINT at its default action.

    The stop ladder's first rung is SIGINT. A signal ignored at exec stays ignored, and a shell
    starts a background job of a script with SIGINT ignored; m3patch run that way would pass the
    ignore on to every child, and each stop would wait out the whole SIGINT grace (20 s for a
    server) before SIGTERM."""
    inherited_ignore = signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    # preexec_fn only in that case: one signal() call in the child, no lock taken
    return subprocess.Popen(
        list(argv), start_new_session=True,
        preexec_fn=_default_sigint if inherited_ignore else None, **popen)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def live_processes() -> Iterator[ProcEntry]:
    """Every process except zombies (already dead, waiting to be reaped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            # bytes: any process may name itself with bytes that are no UTF-8 (prctl)
            stat = (entry / "stat").read_bytes()
        except OSError:  # exited between listing and reading
            continue
        # The command name may contain spaces and ")"; fields after the last ")" are fixed.
        fields = stat[stat.rfind(b")") + 2:].split()
        if len(fields) > 2 and fields[0] != b"Z":
            yield ProcEntry(int(entry.name), fields[0].decode("ascii", "replace"), int(fields[1]),
                            int(fields[2]))


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid`."""
    return [p.pid for p in live_processes() if p.pgid == pgid]


def children_of(pid: int) -> list[int]:
    """Live pids whose parent is `pid`."""
    return [p.pid for p in live_processes() if p.ppid == pid]


def stop_group(proc: subprocess.Popen[bytes], rungs: Sequence[StopRung]) -> int | None:
    """Climb the rungs until the leader (started with start_new_session) and its group are gone.

    Returns the leader's exit status (negative: the signal that ended it), None if it outlived
    every rung.
    """
    with signals_held():
        for rung in rungs:
            if not _group_alive(proc):
                break
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, rung.sig)
                if rung.sig != signal.SIGKILL:
                    # a stopped (hung, SIGSTOPped) member only acts on the signal once continued;
                    # without this its graceful stop waits out the rung and ends in SIGKILL
                    os.killpg(proc.pid, signal.SIGCONT)
            _wait_gone(proc, rung.grace_s)
    return proc.poll()


def _group_alive(proc: subprocess.Popen[bytes]) -> bool:
    # The leader's pid is the group id; workers may outlive a leader that exited first.
    return proc.poll() is None or bool(group_members(proc.pid))


def _wait_gone(proc: subprocess.Popen[bytes], grace_s: float) -> None:
    end = time.monotonic() + grace_s if math.isfinite(grace_s) else math.inf
    while time.monotonic() < end and _group_alive(proc):
        time.sleep(WAIT_POLL_S)


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """A second Ctrl-C (or CI's SIGTERM) must not abort a stop half-way and orphan the group."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
