"""The set's rendezvous: one JSON record per node in the shared run folder, `RUN/nodes/<role>-<rank>.json`.

Why a folder and not the head's address: every launcher already has one. Locally it is a
directory; under Slurm the job's run folder sits on the shared file system the sbatch script
and the per-rank logs already need; a head socket would need a port, a protocol and a server
that outlives the head's crash to report it. Each node writes only its own record (fsio's
atomic replace, so a reader never sees half of one) and reads the others as hostile input.

A record: schema, node (role, rank), host, pid, pgid of its server, series id, ledger digest,
tree digest, verified (the tree equals the series' pinned post-images), state (starting | ready
| exited) and, once exited, its exit code and reason. `compare` is pure: the head refuses to
report ready until every node published, verified, with the head's own series and tree digest.

Nodes are compared on the tree digest, not the ledger's: the ledger records when it was applied,
so hosts that each applied the same series to the same vLLM build a second apart hold the same
tree under different ledger digests. The tree digest is the ledger without its apply time
(series, patches, mode, vLLM version, every file's pre- and post-image digest, the tool).

A set owns its records. Every node of one set carries the same set identity (the Slurm job id,
or a fresh nonce the local launcher makes; `set_identity`), and its records live in that set's
own folder, `RUN/nodes/<set-id>/<role>-<rank>.json`, each stamped with the id. A record of an
earlier set in a reused run folder, of another set sharing it, a record whose stamp is not its
folder's, or one for a node outside the topology is never read as this set's: it cannot make a
set ready, fail it or name a process group to kill. A record's pgid is a process group the
node started (never 0 or 1), and a launcher signals it only after `owns_group` proved that the
group's leader carries this set's id in its environment. Records beat (`heartbeat`, wall time,
rewritten every HEARTBEAT_S) so a live set can be told from a dead one's leftovers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import secrets
import time
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from m3patch.errors import NodeLost, NodeMismatch, ResultsInvalid, RunDirBusy, UsageError
from m3patch.fsio import read_json, write_json_atomic
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

SCHEMA = 3
SET_ID_VAR = "M3PATCH_SET_ID"
UNKNOWN = ("absent", "unknown", "unreadable")  # a fingerprint field a node could not read
HEARTBEAT_S = 5.0
# A record not rewritten for this long belongs to a set that is gone (killed, its host lost).
STALE_S = 20.0
_SET_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
LEDGER_TIME_KEY = "time"
STATES = ("starting", "ready", "exited")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")


@dataclass(frozen=True)
class NodeRecord:
    set_id: str
    role: str
    rank: int
    host: str
    address: str | None  # the address the node binds and advertises (None: binds nothing)
    pid: int
    pgid: int | None
    series: str | None  # None: a node with no tree (the proxy)
    ledger_sha256: str | None
    tree_sha256: str | None  # the ledger without its apply time: what nodes are compared on
    verified: bool
    state: str
    exit_code: int | None = None
    reason: str = ""
    heartbeat: float = 0.0  # wall-clock time of the last write
    # what else makes two nodes differ (m3patch.cluster.fingerprint); empty for the router
    fingerprint: dict[str, str] = field(default_factory=dict)

    @property
    def node(self) -> NodeId:
        return NodeId(self.role, self.rank)


def set_identity(explicit: str | None = None) -> str | None:
    """This node's set id: --set-id, else M3PATCH_SET_ID, else the Slurm job (and its restart
    count, so a requeued job is a new set); None when none is given."""
    value = explicit or os.environ.get(SET_ID_VAR)
    if not value and os.environ.get("SLURM_JOB_ID"):
        value = f"slurm-{os.environ['SLURM_JOB_ID']}.{os.environ.get('SLURM_RESTART_COUNT', '0')}"
    if not value:
        return None
    if not _SET_ID.match(value):
        msg = f"set id {value!r} is not 1-64 letters, digits, '_', '.' or '-'"
        raise UsageError(msg, hint=f"e.g. {SET_ID_VAR}={fresh_set_id()}")
    return value


def fresh_set_id() -> str:
    return f"set-{secrets.token_hex(8)}"


def nodes_dir(run_dir: Path, set_id: str) -> Path:
    return run_dir / "nodes" / set_id


def record_path(run_dir: Path, set_id: str, node: NodeId) -> Path:
    return nodes_dir(run_dir, set_id) / f"{node.slug}.json"


def publish(run_dir: Path, record: NodeRecord) -> None:
    folder = nodes_dir(run_dir, record.set_id)
    folder.mkdir(parents=True, exist_ok=True)
    data = {"schema": SCHEMA, **asdict(record), "heartbeat": time.time()}
    write_json_atomic(folder / f"{record.node.slug}.json", data)


def _field(data: dict[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    value = data.get(key)
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        msg = f"{where}: field {key!r} is {value!r}, not {kind}"
        raise ResultsInvalid(msg, hint="a node writes only its own record; re-run that node")
    return value


def parse_record(data: dict[str, Any], where: str) -> NodeRecord:
    """A record read back: every field checked (a half-written or hand-edited one is refused)."""
    hint = "a node writes only its own record; re-run that node"
    if data.get("schema") != SCHEMA:
        msg = f"{where}: schema {data.get('schema')!r}, this m3patch reads {SCHEMA}"
        raise ResultsInvalid(msg, hint=hint)
    digests = {}
    for key in ("ledger_sha256", "tree_sha256"):
        digest = data.get(key)
        if digest is not None and (not isinstance(digest, str) or not _DIGEST.match(digest)):
            msg = f"{where}: {key} {digest!r} is not a sha256 hex digest"
            raise ResultsInvalid(msg, hint=hint)
        digests[key] = digest
    pgid = _field(data, "pgid", (int, type(None)), where)
    if pgid is not None and pgid <= 1:
        msg = f"{where}: pgid {pgid} is not a process group a node starts"
        raise ResultsInvalid(msg, hint=hint)
    fingerprint = _field(data, "fingerprint", dict, where)
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in fingerprint.items()):
        msg = f"{where}: fingerprint holds a value that is not a string"
        raise ResultsInvalid(msg, hint=hint)
    heartbeat = _field(data, "heartbeat", (int, float), where)
    if not 0 <= heartbeat < float("inf"):
        msg = f"{where}: heartbeat {heartbeat!r} is not a time"
        raise ResultsInvalid(msg, hint=hint)
    state = _field(data, "state", str, where)
    if state not in STATES:
        msg = f"{where}: state {state!r} is not one of {', '.join(STATES)}"
        raise ResultsInvalid(msg, hint=hint)
    return NodeRecord(
        set_id=_field(data, "set_id", str, where),
        role=_field(data, "role", str, where), rank=_field(data, "rank", int, where),
        host=_field(data, "host", str, where),
        address=_field(data, "address", (str, type(None)), where),
        pid=_field(data, "pid", int, where), pgid=pgid,
        series=_field(data, "series", (str, type(None)), where),
        ledger_sha256=digests["ledger_sha256"], tree_sha256=digests["tree_sha256"],
        verified=_field(data, "verified", bool, where), state=state,
        exit_code=_field(data, "exit_code", (int, type(None)), where),
        reason=_field(data, "reason", str, where), heartbeat=float(heartbeat),
        fingerprint=dict(fingerprint))


def read_records(run_dir: Path, set_id: str,
                 expected: tuple[NodeId, ...]) -> dict[NodeId, NodeRecord]:
    """This set's records of the topology's nodes. A file for another node is never read; a
    record stamped with another set is left out (it is not this set's, whatever it says)."""
    out: dict[NodeId, NodeRecord] = {}
    hint = "a node writes only its own record; re-run that node"
    for node in expected:
        path = record_path(run_dir, set_id, node)
        if not path.is_file():
            continue
        record = parse_record(read_json(path, error=ResultsInvalid, expect=dict, hint=hint),
                              str(path))
        if record.node != node:
            msg = f"{path}: the record is for node {record.node}, not {node}"
            raise ResultsInvalid(msg, hint=hint)
        if record.set_id == set_id:
            out[node] = record
    return out


def require_free(run_dir: Path, set_id: str, now: float | None = None) -> None:
    """Refuse a run folder another live set holds (a record that still beats and has not
    exited). Leftovers of a dead set (stale heartbeat, or exited) are ignored, never removed."""
    now = time.time() if now is None else now
    root = run_dir / "nodes"
    if not root.is_dir():
        return
    for folder in sorted(root.iterdir()):
        if folder.name == set_id or not _SET_ID.match(folder.name) or not folder.is_dir():
            continue
        for path in sorted(folder.glob("*.json")):
            try:
                record = parse_record(read_json(path, error=ResultsInvalid, expect=dict,
                                                hint=""), str(path))
            except ResultsInvalid:
                continue  # unreadable: nothing that proves a live set
            if record.state != "exited" and now - record.heartbeat < STALE_S:
                msg = (f"run folder {run_dir} is in use by set {record.set_id} (node "
                       f"{record.node} on host {record.host}, state {record.state}, heartbeat "
                       f"{now - record.heartbeat:.0f} s ago)")
                raise RunDirBusy(msg, hint="give this set its own --run-dir, or wait for that "
                                           "set to end")


def owns_group(pgid: int | None, set_id: str) -> bool:
    """Whether process group `pgid` is one this set started: a real group (not 0 or 1, not
    this process's own) with live members, every one of which carries M3PATCH_SET_ID=<set_id>
    in its environment (a node's server and its workers inherit it). The pgid of a forged or
    stale record, or a group reused by another process since, fails this."""
    if pgid is None or pgid <= 1 or pgid == os.getpgrp():
        return False
    members = group_members(pgid)
    return bool(members) and all(_carries(pid, set_id) for pid in members)


def _carries(pid: int, set_id: str) -> bool:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:  # gone, or not ours to read
        return False
    return f"{SET_ID_VAR}={set_id}".encode() in environ.split(b"\0")


def tree_sha256(ledger_bytes: bytes, where: str) -> str:
    """The tree digest: sha256 of the ledger's JSON without its apply time (keys sorted)."""
    try:
        data = json.loads(ledger_bytes)
    except ValueError as exc:
        msg = f"{where}: the ledger is not JSON ({exc})"
        raise ResultsInvalid(msg, hint="m3patch status; then m3patch apply --verify") from None
    if not isinstance(data, dict):
        msg = f"{where}: the ledger is not a JSON object"
        raise ResultsInvalid(msg, hint="m3patch status; then m3patch apply --verify")
    data.pop(LEDGER_TIME_KEY, None)
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()


def compare(expected: tuple[NodeId, ...], records: dict[NodeId, NodeRecord], series: str,
            tree: str, fix: str, fingerprint: dict[str, str] | None = None, *,
            treeless: Collection[NodeId] = ()) -> list[NodeId]:
    """Nodes that have not published yet; raises NodeMismatch for one that published another tree
    or another fingerprint field (vLLM version/commit, torch, GPU runtime, model, argv), and
    NodeLost for one that already exited. Only a node of `treeless` (the P/D proxy: it runs no
    vLLM) may publish no series; any other node saying so would skip the tree check."""
    waiting = []
    for node in expected:
        record = records.get(node)
        if record is None:
            waiting.append(node)
            continue
        if record.state == "exited":
            msg = (f"node {node} (host {record.host}) exited with status {record.exit_code}: "
                   f"{record.reason or 'no reason recorded'}")
            raise NodeLost(msg, hint=f"see that node's log, then re-run the set: {fix}")
        if record.series is None:
            if node in treeless:
                continue  # the proxy holds no tree
            msg = (f"node {node} (host {record.host}) published no series, but it runs vLLM "
                   f"and must run series {series}")
            raise NodeMismatch(msg, hint=f"on that host: {fix} --role {node.role} --rank {node.rank}")
        if not record.verified:
            msg = f"node {node} (host {record.host}) did not verify its tree for series {series}"
            raise NodeMismatch(msg, hint=f"on that host: {fix} --role {node.role} --rank {node.rank}")
        if (record.series, record.tree_sha256) != (series, tree):
            msg = (f"node {node} (host {record.host}) runs series {record.series} tree "
                   f"sha256:{record.tree_sha256}, the head runs {series} tree sha256:{tree}")
            raise NodeMismatch(msg, hint=f"make every node's tree the same series: {fix} "
                                         f"--role {node.role} --rank {node.rank} on that host")
        for name, want in sorted((fingerprint or {}).items()):
            got = record.fingerprint.get(name)
            if got in UNKNOWN or want in UNKNOWN:
                continue  # e.g. torch not beside a --vllm-root tree: unknown, not different
            if got != want:
                msg = (f"node {node} (host {record.host}) differs from the head in {name}: "
                       f"{got!r} there, {want!r} on the head")
                raise NodeMismatch(msg, hint="run every node from the same image, model snapshot "
                                             f"and recipe; then: {fix}")
    return waiting
