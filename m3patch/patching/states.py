"""The state vocabulary of patching: file states, patch states and run modes.

Enums whose values are the stable strings status, the ledger and JSON output carry. Kept apart
from the engine so the read-only reports and the already-applied fast path name states without
importing it.
"""

from __future__ import annotations

from enum import Enum


class TextEnum(str, Enum):
    """A str enum (Python 3.10 has no StrEnum) that prints and serialises as its value."""

    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class Mode(TextEnum):
    """How a run changes the tree; the ledger records strict or offset."""

    STRICT = "strict"  # every file from or to an exact pinned image
    OFFSET = "offset"  # porting: exact hunks at reported offsets on an unpinned file
    REVERT = "revert"  # back to the pinned pre-images


class FileState(TextEnum):
    """A file's state against its chain of pins; the values are what status prints and emits."""

    PRISTINE = "pristine"
    APPLIED = "applied"
    APPLIED_OFFSET = "applied (offset)"  # equals the post-image an offset apply recorded
    PARTIAL = "partially applied"
    DRIFTED = "drifted"
    MISSING = "missing"  # the series pins the file, no pin says it is absent, and it is absent
    UPSTREAM = "upstreamed"  # the pristine upstream file already contains the change
    MODIFIED = "modified after apply"  # the ledger says m3patch wrote it; it matches no pin now


class PatchState(TextEnum):
    """A patch's state, from the stages of the files it touches."""

    APPLIED = "applied"
    PENDING = "pending"
    PARTIAL = "partially applied"
    CONFLICT = "conflict"
    UPSTREAM = "upstreamed"
    NO_FILES = "no files"


def state_name(state: object) -> str:
    """The stable --json name of a state: 'applied (offset)' -> 'applied-offset',
    'modified after apply' -> 'modified-after-apply' (the human output keeps its words)."""
    return "-".join(str(state).replace("(", " ").replace(")", " ").split())
