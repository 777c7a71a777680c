"""The client runner's deadline and server watch, and that it leaves no process behind.

These use a stand-in process instead of `vllm bench serve`: a client that hangs past its
deadline only happens when a server stops answering without dying, which the real CPU server
cannot be made to do on demand. The real client runs in test_bench_serve.py.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from m3patch.bench.client import log_tail, run_client
from m3patch.errors import BenchFailed, ServerDied
from m3patch.serving.processes import children_of

SLEEPER = [sys.executable, "-c", "import time; print('started', flush=True); time.sleep(60)"]


def test_a_cell_past_its_deadline_fails_and_its_client_is_stopped(tmp_path: Path) -> None:
    started = time.monotonic()
    with pytest.raises(BenchFailed, match=r"cell c1: vllm bench serve still running after its 1 s"):
        run_client(SLEEPER, cell_id="c1", log_path=tmp_path / "c1.log", deadline_s=1.0,
                   check_server=lambda: None)
    assert time.monotonic() - started < 10
    assert children_of(os.getpid()) == []
    assert BenchFailed.exit_code == 14


def test_a_dead_server_stops_the_client_and_its_error_propagates(tmp_path: Path) -> None:
    calls = []

    def server_dies_on_second_check() -> None:
        calls.append(1)
        if len(calls) >= 2:
            raise ServerDied("the server stopped during the sweep: test")

    with pytest.raises(ServerDied, match="stopped during the sweep"):
        run_client(SLEEPER, cell_id="c1", log_path=tmp_path / "c1.log", deadline_s=60,
                   check_server=server_dies_on_second_check)
    assert children_of(os.getpid()) == []
    assert "started" in (tmp_path / "c1.log").read_text()


def test_a_finished_client_returns_its_status_and_log(tmp_path: Path) -> None:
    argv = [sys.executable, "-c", "import sys; print('x it/s]'); print('done'); sys.exit(3)"]
    run = run_client(argv, cell_id="c1", log_path=tmp_path / "c1.log", deadline_s=60,
                     check_server=lambda: None)
    assert run.returncode == 3
    assert log_tail(run.log_path) == "done"  # progress-bar lines are dropped from the tail


LITTERER = """
import os, socket, tempfile
base = tempfile.gettempdir()
print(base, flush=True)
os.mkdir(os.path.join(base, "aiperf_mmap_0123"))  # as AIPerf leaves its dataset folder
socket.socket(socket.AF_UNIX).bind(os.path.join(base, "0f3e8c1a-5c1d-4d7e"))  # a ZMQ socket
print("littered", flush=True)
"""


@pytest.mark.parametrize("ends", ["finishes", "is stopped"])
def test_what_a_client_leaves_in_its_temporary_folder_goes_with_it(
        tmp_path: Path, short_tmp: Path, ends: str) -> None:
    """The client runs with a private temporary folder m3patch removes after it, however the
    cell ends; the temporary folder it would have used is left as it was."""
    argv = [sys.executable, "-c", LITTERER + ("import time; time.sleep(60)"
                                              if ends == "is stopped" else "")]
    env = {**os.environ, "TMPDIR": str(short_tmp)}
    log = tmp_path / "c1.log"
    if ends == "finishes":
        assert run_client(argv, cell_id="c1", log_path=log, deadline_s=60,
                          check_server=lambda: None, env=env).returncode == 0
    else:
        def dies_once_littered() -> None:
            if "littered" in log.read_text():
                raise ServerDied("the server stopped during the sweep: test")

        with pytest.raises(ServerDied):
            run_client(argv, cell_id="c1", log_path=log, deadline_s=120,
                       check_server=dies_once_littered, env=env)
    used = Path(log.read_text().splitlines()[0])
    assert used.parent == short_tmp and used.name.startswith("m3patch-client-")
    assert list(short_tmp.iterdir()) == []

