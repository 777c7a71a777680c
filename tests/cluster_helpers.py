"""Helpers of the multi-node tests: a set's records read back as the set reads them; a host of
the network-namespace test bed (tests/cluster/conftest.py builds it)."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.cluster import rendezvous as rv
from m3patch.recipe.topology import NodeId
from m3patch.serving.processes import group_members

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "testbed" / "netns_testbed.sh"


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


def _rollup_kib(pid: int) -> tuple[int, int]:
    """RSS and PSS of one process in KiB (0, 0 when it is gone)."""
    try:
        lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    except OSError:
        return 0, 0
    fields = {line.split(":")[0]: int(line.split()[1]) for line in lines[1:] if ":" in line}
    return fields.get("Rss", 0), fields.get("Pss", 0)


def print_set_memory(label: str, records: dict[NodeId, rv.NodeRecord]) -> None:
    """Measure, don't assert: each node's memory (its runner `m3patch serve` plus every process
    of the group it started), RSS summed (pages shared between processes counted in each) and
    PSS (shared pages split), printed for docs/multi-node.md (`pytest -s`)."""
    total_rss = total_pss = 0
    for node, record in sorted(records.items(), key=lambda item: str(item[0])):
        pids = [record.pid, *(group_members(record.pgid) if record.pgid else [])]
        rss, pss = map(sum, zip(*(_rollup_kib(pid) for pid in pids), strict=True))
        total_rss, total_pss = total_rss + rss, total_pss + pss
        print(f"{label} memory: {node} {len(pids)} processes, RSS {rss / 1024:.0f} MiB, "
              f"PSS {pss / 1024:.0f} MiB")
    print(f"{label} memory: the set, RSS {total_rss / 1024:.0f} MiB, PSS {total_pss / 1024:.0f} MiB")


@dataclass(frozen=True)
class Bed:
    name: str
    subnet: str  # three octets: the machine is SUBNET.1, host K is SUBNET.1K
    hosts: int

    def address(self, k: int) -> str:
        return f"{self.subnet}.1{k}"

    def argv(self, k: int, argv: Sequence[str]) -> list[str]:
        """`argv` on host K (its network namespace and hostname, the machine's mounts)."""
        return ["bash", str(SCRIPT), "run", self.name, str(k), *argv]

    def popen(self, k: int, argv: Sequence[str], **kw: Any) -> subprocess.Popen[str]:
        return subprocess.Popen(self.argv(k, argv), text=True, **kw)

    def run(self, k: int, argv: Sequence[str], timeout: float = 120,
            **kw: Any) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(k, argv), text=True, capture_output=True,
                              timeout=timeout, check=False, **kw)
