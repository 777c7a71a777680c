"""A real two-node DP set (head + headless, loopback, one core each) through the local launcher:
per-node gates, a request through the head, and a killed node or head ending the whole set with
NodeLost (26) inside the teardown deadline, leaving no process behind. ~2 min per test here.
Memory: ~4 GiB head + ~2.6 GiB node. Run under `flock /tmp/m3patch-serve.lock`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cluster_helpers import set_records

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.local_launcher import TEARDOWN_S
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
READY_WAIT_S = 420
HEAD, NODE = NodeId("head", 0), NodeId("node", 0)


@dataclass
class LiveSet:
    proc: subprocess.Popen[str]
    run_dir: Path
    err: Path

    def records(self) -> dict[NodeId, rv.NodeRecord]:
        return set_records(self.run_dir)


def shm_since(start: float) -> list[Path]:
    """vLLM's /dev/shm files created after `start` (serve tests hold the serve lock: ours)."""
    return [p for p in Path("/dev/shm").iterdir()
            if p.name.startswith(("psm_", "sem.mp-")) and p.stat().st_mtime >= start]


@pytest.fixture
def live_set(cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LiveSet]:
    started = time.time()
    run_dir, err = tmp_path / "run", tmp_path / "stderr.txt"
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model)}
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(RECIPE), "--run-dir",
                                 str(run_dir), "--hold", "900"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=fh, text=True)
    deadline = time.monotonic() + READY_WAIT_S
    while "set ready" not in err.read_text() and proc.poll() is None:
        assert time.monotonic() < deadline, err.read_text()
        time.sleep(1.0)
    assert proc.poll() is None, f"set exited early ({proc.returncode}):\n{err.read_text()}"
    live = LiveSet(proc, run_dir, err)
    pgids = [r.pgid for r in live.records().values() if r.pgid is not None]
    yield live
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=TEARDOWN_S + 30)
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the set"
    assert shm_since(started) == [], "the set left /dev/shm files behind"


def complete(port: int) -> dict[str, object]:
    body = {"model": "tiny-moe", "prompt": "The capital of France is", "max_tokens": 8,
            "temperature": 0}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def kill_and_time(live: LiveSet, victim: NodeId) -> float:
    pgid = live.records()[victim].pgid
    assert pgid is not None
    start = time.monotonic()
    os.killpg(pgid, signal.SIGKILL)
    live.proc.wait(timeout=TEARDOWN_S + 120)
    return time.monotonic() - start


def assert_gated_and_answering(live: LiveSet) -> None:
    records = live.records()
    assert {records[HEAD].state, records[NODE].state} == {"ready"}
    assert records[HEAD].ledger_sha256 == records[NODE].ledger_sha256
    assert records[HEAD].tree_sha256 == records[NODE].tree_sha256
    assert records[NODE].verified and records[HEAD].verified
    head_log = (live.run_dir / "logs" / "head-0.log").read_text()
    node_log = (live.run_dir / "logs" / "node-0.log").read_text()
    assert f"ledger=sha256:{records[HEAD].ledger_sha256}" in head_log
    # one worker per node: the patched collectives and the CPU experts, once each
    assert node_log.count("m3patch[cpu-collectives]: ") == 1
    assert head_log.count("m3patch[cpu-collectives]: ") == 1
    assert node_log.count("Using CPUUnquantizedExperts MoE backend") == 1
    reply = complete(8775)
    assert reply["choices"], reply


def test_killed_node_ends_the_set_with_26(live_set: LiveSet) -> None:
    assert_gated_and_answering(live_set)
    took = kill_and_time(live_set, NODE)
    err = live_set.err.read_text()
    assert live_set.proc.returncode == 26, err
    assert "node node/0" in err
    assert took < TEARDOWN_S + 60, f"teardown took {took:.0f} s"


@pytest.mark.extended  # same set and teardown path as the killed node; another 3 min of two servers
def test_killed_head_takes_the_headless_node_with_it(live_set: LiveSet) -> None:
    took = kill_and_time(live_set, HEAD)
    err = live_set.err.read_text()
    assert live_set.proc.returncode == 26, err
    assert "node head/0" in err
    assert took < TEARDOWN_S + 60, f"teardown took {took:.0f} s"
    node = live_set.records()[NODE]
    assert node.state == "exited"
