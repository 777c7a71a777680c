"""Whether this process may add to m3patch's memos (parsed patches, compiled contents,
post-images).

A memo only saves time, so a command that promises to write nothing (`locate`, `verify`,
`status`, `apply`/`revert --dry-run`) reads the memos and never adds to them: it leaves the machine as it found it, the
cache included. The CLI sets this once, before the command runs (main.py's command table).
"""

from __future__ import annotations

_STATE = {"read_only": False}


def forbid_writes() -> None:
    _STATE["read_only"] = True


def start_command(read_only: bool) -> None:
    """Each command starts from its own promise, not from what an earlier command in the same
    process (a test run, an embedding tool) left behind."""
    _STATE["read_only"] = read_only


def writes_allowed() -> bool:
    return not _STATE["read_only"]
