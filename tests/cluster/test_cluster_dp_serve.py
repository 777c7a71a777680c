"""A real two-node DP set (head + headless, one core each): across two network namespaces (the
multi-host test bed: each node its own address, hostname and loopback), every node binding and
advertising its own address, a request from the other host through the head's address, and a
killed node ending the whole set with NodeLost (26) inside the teardown deadline, leaving no
process behind; and, `extended`, the same set through the local launcher on loopback (every node
on one host, as the recipe's default asks), where a killed node or head ends the set.
~2 min per test here. Memory: ~4 GiB head + ~2.6 GiB node. Run under
`flock /tmp/m3patch-serve.lock`."""

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
from cluster_helpers import Bed, print_set_memory, set_records

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


@pytest.mark.extended  # the namespace test below runs the same teardown across hosts in CI
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


# ------------------------------------------------------------------ across network namespaces

SET = "set-netns-dp"
REQUEST = """
import json, sys, urllib.request
body = json.dumps({"model": "tiny-moe", "prompt": "The capital of France is", "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(sys.argv[1] + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
with urllib.request.urlopen(request, timeout=60) as reply:
    print(json.dumps(json.loads(reply.read())))
"""


def wait_set_ready(run_dir: Path, procs: list[subprocess.Popen[str]], errs: list[Path]) -> None:
    deadline = time.monotonic() + READY_WAIT_S
    while True:
        head = set_records(run_dir, SET).get(HEAD) if (run_dir / "nodes" / SET).is_dir() else None
        if head is not None and head.state == "ready":
            return
        logs = "\n".join(e.read_text() for e in errs)
        assert all(p.poll() is None for p in procs), f"a node exited before ready:\n{logs}"
        assert time.monotonic() < deadline, logs
        time.sleep(1.0)


def listening(bed: Bed, k: int) -> list[str]:
    """Local addresses of the TCP sockets listening on host K."""
    out = bed.run(k, ["ss", "-ltnH"]).stdout
    return [line.split()[3] for line in out.splitlines() if len(line.split()) > 3]


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(x.decode().split("=", 1) for x in raw if b"=" in x)


def test_dp_set_across_namespaces_binds_own_addresses(netns_bed: Bed, cpu_venv: Path,
                                                       tiny_model: Path, tmp_path: Path) -> None:
    started = time.time()
    bed, run_dir = netns_bed, tmp_path / "run"
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model),
           "M3PATCH_SET_ID": SET}
    env.pop("VLLM_HOST_IP", None)
    errs = [tmp_path / "head.err", tmp_path / "node.err"]
    serve = [sys.executable, "-m", "m3patch", "serve", str(RECIPE), "--run-dir", str(run_dir),
             "--hold", "900", "--quiet", "--rank", "0", "--role"]
    procs: list[subprocess.Popen[str]] = []
    pgids: list[int] = []
    try:
        with errs[0].open("w") as head_err, errs[1].open("w") as node_err:
            # only the head is told its address; the node learns it from the head's record
            procs.append(bed.popen(0, [*serve, "head"], cwd=REPO, stderr=head_err,
                                   stdout=subprocess.DEVNULL,
                                   env={**env, "M3PATCH_HEAD_ADDR": bed.address(0)}))
            procs.append(bed.popen(1, [*serve, "node"], cwd=REPO, stderr=node_err,
                                   stdout=subprocess.DEVNULL, env=env))
        wait_set_ready(run_dir, procs, errs)
        records = set_records(run_dir, SET)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        head, node = records[HEAD], records[NODE]
        assert (head.address, node.address) == (bed.address(0), bed.address(1))
        assert (head.host, node.host) == ("node0", "node1")  # each host its own hostname
        assert head.tree_sha256 == node.tree_sha256 and head.verified and node.verified
        # every node binds its own address: the head's HTTP and DP RPC ports on it, not on
        # loopback; the headless node's vLLM advertises and uses its own address and interface
        head_listens = listening(bed, 0)
        assert f"{bed.address(0)}:8775" in head_listens, head_listens
        for k in (0, 1):  # no socket of either host listens on its loopback only
            on_loopback = [a for a in listening(bed, k) if a.startswith(("127.", "[::1]"))]
            assert on_loopback == [], (k, on_loopback)
        assert node.pgid is not None
        node_env = environ(node.pgid)
        assert node_env["VLLM_HOST_IP"] == bed.address(1)
        assert node_env["GLOO_SOCKET_IFNAME"] == f"{bed.name}p1"
        # a request from the other host, through the head's own address
        reply = bed.run(1, [sys.executable, "-c", REQUEST, f"http://{bed.address(0)}:8775"])
        assert reply.returncode == 0, reply.stderr
        assert json.loads(reply.stdout)["choices"][0]["text"]
        # the head is not reachable through host 1's loopback: nothing shares one
        loop = bed.run(1, [sys.executable, "-c", REQUEST, "http://127.0.0.1:8775"])
        assert loop.returncode != 0 and "Connection refused" in loop.stderr
        print_set_memory("dp", records)
        # a killed headless server ends the set: the head exits 26 naming the node
        kill_start = time.monotonic()
        os.killpg(node.pgid, signal.SIGKILL)
        procs[0].wait(timeout=TEARDOWN_S + 120)
        took = time.monotonic() - kill_start
        procs[1].wait(timeout=TEARDOWN_S + 30)
        head_text = errs[0].read_text()
        assert procs[0].returncode == 26, head_text
        assert "node node/0" in head_text and procs[1].returncode not in (0, None)
        assert took < TEARDOWN_S + 60, f"teardown took {took:.0f} s"
        assert {r.state for r in set_records(run_dir, SET).values()} == {"exited"}
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the set"
    assert shm_since(started) == [], "the set left /dev/shm files behind"
