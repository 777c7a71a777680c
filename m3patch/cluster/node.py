"""`m3patch serve RECIPE --role R --rank K`: one node of a set, verified, launched, gated, watched.

What a Slurm task or a per-host container runs:
1. refuse a run folder another live set holds; apply + verify the series on this node's
   tree (not for the proxy, which has none);
2. resolve the network: the head resolves `topology.address` to one of its own IPs; every other
   node waits (join deadline) for the head's record, takes the head's IP from it and picks its
   own address and interface (m3patch.cluster.network); publish this node's record (set id,
   address, series id, ledger and tree digests, verified). The P/D proxy also waits for every
   prefill and decode node's record: its backends are the addresses they published;
3. start the role's process under the serving Supervisor (log, streaming MarkerChecker);
4. gate: an API-serving node must answer /health and a real completion, a headless node must
   print every required marker (counts per worker x local DP x TP); then the node's markers;
5. the head (DP head or P/D proxy) waits until every node published the same series and tree,
   verified, and is ready; only then is the set ready (a mismatch: NodeMismatch, 25). A DP head
   already compares every record published while its own server starts, so a node on another
   tree fails the set within seconds of publishing, not after the whole model load;
6. watch: its own process, forbidden markers, a liveness probe (a tiny bounded completion every
   `deadlines.probe-s`: a hung engine keeps /health at 200), and every other node's record: a
   node that exited, or whose record stopped beating, ends this one too (NodeLost, 26), so no
   headless node outlives its head. A headless node has no HTTP; a hung one stalls the head's
   DP step, so the head's probe catches it. The P/D router's probe waits on its backends, so it
   gives a hung backend one probe interval to fail its own probe and name itself.
The record says `exited` (with the exit code and reason) however this node ends, and beats
(`heartbeat`) every few seconds while it runs. Only this set's records are read (set id).
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

from m3patch.cluster import network
from m3patch.cluster import rendezvous as rv
from m3patch.cluster.fingerprint import node_fingerprint
from m3patch.cluster.node_plan import (
    NodePlan,
    kv_probe_prompt,
    node_log,
    node_port,
    plan_node,
    require_topology,
    role_recipes,
)
from m3patch.cluster.shm import ShmTracker
from m3patch.errors import (
    M3PatchError,
    MarkerMissing,
    NodeLost,
    ReadyTimeout,
    ResultsInvalid,
    ServerDied,
    raise_if_interrupted,
)
from m3patch.markers import MarkerChecker
from m3patch.output import info
from m3patch.patching.series import load_series
from m3patch.recipe.loader import Recipe
from m3patch.recipe.model_files import require_present
from m3patch.recipe.topology import NodeId, Topology
from m3patch.serving.launch_plan import ensure_tree
from m3patch.serving.processes import group_members
from m3patch.serving.supervisor import Supervisor
from m3patch.serving.vllm_parser import check_launch

POLL_S = 0.5
WATCH_S = 1.0
# A running node whose record has not changed for this long past deadlines.request-s (its
# runner hung, or its host went away without a word) is lost: a node beats between liveness
# probes, and one probe may take up to request-s.
SILENT_NODE_S = 60.0
# past one probe interval: a hung backend's own probe failing, then its record saying exited
BLAME_GRACE_S = 5.0


class NodeRun:
    def __init__(self, recipe: Recipe, node: NodeId, run_dir: Path, python: str, set_id: str,
                 echo: Callable[[str], None] | None = None) -> None:
        self.recipe = recipe
        self.topo: Topology = require_topology(recipe)
        self.node = node
        self.role = self.topo.role(node.role)
        self.run_dir = run_dir
        self.python = python
        self.set_id = set_id
        self.echo = echo
        self.series = load_series(recipe.series_dir).id
        self.ledger: str | None = None
        self.tree: str | None = None  # rendezvous.tree_sha256 of the ledger
        self.fingerprint: dict[str, str] = {}  # m3patch.cluster.fingerprint; {} for the router
        self.net: network.NodeNetwork | None = None
        self.plan: NodePlan | None = None
        self.supervisor: Supervisor | None = None
        self.fix = f"m3patch serve {recipe.path}"
        self.started = time.monotonic()
        self.state = "starting"
        self.last_beat = 0.0
        self.seen: dict[NodeId, tuple[float, float]] = {}  # heartbeat, when it last changed

    # ------------------------------------------------------------------ records

    def _publish(self, state: str, *, verified: bool, exit_code: int | None = None,
                 reason: str = "") -> None:
        pgid = self.supervisor.pgid if self.supervisor and self.supervisor.proc else None
        self.state = state
        self.last_beat = time.monotonic()
        rv.publish(self.run_dir, rv.NodeRecord(
            set_id=self.set_id, role=self.node.role, rank=self.node.rank,
            host=socket.gethostname(), address=None if self.net is None else self.net.address,
            pid=os.getpid(), pgid=pgid, series=self.series if self.role.runs_vllm else None,
            ledger_sha256=self.ledger, tree_sha256=self.tree, verified=verified, state=state,
            exit_code=exit_code, reason=reason, fingerprint=self.fingerprint))

    def _beat(self) -> None:
        if time.monotonic() - self.last_beat >= rv.HEARTBEAT_S:
            self._publish(self.state, verified=self.role.runs_vllm)

    def _records(self) -> dict[NodeId, rv.NodeRecord]:
        return rv.read_records(self.run_dir, self.set_id, self.topo.nodes())

    # ------------------------------------------------------------------ the run

    def run(self, hold_s: float | None, stop_after_ready: bool) -> int:
        # Every process this node starts carries the set id: the proof a launcher checks
        # before it signals a process group a record names.
        os.environ[rv.SET_ID_VAR] = self.set_id
        rv.require_free(self.run_dir, self.set_id)
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
        if self.node == self.topo.head:
            self.net = network.head_network(self.topo.network, self.topo.address)
        if self.role.runs_vllm:
            # the role's launch, checked as validate and dry-run check it (the series' spec:
            # no parser probe on a node's start), before the tree is touched
            launch = next(r for r in role_recipes(self.recipe) if r.launch_role == self.role.name)
            check_launch(launch, self.python, spawn=False)
            found = require_present(self.recipe)
            ensured = ensure_tree(self.recipe, self.python)
            info(ensured.report.summary().removeprefix("m3patch: "))
            self.ledger = ensured.ledger_sha256
            self.tree = rv.tree_sha256(ensured.ledger_bytes, str(ensured.tree.root))
            self.fingerprint = node_fingerprint(self.recipe, ensured.tree.root,
                                                ensured.tree.version, ensured.tree.commit, found)
        if self.net is None:
            self._publish("starting", verified=self.role.runs_vllm)  # joined, address unknown
            head = self._wait_joined((self.topo.head,))[self.topo.head]
            if head.address is None:
                msg = f"the head {self.topo.head} published no address"
                raise NodeLost(msg, hint=f"re-run the set: {self.fix}")
            self.net = network.node_network(self.topo.network, head.address)
        self._publish("starting", verified=self.role.runs_vllm)
        backends = self._backends() if self.role.kind == "proxy" else None
        self.plan = plan_node(self.recipe, self.node, self.python, node_log(self.run_dir, self.node),
                              self.ledger, self.net, backends)
        info(f"node {self.node}: address {self.net.address}, interface {self.net.interface}, "
             f"head {self.net.head_address}; set {self.set_id}")

    def _wait_joined(self, nodes: tuple[NodeId, ...],
                     with_address: bool = False) -> dict[NodeId, rv.NodeRecord]:
        """Every one of `nodes` published a record of this set within the join deadline."""
        deadline = self.started + self.recipe.deadlines.join_s
        while True:
            records = self._records_or_empty()
            self._raise_if_other_exited(records)
            joined = {n: records[n] for n in nodes
                      if n in records and (records[n].address or not with_address)}
            if len(joined) == len(nodes):
                return joined
            if time.monotonic() >= deadline:
                raise self._not_joined([n for n in nodes if n not in joined])
            self._beat()
            time.sleep(POLL_S)

    def _not_joined(self, missing: list[NodeId]) -> NodeLost:
        names = ", ".join(str(n) for n in missing)
        where = rv.nodes_dir(self.run_dir, self.set_id)
        msg = (f"node(s) {names} never joined set {self.set_id} within "
               f"deadlines.join-s {self.recipe.deadlines.join_s:.0f} s (no record in {where})")
        return NodeLost(msg, hint=f"start every node with the same set id ({rv.SET_ID_VAR}) and "
                                  "a run folder every node shares: "
                                  f"{self.fix} --role R --rank K --run-dir RUN")

    def _backends(self) -> dict[str, tuple[str, ...]]:
        """The P/D proxy's backends: each prefill / decode node at the address it published."""
        kinds = ("prefill", "decode")
        nodes = tuple(n for n in self.topo.nodes() if self.topo.role(n.role).kind in kinds)
        records = self._wait_joined(nodes, with_address=True)
        return {kind: tuple(f"http://{records[n].address}:{node_port(self.recipe, self.topo, n)}"
                            for n in nodes if self.topo.role(n.role).kind == kind)
                for kind in kinds}

    def _start_and_gate(self) -> None:
        assert self.plan is not None
        checker = MarkerChecker(self.plan.plan.markers, log_name=str(self.plan.plan.spec.log_path))
        self.supervisor = Supervisor(self.plan.plan.spec, checker, echo=self.echo)
        self.supervisor.start()
        self._publish("starting", verified=self.role.runs_vllm)
        if self.plan.serves_http:
            self.supervisor.wait_ready(self._while_starting)
        else:
            self._wait_markers()
        time.sleep(1.0)  # lets the reader drain lines written just before ready
        self.supervisor.gate_markers(hint=self.plan.plan.marker_hint)
        if self.node == self.topo.head:
            self._wait_set()
            self._prove_kv()
        self._publish("ready", verified=self.role.runs_vllm)

    def _while_starting(self) -> None:
        self._beat()
        if self._compares_early:
            self._check_published()

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
            self._raise_if_other_exited(self._records_or_empty())
            if time.monotonic() >= deadline:
                msg = (f"node {self.node} did not print its required markers within "
                       f"{self.recipe.deadlines.ready_s:.0f} s (log {self.supervisor.spec.log_path})")
                raise ReadyTimeout(msg, hint=f"see the log; then: {self.plan_fix}")
            self._beat()
            time.sleep(POLL_S)

    @property
    def plan_fix(self) -> str:
        return f"{self.fix} --role {self.node.role} --rank {self.node.rank}"

    @property
    def _compares_early(self) -> bool:
        """A vLLM head holds every node to its own tree already while its server starts."""
        return self.node == self.topo.head and self.tree is not None

    def _others(self) -> tuple[NodeId, ...]:
        return tuple(n for n in self.topo.nodes() if n != self.node)

    def _treeless(self) -> tuple[NodeId, ...]:
        """The nodes that run no vLLM (the P/D proxy), so publish no series."""
        return tuple(n for n in self.topo.nodes() if not self.topo.role(n.role).runs_vllm)

    def _check_published(self) -> None:
        """Every node that published so far runs the head's tree and has not exited: a wrong
        tree fails the set in seconds, not after a whole model load (NodeMismatch / NodeLost);
        a node that never joined fails it at the join deadline."""
        assert self.tree is not None
        try:
            records = self._records()
        except ResultsInvalid:
            return  # a record being replaced; _wait_set reads every record strictly later
        waiting = rv.compare(self._others(), records, self.series, self.tree, self.fix,
                             self.fingerprint, treeless=self._treeless())
        if waiting and time.monotonic() >= self.started + self.recipe.deadlines.join_s:
            raise self._not_joined(waiting)

    def _wait_set(self) -> None:
        """The head: every other node published, verified, the same tree, and is ready."""
        others = self._others()
        deadline = time.monotonic() + self.recipe.deadlines.ready_s
        while True:
            records = self._records()
            series, tree, fingerprint = self._reference(records)
            absent = rv.compare(others, records, series, tree, self.fix, fingerprint,
                                treeless=self._treeless())
            if absent and time.monotonic() >= self.started + self.recipe.deadlines.join_s:
                raise self._not_joined(absent)
            waiting = absent + [n for n in others if n in records and records[n].state != "ready"]
            if not waiting:
                return
            if time.monotonic() >= deadline:
                names = ", ".join(str(n) for n in waiting)
                msg = f"the set is not ready: node(s) {names} did not publish ready in time"
                raise NodeLost(msg, hint=f"start them ({self.fix} --role R --rank K) or raise "
                                         "deadlines.ready-s")
            self._beat()
            time.sleep(POLL_S)

    def _prove_kv(self) -> None:
        """P/D: KV must reach every decode node from a prefill node, not only the connector load.
        One long prompt per decode node through the router; each decode log must then show its
        role's `kv-arrived` line (read from the shared run folder)."""
        assert self.supervisor is not None
        decodes = [n for n in self.topo.nodes() if self.topo.role(n.role).kv_arrived]
        deadline = time.monotonic() + self.recipe.deadlines.request_s
        answered = 0
        for attempt in range(4 * len(decodes)):
            missing = [n for n in decodes if not self._log_has(n)]
            if not missing:
                return
            answered += self.supervisor.complete(kv_probe_prompt(self.recipe, attempt),
                                                 self.recipe.deadlines.request_s)
            while time.monotonic() < deadline and [n for n in missing if not self._log_has(n)]:
                time.sleep(POLL_S)
        missing = [n for n in decodes if not self._log_has(n)]
        if missing:
            lines = ", ".join(f"{n} ({self.topo.role(n.role).kv_arrived!r} not in "
                              f"{node_log(self.run_dir, n)})" for n in missing)
            msg = f"no KV arrived from a prefill node at decode node(s) {lines}"
            if not answered:
                msg += (f"; the router answered none of its probe completions (its log: "
                        f"{node_log(self.run_dir, self.node)})")
            raise MarkerMissing(msg, hint="check the roles' kv-transfer-config (connector, "
                                          f"addresses, ports); then: {self.fix}")

    def _log_has(self, node: NodeId) -> bool:
        text = self.topo.role(node.role).kv_arrived
        try:
            return text is not None and text.encode() in node_log(self.run_dir, node).read_bytes()
        except OSError:
            return False

    def _reference(self, records: dict[NodeId, rv.NodeRecord]
                   ) -> tuple[str, str, dict[str, str]]:
        """The head's own tree and fingerprint; the router (no tree) holds every node to the
        first vLLM node's."""
        if self.tree is not None:
            return self.series, self.tree, self.fingerprint
        for record in records.values():
            if record.series is not None and record.tree_sha256 is not None:
                return self.series, record.tree_sha256, record.fingerprint
        return self.series, "0" * 64, {}

    def _records_or_empty(self) -> dict[NodeId, rv.NodeRecord]:
        try:
            return self._records()
        except ResultsInvalid:
            return {}  # a record being replaced is read on the next poll

    def _raise_if_other_exited(self, records: dict[NodeId, rv.NodeRecord]) -> None:
        for node, record in records.items():
            if node != self.node and record.state == "exited":
                msg = (f"node {node} (host {record.host}) exited with status {record.exit_code}: "
                       f"{record.reason or 'no reason recorded'}; node {self.node} stops with it")
                raise NodeLost(msg, hint=f"see node {node}'s log, then re-run the set: {self.fix}")

    def _raise_if_other_silent(self, records: dict[NodeId, rv.NodeRecord]) -> None:
        """A node whose record stopped changing (compared with this host's clock, so clocks of
        other hosts never matter) is lost."""
        now = time.monotonic()
        for node, record in records.items():
            if node == self.node:
                continue
            last = self.seen.get(node)
            if last is None or last[0] != record.heartbeat:
                self.seen[node] = (record.heartbeat, now)
            elif now - last[1] > SILENT_NODE_S + self.recipe.deadlines.request_s:
                msg = (f"node {node} (host {record.host}) stopped beating: its record has not "
                       f"changed for {now - last[1]:.0f} s; node {self.node} stops with it")
                raise NodeLost(msg, hint=f"see node {node}'s log, then re-run the set: {self.fix}")

    def _watch(self, hold_s: float | None) -> None:
        assert self.supervisor is not None
        end = None if hold_s is None else time.monotonic() + hold_s
        probe_s = self.recipe.deadlines.probe_s
        last_answer = time.monotonic()
        next_probe = last_answer + probe_s
        while end is None or time.monotonic() < end:
            self.supervisor.check_alive()
            records = self._records_or_empty()
            self._raise_if_other_exited(records)
            self._raise_if_other_silent(records)
            self._beat()
            if self.plan is not None and self.plan.serves_http and probe_s > 0 \
                    and time.monotonic() >= next_probe:
                if self.supervisor.answers(self.recipe.deadlines.request_s):
                    last_answer = time.monotonic()
                elif time.monotonic() - last_answer > self.recipe.deadlines.request_s:
                    raise self._hung(time.monotonic() - last_answer)
                next_probe = time.monotonic() + probe_s
            raise_if_interrupted()  # a stop signal a best-effort step swallowed
            time.sleep(WATCH_S)

    def _hung(self, silent_s: float) -> M3PatchError:
        """This node's liveness probe failed. A request through the P/D router waits on every
        prefill and decode node, so the router first gives a hung backend one probe interval to
        name itself (its own probe fails too; NodeLost then names it); only then the router."""
        probe_s = self.recipe.deadlines.probe_s
        if self.role.kind == "proxy":
            end = time.monotonic() + probe_s + BLAME_GRACE_S
            while time.monotonic() < end:
                self._raise_if_other_exited(self._records_or_empty())
                self._beat()
                time.sleep(WATCH_S)
        waits_on = {"proxy": " (nor did any prefill or decode node report a hang)",
                    "dp-head": " (or a headless node it waits on hangs)"}.get(self.role.kind, "")
        msg = (f"node {self.node} is alive but did not complete a 4-token request for "
               f"{silent_s:.0f} s (liveness probe every deadlines.probe-s {probe_s:.0f} s)"
               f"{waits_on}")
        return ServerDied(msg, hint=f"see its log; then: {self.plan_fix}")

    def _stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor.stop()
