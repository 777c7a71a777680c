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
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import NodeLost, NodeMismatch, ResultsInvalid
from m3patch.fsio import read_json, write_json_atomic
from m3patch.recipe.topology import NodeId

SCHEMA = 2
LEDGER_TIME_KEY = "time"
STATES = ("starting", "ready", "exited")
_DIGEST = re.compile(r"^[0-9a-f]{64}$")
_SLUG = re.compile(r"^[A-Za-z0-9_.]+-[0-9]+$")


@dataclass(frozen=True)
class NodeRecord:
    role: str
    rank: int
    host: str
    pid: int
    pgid: int | None
    series: str | None  # None: a node with no tree (the proxy)
    ledger_sha256: str | None
    tree_sha256: str | None  # the ledger without its apply time: what nodes are compared on
    verified: bool
    state: str
    exit_code: int | None = None
    reason: str = ""

    @property
    def node(self) -> NodeId:
        return NodeId(self.role, self.rank)


def nodes_dir(run_dir: Path) -> Path:
    return run_dir / "nodes"


def record_path(run_dir: Path, node: NodeId) -> Path:
    return nodes_dir(run_dir) / f"{node.slug}.json"


def publish(run_dir: Path, record: NodeRecord) -> None:
    nodes_dir(run_dir).mkdir(parents=True, exist_ok=True)
    write_json_atomic(record_path(run_dir, record.node), {"schema": SCHEMA, **asdict(record)})


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
    state = _field(data, "state", str, where)
    if state not in STATES:
        msg = f"{where}: state {state!r} is not one of {', '.join(STATES)}"
        raise ResultsInvalid(msg, hint=hint)
    return NodeRecord(
        role=_field(data, "role", str, where), rank=_field(data, "rank", int, where),
        host=_field(data, "host", str, where), pid=_field(data, "pid", int, where),
        pgid=_field(data, "pgid", (int, type(None)), where),
        series=_field(data, "series", (str, type(None)), where),
        ledger_sha256=digests["ledger_sha256"], tree_sha256=digests["tree_sha256"],
        verified=_field(data, "verified", bool, where), state=state,
        exit_code=_field(data, "exit_code", (int, type(None)), where),
        reason=_field(data, "reason", str, where))


def read_records(run_dir: Path) -> dict[NodeId, NodeRecord]:
    out: dict[NodeId, NodeRecord] = {}
    folder = nodes_dir(run_dir)
    if not folder.is_dir():
        return out
    for path in sorted(folder.glob("*.json")):
        if not _SLUG.match(path.stem):
            continue
        data = read_json(path, error=ResultsInvalid, expect=dict,
                         hint="a node writes only its own record; re-run that node")
        record = parse_record(data, str(path))
        if record.node.slug != path.stem:
            msg = f"{path}: the record is for node {record.node}, not {path.stem}"
            raise ResultsInvalid(msg, hint="a node writes only its own record; re-run that node")
        out[record.node] = record
    return out


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
            tree: str, fix: str) -> list[NodeId]:
    """Nodes that have not published yet; raises NodeMismatch for one that published another tree
    and NodeLost for one that already exited."""
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
            continue  # the proxy holds no tree
        if not record.verified:
            msg = f"node {node} (host {record.host}) did not verify its tree for series {series}"
            raise NodeMismatch(msg, hint=f"on that host: {fix} --role {node.role} --rank {node.rank}")
        if (record.series, record.tree_sha256) != (series, tree):
            msg = (f"node {node} (host {record.host}) runs series {record.series} tree "
                   f"sha256:{record.tree_sha256}, the head runs {series} tree sha256:{tree}")
            raise NodeMismatch(msg, hint=f"make every node's tree the same series: {fix} "
                                         f"--role {node.role} --rank {node.rank} on that host")
    return waiting
