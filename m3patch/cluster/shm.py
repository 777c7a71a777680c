"""The /dev/shm files a killed vLLM leaves behind, and only those of this set.

vLLM's shared-memory buffers (`psm_*`) and multiprocessing semaphores (`sem.mp-*`) are unlinked
by the process that made them when it exits cleanly; SIGKILL skips that. Other vLLM servers on
the same host (other users, other sets) own files with the same names, so a file is removed only
when it was seen mapped by one of this set's processes (from /proc/PID/maps), is owned by this
user and was created after the set started.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

SHM = Path("/dev/shm")
PREFIXES = ("psm_", "sem.mp-")
SCAN_EVERY_S = 1.0


def mapped_shm(pids: Iterable[int]) -> set[Path]:
    """The /dev/shm files (ours by name) that these processes have mapped right now.

    Matched by inode, not by the name in /proc/PID/maps: glibc's sem_open maps a temporary
    `sem.XXXXXX` and then links it as `sem.mp-...`, so maps never shows the name that leaks."""
    inodes: set[int] = set()
    for pid in pids:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
        except OSError:  # exited meanwhile, or not ours to read
            continue
        for line in maps.splitlines():
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(str(SHM) + "/") and fields[4].isdigit():
                inodes.add(int(fields[4]))
    if not inodes:
        return set()
    found: set[Path] = set()
    with contextlib.suppress(OSError):
        for entry in os.scandir(SHM):
            with contextlib.suppress(OSError):
                if entry.name.startswith(PREFIXES) and entry.inode() in inodes:
                    found.add(SHM / entry.name)
    return found


class ShmTracker:
    """Scans the processes `pids()` returns every second; `clean()` removes what they leaked."""

    def __init__(self, pids: Callable[[], Iterable[int]]) -> None:
        self.started = time.time()
        self.seen: set[Path] = set()
        self._pids = pids
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def __enter__(self) -> ShmTracker:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=5.0)

    def scan(self) -> None:
        self.seen |= mapped_shm(self._pids())

    def _loop(self) -> None:
        while not self._stop.wait(SCAN_EVERY_S):
            self.scan()

    def clean(self) -> list[Path]:
        """Remove the seen files that still exist, are ours and newer than the set; the list."""
        removed = []
        for path in sorted(self.seen):
            with contextlib.suppress(OSError):
                info = path.stat()
                if info.st_uid == os.getuid() and info.st_mtime >= self.started - 1.0:
                    path.unlink()
                    removed.append(path)
        return removed
