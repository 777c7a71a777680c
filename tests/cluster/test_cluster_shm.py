"""The /dev/shm cleaner removes exactly the files the set's own processes mapped: a real child
maps a real shared-memory segment and a named semaphore and is SIGKILLed (so nothing unlinks it); a look-alike file
nobody of ours mapped stays."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from m3patch.cluster.shm import SHM, ShmTracker, mapped_shm

CHILD = """
import multiprocessing, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(seg._name, "shared_memory")  # as a SIGKILLed vLLM: nobody unlinks it
lock = multiprocessing.get_context("spawn").Lock()       # a named sem.mp-* while it lives
resource_tracker.unregister(lock._semlock.name, "semaphore")
print(seg.name, lock._semlock.name, flush=True)
time.sleep(60)
"""


def test_a_killed_process_s_segment_is_removed_and_nothing_else(tmp_path: Path) -> None:
    bystander = SHM / f"psm_m3patch_test_{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name, sem_name = child.stdout.readline().split()
        segment, semaphore = SHM / name.lstrip("/"), SHM / f"sem.{sem_name.lstrip('/')}"
        assert segment.exists() and segment.name.startswith("psm_")
        assert semaphore.exists() and semaphore.name.startswith("sem.mp-")
        with ShmTracker(lambda: [child.pid]) as tracker:
            bystander.write_bytes(b"x")  # newer than the tracker, ours, but never mapped by ours
            tracker.scan()
            # the semaphore by inode: glibc maps it under a temporary name, then links it
            assert {segment, semaphore} <= mapped_shm([child.pid])
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            time.sleep(0.2)
        assert segment.exists() and semaphore.exists()  # leaked by the kill
        assert sorted(tracker.clean()) == sorted([segment, semaphore])
        assert not segment.exists() and not semaphore.exists()
        assert bystander.exists()  # same prefix, never mapped by ours: kept
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        bystander.unlink(missing_ok=True)
