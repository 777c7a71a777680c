"""The public face of patching: what serve, bench, ci and the commands import.

Every failure raises an M3PatchError subclass.

    from m3patch.patching.api import ensure_series, apply_series, verify_tree, read_ledger
    from m3patch.patching.locate import find_vllm
    from m3patch.patching.series import load_series

    tree = find_vllm(python=None, vllm_root=None)
    series = load_series(Path("patches/vllm-0.33.0"))
    ensured = ensure_series(tree, series)        # apply (idempotent) + verify + ledger digest
    report = apply_series(tree, series)          # report.summary() is the last line
    verify_tree(tree, series).raise_for_failure()
    ledger = read_ledger(tree.root)              # provenance: ledger.series, ledger.patches

Where things live (the pipeline pin -> read -> classify -> plan -> commit): series_lock (pins
written and read), snapshot (read + classify, never writes), verify and status (read-only
reports), apply and revert (plan + commit), writer (the one writer: journal, lock).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from m3patch.errors import TreeIOError, VerifyFailed
from m3patch.fsio import read_state
from m3patch.patching.apply import ApplyReport, apply_series
from m3patch.patching.ledger import digest, ledger_path, read_ledger
from m3patch.patching.locate import VllmTree
from m3patch.patching.revert import revert_series
from m3patch.patching.series import Series
from m3patch.patching.states import Mode
from m3patch.patching.status import StatusReport, tree_status
from m3patch.patching.verify import VerifyReport, verify_tree

__all__ = ["ApplyReport", "EnsuredTree", "Mode", "StatusReport", "VerifyReport", "apply_series",
           "ensure_series", "read_ledger", "revert_series", "tree_status", "verify_tree"]


@dataclass(frozen=True)
class EnsuredTree:
    """A tree that holds exactly the series, verified: what serve, bench and ci launch on."""

    tree: VllmTree
    series: Series
    report: ApplyReport
    verify: VerifyReport
    ledger_bytes: bytes

    @property
    def ledger_sha256(self) -> str:
        return digest(self.ledger_bytes)


def ensure_series(tree: VllmTree, series: Series) -> EnsuredTree:
    """Make `tree` exactly `series` (apply, idempotent), verify it, and read back its ledger.

    The one entry point for "patched, verified, and which ledger": `apply --verify`, `serve`,
    `bench` and `ci` all go through here, so they can never disagree on what counts as ready.
    The first try takes no lock (an applied tree, read-only included, needs none); when its
    verify or ledger read fails, a revert may have run in between, so the whole of it runs
    again holding the tree lock, where no other run can change the tree.
    """
    try:
        return _ensure(tree, series)
    except (VerifyFailed, TreeIOError) as first:
        from m3patch.patching import writer  # deferred: the already-applied path never writes

        with contextlib.ExitStack() as held:
            try:
                held.enter_context(writer.tree_lock(tree.root))
            except TreeIOError:
                raise first from None  # a tree this user cannot lock: the first answer stands
            return _ensure(tree, series)


def _ensure(tree: VllmTree, series: Series) -> EnsuredTree:
    report = apply_series(tree, series)
    verify = verify_tree(tree, series, contents=report.contents)
    verify.raise_for_failure()
    try:
        ledger_bytes = read_state(ledger_path(tree.root))
    except OSError as exc:
        msg = f"{ledger_path(tree.root)}: cannot read the ledger apply just wrote ({exc.strerror})"
        raise TreeIOError(msg, hint="m3patch status; then m3patch apply --verify") from None
    return EnsuredTree(tree=tree, series=series, report=report, verify=verify,
                       ledger_bytes=ledger_bytes)
