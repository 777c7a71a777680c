"""The local launcher and set supervisor: every node of a topology recipe on this host.

Each node is its own `m3patch serve RECIPE --role R --rank K --run-dir RUN` process (the same
command a Slurm task runs), in its own session. The supervisor watches every node's process and
rendezvous record, never the head's /health alone: the set is ready when the head's record says
ready (the head checked every node's tree and readiness first). Any node's exit, gate failure or
deadline tears the whole set down within TEARDOWN_S: SIGTERM to every node runner (each stops
its server through the stop ladder), then SIGKILL to any server group a killed runner left
behind (from the records' pgids, each proven this set's by rendezvous.owns_group), then the
/dev/shm files the set's processes had mapped.

The set's identity is a fresh nonce (or M3PATCH_SET_ID), handed to every node runner in its
environment: the set reads only its own records, so an earlier run's `ready` or `exited` in a
reused run folder, or another set's records, never make this set ready, fail it or get a kill.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.node_plan import require_topology
from m3patch.cluster.shm import ShmTracker
from m3patch.errors import NodeLost, NodeMismatch, ResultsInvalid
from m3patch.output import info
from m3patch.recipe.loader import Recipe
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import StopRung, group_members, start_group, stop_group

POLL_S = 0.5
TEARDOWN_S = 60.0
# A node runner stops its own server on SIGTERM (SIGINT 20 s, SIGTERM 10 s, SIGKILL 5 s): give
# it that long, then kill whatever is left.
RUNNER_LADDER = (StopRung(signal.SIGTERM, 40.0), StopRung(signal.SIGKILL, 5.0))
GROUP_KILL_GRACE_S = 5.0


@dataclass
class NodeProc:
    node: NodeId
    proc: subprocess.Popen[bytes]
    log: IO[bytes]


class LocalSet:
    def __init__(self, recipe: Recipe, run_dir: Path, python: str | None, set_id: str) -> None:
        self.recipe = recipe
        self.topo = require_topology(recipe)
        self.run_dir = run_dir
        self.python = python
        self.set_id = set_id
        self.procs: list[NodeProc] = []
        self.started = time.monotonic()

    def _argv(self, node: NodeId) -> list[str]:
        argv = [sys.executable, "-m", "m3patch", "serve", str(self.recipe.path), "--role", node.role,
                "--rank", str(node.rank), "--run-dir", str(self.run_dir), "--quiet"]
        return argv + (["--python", self.python] if self.python else [])

    def records(self) -> dict[NodeId, rv.NodeRecord]:
        try:
            return rv.read_records(self.run_dir, self.set_id, self.topo.nodes())
        except ResultsInvalid:
            return {}  # a record being written is read on the next poll

    def start(self) -> None:
        rv.require_free(self.run_dir, self.set_id)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        env = {**os.environ, rv.SET_ID_VAR: self.set_id}
        for node in self.topo.nodes():
            log = (self.run_dir / "logs" / f"{node.slug}.m3patch.log").open("wb")
            proc = start_group(self._argv(node), stdin=subprocess.DEVNULL, stdout=log,
                               stderr=subprocess.STDOUT, env=env)
            self.procs.append(NodeProc(node, proc, log))
            info(f"set: started node {node} (pid {proc.pid}; log {log.name})")

    def pids(self) -> list[int]:
        out = []
        for np_ in self.procs:
            out += group_members(np_.proc.pid)
        for record in self.records().values():
            if record.pgid is not None and rv.owns_group(record.pgid, self.set_id):
                out += group_members(record.pgid)
        return out

    def wait_ready(self) -> float:
        deadline = self.started + self.recipe.deadlines.ready_s + 60.0
        head = self.topo.head
        while True:
            self.raise_if_node_ended()
            record = self.records().get(head)
            if record is not None and record.state == "ready":
                return time.monotonic() - self.started
            if time.monotonic() > deadline:
                msg = f"the set was not ready within {deadline - self.started:.0f} s (head {head})"
                raise NodeLost(msg, hint=f"see {self.run_dir}/logs; raise deadlines.ready-s")
            time.sleep(POLL_S)

    def raise_if_node_ended(self) -> None:
        for np_ in self.procs:
            code = np_.proc.poll()
            if code is None:
                continue
            record = self.records().get(np_.node)
            reason = record.reason if record is not None and record.reason else "no record"
            log = self.run_dir / "logs" / f"{np_.node.slug}.m3patch.log"
            fix = f"m3patch serve {self.recipe.path}"
            if code == NodeMismatch.exit_code:
                msg = f"node {np_.node} stopped the set: {reason} (log {log})"
                raise NodeMismatch(msg,
                                   hint=f"make every node's tree the same series, then: {fix}")
            msg = f"node {np_.node} exited with status {code}: {reason} (log {log})"
            raise NodeLost(msg, hint=f"see that log, then re-run the set: {fix}")

    def hold(self, hold_s: float | None) -> None:
        end = None if hold_s is None else time.monotonic() + hold_s
        while end is None or time.monotonic() < end:
            self.raise_if_node_ended()
            time.sleep(POLL_S)

    def teardown(self) -> float:
        """Every node down within TEARDOWN_S; returns the seconds it took."""
        start = time.monotonic()
        records = self.records()
        threads = [threading.Thread(target=stop_group, args=(np_.proc, RUNNER_LADDER), daemon=True)
                   for np_ in self.procs]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=max(0.0, TEARDOWN_S - (time.monotonic() - start)))
        records = {**records, **self.records()}
        for record in records.values():
            if record.pgid is not None and rv.owns_group(record.pgid, self.set_id):
                _kill_group(record.pgid)
        for np_ in self.procs:
            np_.log.close()
        return time.monotonic() - start


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)
    end = time.monotonic() + GROUP_KILL_GRACE_S
    while group_members(pgid) and time.monotonic() < end:
        time.sleep(0.1)


def run_set(recipe: Recipe, run_dir: Path, python: str | None, hold_s: float | None,
            stop_after_ready: bool, set_id: str | None = None) -> int:
    """Launch every node here, wait for the set, hold, and always tear the whole set down."""
    local = LocalSet(recipe, run_dir, python, set_id or rv.fresh_set_id())
    with ShmTracker(local.pids) as shm:
        try:
            local.start()
            ready_s = local.wait_ready()
            head = local.topo.head
            address = local.records()[head].address
            info(f"set ready in {ready_s:.1f} s: {len(local.procs)} node(s), head {head} at "
                 f"{address}; rendezvous {rv.nodes_dir(run_dir, local.set_id)}")
            if not stop_after_ready:
                local.hold(hold_s)
        finally:
            took = local.teardown()
            shm.scan()
            removed = shm.clean()
            info(f"set stopped in {took:.1f} s; removed {len(removed)} leaked /dev/shm file(s)")
    return 0
