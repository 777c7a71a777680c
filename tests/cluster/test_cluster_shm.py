"""The /dev/shm cleaner removes exactly the files the set's own processes mapped: a real child
maps a real shared-memory segment and is SIGKILLed (so nothing unlinks it); a look-alike file
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
import sys, time
from multiprocessing import resource_tracker, shared_memory
seg = shared_memory.SharedMemory(create=True, size=4096)
resource_tracker.unregister(seg._name, "shared_memory")  # as a SIGKILLed vLLM: nobody unlinks it
print(seg.name, flush=True)
time.sleep(60)
"""


def test_a_killed_process_s_segment_is_removed_and_nothing_else(tmp_path: Path) -> None:
    bystander = SHM / f"psm_m3patch_test_{os.getpid()}"
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None
        name = child.stdout.readline().strip().lstrip("/")
        segment = SHM / name
        assert segment.exists() and name.startswith("psm_")
        with ShmTracker(lambda: [child.pid]) as tracker:
            bystander.write_bytes(b"x")  # newer than the tracker, ours, but never mapped by ours
            tracker.scan()
            assert segment in mapped_shm([child.pid])
            os.kill(child.pid, signal.SIGKILL)
            child.wait()
            time.sleep(0.2)
        assert segment.exists()  # leaked by the kill
        assert tracker.clean() == [segment]
        assert not segment.exists()
        assert bystander.exists()  # same prefix, never mapped by ours: kept
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        bystander.unlink(missing_ok=True)
