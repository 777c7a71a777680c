"""Revert: every file back to its exact pinned pre-image (re-read after the write), ledger removed.

The mirror of apply.py, with the same report, lock discipline (a dry run takes no lock) and
one-series rule. After `apply --offset`, files equal to the recorded offset post-images are
undone at offsets.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from m3patch.errors import PatchConflict, VerifyFailed
from m3patch.patching.apply import (
    ApplyReport,
    checked_target,
    locked_or_dry,
    missing_dirs,
    refuse_other_series,
    to_changes,
)
from m3patch.patching.diffs import check_rel_path
from m3patch.patching.ledger import file_digest
from m3patch.patching.locate import VllmTree
from m3patch.patching.series import Series
from m3patch.patching.series_lock import Patches, pinned, with_patches
from m3patch.patching.snapshot import Snapshot, read_and_classify
from m3patch.patching.states import Mode

if TYPE_CHECKING:
    from m3patch.patching import engine


def revert_plans(snap: Snapshot) -> list[engine.FilePlan]:
    from m3patch.patching import engine  # deferred: off the fast path

    plans, conflicts = engine.revert_plans(snap.chains, snap.statuses, snap.contents, snap.ledger)
    if conflicts:
        msg = engine.summarize(conflicts, "cannot revert files that match no pinned image")
        raise PatchConflict(msg, hint="reinstall vLLM: `pip install --force-reinstall --no-deps "
                            f"vllm=={snap.series.target_version}`")
    return plans


def _folders(tree: VllmTree, snap: Snapshot,
             plans: list[engine.FilePlan]) -> dict[str, tuple[str, ...]]:
    """Folders a revert creates (for a file the series deleted: the ones missing now, which its
    apply removed) and removes (for a file the series added: the ones the ledger says its apply
    created; a folder that existed before, even empty, stays)."""
    dirs = missing_dirs(tree, plans)
    recorded = {f.path: f.dirs for f in snap.ledger.files} if snap.ledger else {}
    for plan in plans:
        if plan.post is None:
            dirs[plan.path] = tuple(check_rel_path(d, "ledger.json dirs")
                                    for d in recorded.get(plan.path, ()))
    return dirs


def revert_series(tree: VllmTree, series: Series, *, dry_run: bool = False) -> ApplyReport:
    """Restore every file to its exact pinned pre-image (verified), then remove the ledger."""
    pins = pinned(series)
    tree, target, recovered = checked_target(tree, series, pins.hashes, Mode.REVERT, dry_run)
    notes = recovered + [n for n in (tree.patch_note(), None if target.plain else target.note) if n]

    def transaction(patches: Patches) -> tuple[Snapshot, list[engine.FilePlan]]:
        with locked_or_dry(tree, dry_run, notes):
            snap = read_and_classify(tree, series, patches)
            refuse_other_series(snap, tree)
            plans = revert_plans(snap)
            if not dry_run and (plans or snap.ledger is not None):
                from m3patch.patching import writer  # deferred: off the fast path

                changes = to_changes(tree, snap.chains, plans, _folders(tree, snap, plans),
                                     "delete")
                writer.commit(tree.root, changes, None)
                _check_written(tree, plans)
        return snap, plans

    snap, plans = with_patches(series, pins.raw, transaction)
    reverted = {s.patch_id for p in plans for c in snap.chains if c.path == p.path
                for s in c.steps}
    order = [p.id for p in series.patches]
    return ApplyReport(series_id=series.id, mode=Mode.REVERT, dry_run=dry_run,
                       applied=tuple(i for i in order if i in reverted),
                       already=tuple(i for i in order if i not in reverted),
                       files_written=tuple(p.path for p in plans), notes=tuple(notes),
                       deleted=tuple(p.path for p in plans if p.post is None))


def _check_written(tree: VllmTree, plans: list[engine.FilePlan]) -> None:
    """Re-read what the transaction wrote: a revert promises the exact pinned pre-images."""
    for plan in plans:
        got = file_digest(tree.root / plan.path)
        if got != plan.post:
            msg = f"{plan.path}: sha256 {got} after the write, expected {plan.post}"
            raise VerifyFailed(msg, hint="m3patch status; the disk or another writer interfered")
