"""A transaction's per-file work split over a few threads, each owning whole folders.

Creating, renaming, linking and unlinking a directory entry, and reading a file, are system
calls that release the GIL, and the file system serializes entry changes per folder: threads
that own disjoint folders change them in parallel, where one thread waits on each call in turn
(a release-sized apply creates, links, renames and unlinks some 5,000 entries). The calling
thread works one share itself, so a stop signal is handled where it always was. The first
error ends every share after its current item and is raised only once every thread has ended:
a rollback never runs while another thread still writes. A small batch runs on the calling
thread alone, in order.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

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
    items' order. The first exception (of any thread) is raised after every thread ended."""
    parts = shares(keys, thread_count(len(items)))
    if len(parts) <= 1:
        return [work(item) for item in items]
    results: list[R | None] = [None] * len(items)
    stop = threading.Event()
    errors: list[BaseException] = []

    def one_share(share: list[int]) -> None:
        try:
            for index in share:
                if stop.is_set():
                    return
                results[index] = work(items[index])
        except BaseException as exc:  # handed to the calling thread, raised there
            errors.append(exc)
            stop.set()

    threads = [threading.Thread(target=one_share, args=(share,), daemon=True,
                                name="m3patch-share") for share in parts[1:]]
    for thread in threads:
        thread.start()
    try:
        one_share(parts[0])
    finally:
        if errors:
            stop.set()
        _join_all(threads, stop)
    if errors:
        raise errors[0]
    return results  # type: ignore[return-value]  # every index was filled: no error


def _join_all(threads: list[threading.Thread], stop: threading.Event) -> None:
    """Wait for every thread; a stop signal while waiting ends the others after their current
    item, and is raised once they have ended."""
    pending: BaseException | None = None
    for thread in threads:
        while thread.is_alive():
            try:
                thread.join()
            except BaseException as exc:  # a signal handler's exception, in the calling thread
                stop.set()
                pending = pending or exc
    if pending is not None:
        raise pending
