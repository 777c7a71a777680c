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
