"""Whether this process may add to m3patch's memos (parsed patches, compiled contents).

A memo only saves time, so a command that promises to write nothing (`locate`, `verify`,
`status`, `apply`/`revert --dry-run`) reads the memos and never adds to them: it leaves the machine as it found it, the
cache included. The CLI sets this once, before the command runs (main.py's command table).
"""

from __future__ import annotations

_STATE = {"read_only": False}


def forbid_writes() -> None:
    _STATE["read_only"] = True


def writes_allowed() -> bool:
    return not _STATE["read_only"]
