"""Helpers of the multi-node tests: a set's records read back as the set reads them."""

from __future__ import annotations

from pathlib import Path

from m3patch.cluster import rendezvous as rv
from m3patch.recipe.topology import NodeId


def only_set(run_dir: Path) -> str:
    """The set id of the one set that ran in `run_dir` (the tests give each set its own)."""
    folders = sorted(p.name for p in (run_dir / "nodes").iterdir() if p.is_dir())
    assert len(folders) == 1, folders
    return folders[0]


def set_records(run_dir: Path, set_id: str | None = None) -> dict[NodeId, rv.NodeRecord]:
    """Every record of the set, for whatever nodes its folder holds."""
    set_id = set_id or only_set(run_dir)
    nodes = []
    for path in sorted(rv.nodes_dir(run_dir, set_id).glob("*.json")):
        role, _, rank = path.stem.rpartition("-")
        nodes.append(NodeId(role, int(rank)))
    return rv.read_records(run_dir, set_id, tuple(nodes))
