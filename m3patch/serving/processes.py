"""Process-table queries from /proc (Linux; no psutil): who is still alive after a stop."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import NamedTuple


class ProcEntry(NamedTuple):
    pid: int
    state: str
    ppid: int
    pgid: int


def live_processes() -> Iterator[ProcEntry]:
    """Every process except zombies (already dead, waiting to be reaped)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # exited between listing and reading
            continue
        # The command name may contain spaces and ")"; fields after the last ")" are fixed.
        fields = stat[stat.rfind(")") + 2:].split()
        if len(fields) > 2 and fields[0] != "Z":
            yield ProcEntry(int(entry.name), fields[0], int(fields[1]), int(fields[2]))


def group_members(pgid: int) -> list[int]:
    """Live pids whose process group is `pgid`."""
    return [p.pid for p in live_processes() if p.pgid == pgid]


def children_of(pid: int) -> list[int]:
    """Live pids whose parent is `pid`."""
    return [p.pid for p in live_processes() if p.ppid == pid]
