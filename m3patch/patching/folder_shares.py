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
Each share is claimed once, by its own thread or by the calling thread: a handler that raises
anywhere in the calling thread (another thread of the process that does not block signals still
runs them) cannot leave a share's thread unwaited for. m3patch's own stop handlers do not raise
while a batch is split (errors.stop keeps the stop; the batch raises it once every share ended):
with several signals pending CPython runs each handler at its next check, and one raising inside
the batch's own stop handling would escape it. Limit: a handler of someone else's that raises,
handled a second time at the exact instruction between two attempts to wait, ends the wait early.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Generic, TypeVar

from m3patch.errors import (
    Interrupted,
    defer_stops,
    end_deferring,
    raise_kept,
    stop_requested,
)

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
    main = threading.current_thread() is threading.main_thread()  # where handlers run
    batch = _Batch(work, items, watch_stops=main)
    # Every share is recorded before any thread exists, so a handler that raises anywhere below
    # (even inside Thread.start) cannot lose a thread: each share is worked by whoever claims it.
    slots = [_Share(part) for part in parts]
    mask = _current_mask()
    try:
        if main:  # m3patch's handlers keep a stop and return until every share has ended
            defer_stops(batch)
        _work_and_wait(batch, slots)
    finally:
        first_stop = end_deferring(batch) if main else None
        _restore_mask(mask)  # a foreign handler raising inside signals_blocked skipped its exit
    if first_stop is not None:
        raise_kept(first_stop)
    return batch.outcome()


def _work_and_wait(batch: _Batch[T, R], slots: list[_Share]) -> None:
    """Start the shares' threads, work the calling thread's share (and any no thread took), then
    wait for every thread; what a handler of someone else's raises meanwhile is a stop."""
    try:
        with signals_blocked():  # none inside Thread.start; the threads keep them blocked
            for slot in slots[1:]:
                _start(batch, slot)
        for slot in slots:  # its own share, then any whose thread has not begun (or none started)
            if slot.claim(CALLER):
                batch.run(slot.indices)
    except BaseException as exc:  # a stop signal in the calling thread
        batch.fail(STOPPED, exc)
    finally:
        while True:  # a handler may raise even on entering the wait; it is a stop like any other
            try:
                _wait_all(slots)
                break
            except BaseException as exc:
                batch.fail(STOPPED, exc)


def _wait_all(slots: list[_Share]) -> None:
    """Until every share a thread claimed has ended, and every thread known to have started has
    returned; a share no thread claimed yet is claimed here, so a thread that begins late finds
    it taken and ends at once. Signals are blocked meanwhile (one that arrives is delivered once
    they are unblocked); another thread of the process that does not block signals still runs
    this thread's handlers, so what they raise propagates to the caller, which waits again. It
    polls each share's own event, as an interrupted Thread.join marks a running thread ended
    (CPython 3.11); the join after it only lets a thread that has set it finish returning."""
    with signals_blocked():
        for slot in slots:
            slot.claim(CALLER)
            if slot.owner == CALLER and slot.thread is None:
                continue  # no thread, or one whose start was cut short: it cannot have worked
            while not slot.finished.is_set():
                time.sleep(WAIT_POLL_S)
            if slot.thread is not None:
                slot.thread.join(timeout=1.0)


WAIT_POLL_S = 0.002
# Synchronous faults are never blocked (the kernel would kill the process for them anyway).
_NOT_BLOCKED = {getattr(signal, name) for name in (
    "SIGSEGV", "SIGBUS", "SIGFPE", "SIGILL", "SIGTRAP", "SIGSYS", "SIGABRT", "SIGKILL", "SIGSTOP")
    if hasattr(signal, name)}
_BLOCKED = signal.valid_signals() - _NOT_BLOCKED


_MASK = getattr(signal, "pthread_sigmask", None)  # None: not POSIX, no thread masks


def _current_mask() -> set[signal.Signals] | None:
    return None if _MASK is None else _MASK(signal.SIG_BLOCK, [])


def _restore_mask(old: set[signal.Signals] | None) -> None:
    if _MASK is not None and old is not None:
        _MASK(signal.SIG_SETMASK, old)


@contextlib.contextmanager
def signals_blocked() -> Iterator[None]:
    """Asynchronous signals blocked in this thread (held by the kernel, not lost: delivered when
    unblocked, and their handlers run then); a thread started meanwhile keeps them blocked for
    its life, so a signal for the process goes to the calling thread."""
    if _MASK is None:
        yield
        return
    old = _MASK(signal.SIG_BLOCK, _BLOCKED)
    try:
        yield
    finally:
        _MASK(signal.SIG_SETMASK, old)


STOPPED = -1  # the "item" a stop signal fails: every share ends after its current item


def _is_stop(exc: BaseException) -> bool:
    return not isinstance(exc, Exception) or isinstance(exc, Interrupted)


class _Batch(Generic[T, R]):
    """One run_shares call: the results, and the lowest failed item so far (none past it is
    started; every one before it still is, so the lowest failure is always found)."""

    def __init__(self, work: Callable[[T], R], items: Sequence[T], *, watch_stops: bool) -> None:
        self.work, self.items = work, items
        self.watch_stops = watch_stops  # a batch of the main thread, which keeps stops for it
        self.results: list[R | None] = [None] * len(items)
        self.lock = threading.Lock()
        self.limit = len(items)
        self.failures: dict[int, BaseException] = {}

    def fail(self, index: int, exc: BaseException) -> None:
        with self.lock:
            self.failures.setdefault(index, exc)  # the first stop signal stays the one raised
            self.limit = STOPPED if _is_stop(exc) else min(self.limit, index)

    def run(self, share: list[int]) -> None:
        for index in share:
            if index >= self.limit or (self.watch_stops and stop_requested()):
                return
            try:
                self.results[index] = self.work(self.items[index])
            except BaseException as exc:  # raised by the calling thread, in outcome()
                self.fail(index, exc)
                return

    def outcome(self) -> list[R]:
        if self.failures:
            stops = [exc for exc in self.failures.values() if _is_stop(exc)]
            raise stops[0] if stops else self.failures[min(self.failures)]
        return self.results  # type: ignore[return-value]  # every index was filled


CALLER, WORKER = "caller", "worker"


class _Share:
    """One share's items and who works them: the first to claim it, its own thread or the
    calling thread, and never both."""

    _claims = threading.Lock()

    def __init__(self, indices: list[int]) -> None:
        self.indices = indices
        self.owner: str | None = None
        self.finished = threading.Event()  # set by its thread as its last act
        self.thread: threading.Thread | None = None  # set once its Thread.start has returned

    def claim(self, who: str) -> bool:
        with self._claims:
            if self.owner is None:
                self.owner = who
                return True
            return False


def _work_share(batch: _Batch[T, R], slot: _Share) -> None:
    """A share's thread: signals blocked (inherited), so no handler ever raises here."""
    try:
        if slot.claim(WORKER):  # else the calling thread took it, or the batch is over
            batch.run(slot.indices)
    finally:
        slot.finished.set()


def _start(batch: _Batch[T, R], slot: _Share) -> None:
    thread = threading.Thread(target=_work_share, args=(batch, slot), daemon=True,
                              name="m3patch-share")
    try:
        thread.start()
    except RuntimeError:  # "can't start new thread": a pids limit; the calling thread claims
        return            # and works that share
    slot.thread = thread
