"""The socket files a server's processes bound, found through /proc and removed only when they
are provably the server's (serving.ipc_sockets).

A python child stands in for the server here: the rules (what counts as bound by the group,
what is left because someone else holds or replaced it) need sockets placed and replaced on
purpose, which a real server does not do on demand. The real server is shown in
test_serving_cpu.py (its sockets gone after the stop).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from m3patch.serving import ipc_sockets
from m3patch.serving.processes import group_members, start_group

BINDER = """
import socket, sys, time
held = []
for path in sys.argv[1:]:
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen()
    held.append(s)
abstract = socket.socket(socket.AF_UNIX)
abstract.bind("\\0m3patch-test-abstract")  # no file: nothing to find or remove
print("bound", flush=True)
time.sleep(600)
"""


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="m3s-"))
    yield path
    shutil.rmtree(path)


def _binder(paths: list[Path], log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        proc = start_group([sys.executable, "-c", BINDER, *map(str, paths)], stdout=out)
    deadline = time.monotonic() + 60
    while "bound" not in log.read_text():
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc


def _kill(proc: subprocess.Popen[bytes]) -> None:
    os.killpg(proc.pid, signal.SIGKILL)  # as a hard stop leaves them: no close, no unlink
    proc.wait(timeout=30)


def test_the_groups_sockets_are_found_and_removed_after_it(short_tmp: Path) -> None:
    names = [short_tmp / "0f3e8c1a-5c1d", short_tmp / "a8e1f2c3-77aa"]
    proc = _binder(names, short_tmp / "log")
    try:
        found = ipc_sockets.bound_by(group_members(proc.pid))
    finally:
        _kill(proc)
    assert sorted(found) == sorted(map(str, names))
    assert all(p.is_socket() for p in names)  # what a stopped server leaves
    assert ipc_sockets.remove_unbound(found) == sorted(map(str, names))
    assert not any(p.exists() for p in names)


def test_what_is_not_provably_the_servers_is_left(short_tmp: Path) -> None:
    recreated, replaced, rebound = (short_tmp / n for n in ("recreated", "replaced", "rebound"))
    proc = _binder([recreated, replaced, rebound], short_tmp / "log")
    try:
        found = ipc_sockets.bound_by(group_members(proc.pid))
    finally:
        _kill(proc)
    assert len(found) == 3
    recreated.unlink()
    with socket.socket(socket.AF_UNIX) as another:  # another socket file at that path, unbound
        another.bind(str(recreated))
    replaced.unlink()
    replaced.write_text("someone's file now")
    rebound.unlink()
    other = socket.socket(socket.AF_UNIX)
    other.bind(str(rebound))  # someone else's socket, bound at the same path
    try:
        assert ipc_sockets.remove_unbound(found) == []
        assert recreated.is_socket() and replaced.read_text() == "someone's file now"
        assert rebound.is_socket()
    finally:
        other.close()


def test_nothing_is_found_for_processes_that_are_gone() -> None:
    assert ipc_sockets.bound_by([]) == {}
    assert ipc_sockets.bound_by([2**22 + 12345]) == {}  # no such pid
    assert ipc_sockets.remove_unbound({}) == []
