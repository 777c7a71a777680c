"""Compile many sources with this interpreter, spread over the CPUs this process may use.

A release-sized series has over a thousand patched .py files and compiling them is nearly all
of a cold `verify`; compile() holds the GIL, so the work is split over forked children (each
gets a share balanced by size, the parent compiles the largest share itself; only a process
without other threads forks) and every child reports one verdict per source through a pipe. Nothing is written anywhere: a read-only command
may use it. Fail closed: a child that dies, is killed or reports anything but a verdict for each
source of its share has its share compiled again here, so no source passes unchecked.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import warnings
from collections.abc import Sequence

MAX_WORKERS = 8
MIN_BYTES = 2 << 20  # below this, forking costs more than it saves


def compile_one(path: str, data: bytes) -> str | None:
    """None when `data` compiles as a module here, else why not (a syntax error, or nesting or
    size that this interpreter's compiler cannot take, which the import would hit too)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings in vLLM sources are not ours
        try:
            compile(data, path, "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            return str(exc)
        except (RecursionError, MemoryError) as exc:  # too deep or too big for CPython's compiler
            return f"{type(exc).__name__}: {exc}"
    return None


def _compile_share(items: Sequence[tuple[str, bytes]], share: list[int]) -> dict[int, str | None]:
    return {i: compile_one(*items[i]) for i in share}


def workers() -> int:
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_WORKERS))


def shares(sizes: Sequence[int], count: int) -> list[list[int]]:
    """Indexes of `sizes` in `count` shares of about equal total size (largest first, each to
    the lightest share); share 0 is the largest total."""
    out: list[list[int]] = [[] for _ in range(count)]
    totals = [0] * count
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        lightest = totals.index(min(totals))
        out[lightest].append(i)
        totals[lightest] += sizes[i]
    order = sorted(range(count), key=lambda s: -totals[s])
    return [out[s] for s in order if out[s]]


def _may_fork() -> bool:
    """Fork only a single-threaded process on a platform where fork is sound: a thread of the
    serve path (a log pump, a watcher) may hold a lock the child would wait on forever."""
    if not hasattr(os, "fork") or sys.platform == "darwin":  # fork after macOS frameworks: unsafe
        return False
    return threading.active_count() == 1


def _child(items: Sequence[tuple[str, bytes]], share: list[int], write_fd: int) -> None:
    """In the forked child: compile the share, write the verdicts, exit without cleanup (the
    parent's buffers, atexit handlers and finally blocks are the parent's)."""
    code = 1
    try:
        verdicts = _compile_share(items, share)
        data = json.dumps([[i, v] for i, v in verdicts.items()]).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(write_fd, view):]
        code = 0
    finally:
        os._exit(code)


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


def _verdicts(raw: bytes, share: list[int]) -> dict[int, str | None] | None:
    """The child's verdicts when there is exactly one well-formed verdict per index, else None."""
    try:
        rows = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(rows, list):
        return None
    out: dict[int, str | None] = {}
    for row in rows:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], int)
                and (row[1] is None or isinstance(row[1], str))):
            return None
        out[row[0]] = row[1]
    return out if sorted(out) == sorted(share) else None


def _fork(items: Sequence[tuple[str, bytes]], share: list[int]) -> tuple[int, int] | None:
    """(pid, read end of its pipe) of a child compiling `share`; None where it cannot fork."""
    read_fd, write_fd = os.pipe()
    try:
        pid = os.fork()
    except OSError:
        os.close(read_fd)
        os.close(write_fd)
        return None
    if pid == 0:
        os.close(read_fd)
        _child(items, share, write_fd)
    os.close(write_fd)
    return pid, read_fd


def _collect(items: Sequence[tuple[str, bytes]], share: list[int], pid: int,
             read_fd: int) -> dict[int, str | None]:
    code = None
    try:
        raw = _read_all(read_fd)
    finally:
        os.close(read_fd)
        with contextlib.suppress(ChildProcessError):
            code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    got = _verdicts(raw, share) if code == 0 else None
    return got if got is not None else _compile_share(items, share)


def _stop(children: list[tuple[list[int], int, int]]) -> None:
    """The parent was interrupted: end its own children (by pid) and reap them."""
    for _, pid, read_fd in children:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.close(read_fd)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)


def compile_all(items: Sequence[tuple[str, bytes]]) -> list[str | None]:
    """Per (path, source): None when it compiles here, else the error; in forked children when
    there is enough work and more than one CPU (Linux and other fork platforms)."""
    count = workers()
    if count < 2 or sum(len(d) for _, d in items) < MIN_BYTES or not _may_fork():
        return list(_compile_share(items, list(range(len(items)))).values())
    parts = shares([len(d) for _, d in items], count)
    children = []
    own: list[int] = parts[0]
    for share in parts[1:]:
        child = _fork(items, share)
        if child is None:
            own = own + share
        else:
            children.append((share, *child))
    try:
        verdicts = _compile_share(items, own)
    except BaseException:
        _stop(children)
        raise
    for number, (share, pid, read_fd) in enumerate(children):
        try:
            verdicts.update(_collect(items, share, pid, read_fd))
        except BaseException:
            _stop(children[number + 1:])
            raise
    return [verdicts[i] for i in range(len(items))]
