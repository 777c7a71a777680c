"""A transaction's per-file work split over a few threads, each owning whole folders.

Creating, renaming, linking and unlinking a directory entry, and reading a file, are system
calls that release the GIL, and the file system serializes entry changes per folder: threads
that own disjoint folders change them in parallel, where one thread waits on each call in turn
(a release-sized apply creates, links, renames and unlinks some 5,000 entries). The calling
thread works one share itself, and only it takes signals (the others start and run with them
blocked). An error stops every share at the item it failed on (the items before it still run,
so the error raised is the lowest, as one thread would meet it); a stop signal while the calling
thread works ends every share after its current item; one while it waits for the others is
delivered once they have ended; either is raised only once every thread has ended: a rollback
never runs while another thread still writes. A small batch runs on the calling thread alone.
Limit: where the process has another thread that does not block signals, a signal handled at
the exact instruction inside Thread.start can still leave that share's thread unwaited for.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from m3patch.errors import Interrupted

T = TypeVar("T")
R = TypeVar("R")

MAX_THREADS = 4
MIN_PER_SHARE = 64  # below this a thread costs more than the system calls it overlaps


def thread_count(items: int) -> int:
    """Threads for a batch of `items`: one per usable CPU, at most MAX_THREADS, none idle."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = os.cpu_count() or 1
    return max(1, min(cpus, MAX_THREADS, items // MIN_PER_SHARE))


def shares(keys: Sequence[str], count: int) -> list[list[int]]:
    """The items' indices in `count` shares; items of one key (a folder) stay in one share, in
    their order, and the largest keys are placed first on the lightest share."""
    by_key: dict[str, list[int]] = {}
    for index, key in enumerate(keys):
        by_key.setdefault(key, []).append(index)
    out: list[list[int]] = [[] for _ in range(max(1, count))]
    for group in sorted(by_key.values(), key=len, reverse=True):
        min(out, key=len).extend(group)
    return [sorted(share) for share in out if share]


def run_shares(work: Callable[[T], R], items: Sequence[T], keys: Sequence[str]) -> list[R]:
    """work(item) for every item, items of one key on one thread in order; the results in the
    items' order. Raised once every thread has ended: a stop signal's exception (the first),
    else the error of the lowest item that failed (the one a single thread would have met
    first: the same on any machine). Where no thread can be started (a process limit), the
    calling thread works that share too."""
    count = thread_count(len(items))
    parts = shares(keys, count) if count > 1 else []
    if len(parts) <= 1:  # a small batch, or one folder: no split to make
        return [work(item) for item in items]
    batch = _Batch(work, items)
    waits: list[threading.Event] = []
    try:
        with signals_blocked():  # none inside Thread.start; the threads keep them blocked
            unstarted = [share for share in parts[1:] if not _started(batch, share, waits)]
        for share in [parts[0], *unstarted]:
            batch.run(share)
    except BaseException as exc:  # a stop signal in the calling thread
        batch.fail(STOPPED, exc)
    finally:
        _wait_all(batch, waits)
    return batch.outcome()


def _wait_all(batch: _Batch[T, R], waits: list[threading.Event]) -> None:
    """Until every started share has ended, signals blocked meanwhile (one that arrives is
    delivered once they are unblocked, its handler's exception taken as a stop), and whatever a
    handler raises inside the wait taken the same way: another thread of the process that does
    not block signals still runs this thread's handlers. It polls each share's own event, as an
    interrupted Thread.join marks a running thread ended (CPython 3.11)."""
    while True:
        try:
            with signals_blocked():
                for finished in waits:
                    while not finished.is_set():
                        time.sleep(WAIT_POLL_S)
            return
        except BaseException as exc:  # a stop: the others end after their current item
            batch.fail(STOPPED, exc)


WAIT_POLL_S = 0.002
# Synchronous faults are never blocked (the kernel would kill the process for them anyway).
_NOT_BLOCKED = {getattr(signal, name) for name in (
    "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT", "SIGKILL", "SIGSTOP")
    if hasattr(signal, name)}
_BLOCKED = signal.valid_signals() - _NOT_BLOCKED


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Asynchronous signals blocked in this thread (held by the kernel, not lost: delivered when
    unblocked, and their handlers run then); a thread started meanwhile keeps them blocked for
    its life, so a signal for the process goes to the calling thread."""
    mask = getattr(signal, "pthread_sigmask", None)
    if mask is None:  # not POSIX
        yield
        return
    old = mask(signal.SIG_BLOCK, _BLOCKED)
    try:
        yield
    finally:
        mask(signal.SIG_SETMASK, old)


STOPPED = -1  # the "item" a stop signal fails: every share ends after its current item


def _is_stop(exc: BaseException) -> bool:
    return not isinstance(exc, Exception) or isinstance(exc, Interrupted)


class _Batch(Generic[T, R]):
    """One run_shares call: the results, and the lowest failed item so far (none past it is
    started; every one before it still is, so the lowest failure is always found)."""

    def __init__(self, work: Callable[[T], R], items: Sequence[T]) -> None:
        self.work, self.items = work, items
        self.results: list[R | None] = [None] * len(items)
        self.lock = threading.Lock()
        self.limit = len(items)
        self.failures: dict[int, BaseException] = {}

    def fail(self, index: int, exc: BaseException) -> None:
        with self.lock:
            self.failures.setdefault(index, exc)  # the first stop signal stays the one raised
            self.limit = STOPPED if _is_stop(exc) else min(self.limit, index)

    def run(self, share: list[int], finished: threading.Event | None = None) -> None:
        try:
            for index in share:
                if index >= self.limit:
                    return
                try:
                    self.results[index] = self.work(self.items[index])
                except BaseException as exc:  # raised by the calling thread, in outcome()
                    self.fail(index, exc)
                    return
        finally:
            if finished is not None:
                finished.set()

    def outcome(self) -> list[R]:
        if self.failures:
            stops = [exc for exc in self.failures.values() if _is_stop(exc)]
            raise stops[0] if stops else self.failures[min(self.failures)]
        return self.results  # type: ignore[return-value]  # every index was filled


def _started(batch: _Batch[T, R], share: list[int], waits: list[threading.Event]) -> bool:
    finished = threading.Event()
    thread = threading.Thread(target=batch.run, args=(share, finished), daemon=True,
                              name="m3patch-share")
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread": a process or container pids limit
        return False
    waits.append(finished)
    return True
