"""Status: per patch, per file and per hunk state, and which patches upstream already carries.

Read-only: an interrupted transaction is reported, never recovered here (only apply and revert
act on a journal, holding the tree lock), so status works on a tree the user cannot write.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.patching.locate import VllmTree
from m3patch.patching.series import Series
from m3patch.patching.series_lock import load_patches, pinned
from m3patch.patching.snapshot import (
    PENDING_TRANSACTION,
    check_series_target,
    ledger_notes,
    ledger_view,
    read_and_classify,
    transaction_pending,
    unpinned_message,
    unpinned_patched,
)
from m3patch.patching.states import FileState, Mode, PatchState, state_name

CONFLICT_STATES = (FileState.PARTIAL, FileState.DRIFTED, FileState.UPSTREAM, FileState.MISSING,
                   FileState.MODIFIED)


@dataclass(frozen=True)
class StatusReport:
    series_id: str
    vllm_version: str
    patches: tuple[dict[str, Any], ...]
    files: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]
    interrupted: bool = False  # a journal of a killed run is pending
    unpinned: tuple[str, ...] = ()  # patched by an earlier lock of this series id (unpinned_patched)

    @property
    def conflicts(self) -> tuple[str, ...]:
        """Files that neither apply nor revert can take as they are (exit 5 in `status`)."""
        return (*(f["path"] for f in self.files if f["state"] in CONFLICT_STATES), *self.unpinned)

    def to_json(self) -> dict[str, Any]:
        """The status fields of the --json object; states as stable names without spaces."""
        return {"patches": [{**p, "state": state_name(p["state"])} for p in self.patches],
                "files": [{**f, "state": state_name(f["state"])} for f in self.files],
                "notes": list(self.notes), "conflicts": list(self.conflicts),
                "interrupted": self.interrupted}


def tree_status(tree: VllmTree, series: Series) -> StatusReport:
    """Per patch and file state, hunk diagnosis, and which patches upstream already carries."""
    from m3patch.patching import engine  # deferred: api is imported on the already-applied path

    pins = pinned(series)
    target = check_series_target(tree, series, pins.hashes, Mode.STRICT)
    interrupted = transaction_pending(tree.root)
    notes = [PENDING_TRANSACTION] if interrupted else []
    notes += [] if target.plain else [target.note]
    snap = read_and_classify(tree, series, load_patches(series, pins.raw))
    statuses = ledger_view(snap)
    states = engine.patch_states(snap.chains, statuses)
    files = tuple({"path": c.path, "state": str(statuses[c.path].state),
                   "patches": [s.patch_id for s in c.steps],
                   "sha256": statuses[c.path].current,
                   "diagnosis": engine.diagnosis(statuses[c.path])[1:],
                   "hunks": [h.fields(pid) for pid, h in statuses[c.path].hunks],
                   "differs_at": statuses[c.path].differs_at}
                  for c in snap.chains)
    rows = tuple({"id": p.id, "state": str(states.get(p.id, PatchState.NO_FILES)),
                  "summary": p.summary,
                  "can_drop": states.get(p.id) == PatchState.UPSTREAM,
                  "files": [c.path for c in snap.chains
                            if any(s.patch_id == p.id for s in c.steps)]}
                 for p in series.patches)
    currents = {p: s.current for p, s in snap.statuses.items()}
    notes += ledger_notes(series.id, pins.hashes, currents, snap.ledger, snap.ledger_note)
    stray = unpinned_patched(tree, snap.ledger, series.id, pins.hashes)
    if stray:
        msg, hint = unpinned_message(tree, series, stray)
        notes.append(f"{msg}; {hint}")
    return StatusReport(series_id=series.id, vllm_version=tree.version, patches=rows,
                        files=files, notes=tuple(notes), interrupted=interrupted,
                        unpinned=stray)
