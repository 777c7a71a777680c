"""`m3patch serve RECIPE --role R --rank K`: one node of a set, verified, launched, gated, watched.

What a Slurm task or a per-host container runs:
1. apply + verify the series on this node's tree (not for the proxy, which has none);
2. publish this node's record to the rendezvous (series id, ledger and tree digests,
   verified);
3. start the role's process under the serving Supervisor (log, streaming MarkerChecker);
4. gate: an API-serving node must answer /health and a real completion, a headless node must
   print every required marker (counts per worker x local DP x TP); then the node's markers;
5. the head (DP head or P/D proxy) waits until every node published the same series and tree,
   verified, and is ready; only then is the set ready (a mismatch: NodeMismatch, 25). A DP head
   already compares every record published while its own server starts, so a node on another
   tree fails the set within seconds of publishing, not after the whole model load;
6. watch: its own process, forbidden markers, the head's /health, and every other node's record:
   a node that exited ends this one too (NodeLost, 26), so no headless node outlives its head.
The record says `exited` (with the exit code and reason) however this node ends.
"""

from __future__ import annotations

import os
import socket
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.node_plan import NodePlan, node_log, plan_node, require_topology
from m3patch.cluster.shm import ShmTracker
from m3patch.errors import M3PatchError, NodeLost, ReadyTimeout, ResultsInvalid, ServerDied
from m3patch.markers import MarkerChecker
from m3patch.output import info
from m3patch.patching.series import load_series
from m3patch.recipe.loader import Recipe
from m3patch.recipe.model_files import require_present
from m3patch.recipe.topology import NodeId, Topology
from m3patch.serving.launch_plan import ensure_tree
from m3patch.serving.processes import group_members
from m3patch.serving.supervisor import Supervisor

POLL_S = 0.5
WATCH_S = 1.0
HEALTH_PROBE_EVERY_S = 10.0
HEALTH_TIMEOUT_S = 5.0


class NodeRun:
    def __init__(self, recipe: Recipe, node: NodeId, run_dir: Path, python: str,
                 echo: Callable[[str], None] | None = None) -> None:
        self.recipe = recipe
        self.topo: Topology = require_topology(recipe)
        self.node = node
        self.role = self.topo.role(node.role)
        self.run_dir = run_dir
        self.python = python
        self.echo = echo
        self.series = load_series(recipe.series_dir).id
        self.ledger: str | None = None
        self.tree: str | None = None  # rendezvous.tree_sha256 of the ledger
        self.plan: NodePlan | None = None
        self.supervisor: Supervisor | None = None
        self.fix = f"m3patch serve {recipe.path}"

    # ------------------------------------------------------------------ records

    def _publish(self, state: str, *, verified: bool, exit_code: int | None = None,
                 reason: str = "") -> None:
        pgid = self.supervisor.pgid if self.supervisor and self.supervisor.proc else None
        rv.publish(self.run_dir, rv.NodeRecord(
            role=self.node.role, rank=self.node.rank, host=socket.gethostname(), pid=os.getpid(),
            pgid=pgid, series=self.series if self.role.runs_vllm else None,
            ledger_sha256=self.ledger, tree_sha256=self.tree, verified=verified, state=state,
            exit_code=exit_code, reason=reason))

    # ------------------------------------------------------------------ the run

    def run(self, hold_s: float | None, stop_after_ready: bool) -> int:
        try:
            self._prepare()
            with ShmTracker(self._pids) as shm:
                try:
                    self._start_and_gate()
                    info(f"node {self.node} ready; log {node_log(self.run_dir, self.node)}")
                    if not stop_after_ready:
                        self._watch(hold_s)
                finally:
                    self._stop()
                    shm.scan()
                    removed = shm.clean()
                    if removed:
                        info(f"node {self.node}: removed {len(removed)} leaked /dev/shm file(s)")
        except M3PatchError as exc:
            self._publish("exited", verified=self.ledger is not None, exit_code=exc.exit_code,
                          reason=str(exc).splitlines()[0][:500])
            raise
        except BaseException as exc:
            self._publish("exited", verified=self.ledger is not None, exit_code=130,
                          reason=f"interrupted ({type(exc).__name__})")
            raise
        self._publish("exited", verified=self.ledger is not None, exit_code=0, reason="stopped")
        return 0

    def _pids(self) -> list[int]:
        if self.supervisor is None or self.supervisor.proc is None:
            return []
        return group_members(self.supervisor.pgid)

    def _prepare(self) -> None:
        if self.role.runs_vllm:
            require_present(self.recipe)
            ensured = ensure_tree(self.recipe, self.python)
            info(ensured.report.summary().removeprefix("m3patch: "))
            self.ledger = ensured.ledger_sha256
            self.tree = rv.tree_sha256(ensured.ledger_bytes, str(ensured.tree.root))
        self.plan = plan_node(self.recipe, self.node, self.python, node_log(self.run_dir, self.node),
                              self.ledger)
        self._publish("starting", verified=self.role.runs_vllm)

    def _start_and_gate(self) -> None:
        assert self.plan is not None
        checker = MarkerChecker(self.plan.plan.markers, log_name=str(self.plan.plan.spec.log_path))
        self.supervisor = Supervisor(self.plan.plan.spec, checker, echo=self.echo)
        self.supervisor.start()
        self._publish("starting", verified=self.role.runs_vllm)
        if self.plan.serves_http:
            self.supervisor.wait_ready(self._check_published if self._compares_early else None)
        else:
            self._wait_markers()
        time.sleep(1.0)  # lets the reader drain lines written just before ready
        self.supervisor.gate_markers(hint=self.plan.plan.marker_hint)
        if self.node == self.topo.head:
            self._wait_set()
        self._publish("ready", verified=self.role.runs_vllm)

    def _wait_markers(self) -> None:
        """A headless node has no HTTP: ready once every required marker was printed."""
        assert self.supervisor is not None
        deadline = time.monotonic() + self.recipe.deadlines.ready_s
        while True:
            self.supervisor.raise_if_violation()
            if self.supervisor.exit_code() is not None:
                self.supervisor.check_alive()  # raises with the log's tail
            if not self.supervisor.checker.missing():
                return
            self._raise_if_other_exited()
            if time.monotonic() >= deadline:
                msg = (f"node {self.node} did not print its required markers within "
                       f"{self.recipe.deadlines.ready_s:.0f} s (log {self.supervisor.spec.log_path})")
                raise ReadyTimeout(msg, hint=f"see the log; then: {self.plan_fix}")
            time.sleep(POLL_S)

    @property
    def plan_fix(self) -> str:
        return f"{self.fix} --role {self.node.role} --rank {self.node.rank}"

    @property
    def _compares_early(self) -> bool:
        """A vLLM head holds every node to its own tree already while its server starts."""
        return self.node == self.topo.head and self.tree is not None

    def _check_published(self) -> None:
        """Every node that published so far runs the head's tree and has not exited: a wrong
        tree fails the set in seconds, not after a whole model load (NodeMismatch / NodeLost)."""
        assert self.tree is not None
        others = tuple(n for n in self.topo.nodes() if n != self.node)
        try:
            records = rv.read_records(self.run_dir)
        except ResultsInvalid:
            return  # a record being replaced; _wait_set reads every record strictly later
        rv.compare(others, records, self.series, self.tree, self.fix)

    def _wait_set(self) -> None:
        """The head: every other node published, verified, the same tree, and is ready."""
        others = tuple(n for n in self.topo.nodes() if n != self.node)
        deadline = time.monotonic() + self.recipe.deadlines.ready_s
        while True:
            records = rv.read_records(self.run_dir)
            series, tree = self._reference(records)
            waiting = rv.compare(others, records, series, tree, self.fix)
            waiting += [n for n in others if n in records and records[n].state != "ready"]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(str(n) for n in waiting)
                msg = f"the set is not ready: node(s) {names} did not publish ready in time"
                raise NodeLost(msg, hint=f"start them ({self.fix} --role R --rank K) or raise "
                                         "deadlines.ready-s")
            time.sleep(POLL_S)

    def _reference(self, records: dict[NodeId, rv.NodeRecord]) -> tuple[str, str]:
        """The head's own tree; the proxy (no tree) holds every node to the first vLLM node's."""
        if self.tree is not None:
            return self.series, self.tree
        for record in records.values():
            if record.series is not None and record.tree_sha256 is not None:
                return self.series, record.tree_sha256
        return self.series, "0" * 64

    def _raise_if_other_exited(self) -> None:
        for node, record in rv.read_records(self.run_dir).items():
            if node != self.node and record.state == "exited":
                msg = (f"node {node} (host {record.host}) exited with status {record.exit_code}: "
                       f"{record.reason or 'no reason recorded'}; node {self.node} stops with it")
                raise NodeLost(msg, hint=f"see node {node}'s log, then re-run the set: {self.fix}")

    def _watch(self, hold_s: float | None) -> None:
        assert self.supervisor is not None
        end = None if hold_s is None else time.monotonic() + hold_s
        last_answer = time.monotonic()
        next_probe = last_answer + HEALTH_PROBE_EVERY_S
        while end is None or time.monotonic() < end:
            self.supervisor.check_alive()
            self._raise_if_other_exited()
            if self.plan is not None and self.plan.serves_http and time.monotonic() >= next_probe:
                if _health(self.supervisor.spec.base_url):
                    last_answer = time.monotonic()
                elif time.monotonic() - last_answer > self.recipe.deadlines.request_s:
                    msg = (f"node {self.node} is alive but has not answered /health for "
                           f"{time.monotonic() - last_answer:.0f} s")
                    raise ServerDied(msg, hint=f"see its log; then: {self.plan_fix}")
                next_probe = time.monotonic() + HEALTH_PROBE_EVERY_S
            time.sleep(WATCH_S)

    def _stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()


def _health(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=HEALTH_TIMEOUT_S) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False
