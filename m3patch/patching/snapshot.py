"""Read and classify: the series' files as they are on disk, their states, and the ledger.

The read half of the pipeline pin -> read -> classify -> plan -> commit. Nothing here writes:
status and verify are built on it and must work on a tree the user cannot write. Files win over
the ledger: every state comes from content hashes and hunk probes; the ledger is only compared
with them to report that it is stale.
"""

from __future__ import annotations

import errno
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from m3patch.errors import PatchConflict, TreeIOError, VersionMismatch
from m3patch.fsio import read_bytes
from m3patch.patching.diffs import safe_targets
from m3patch.patching.folder_shares import run_shares
from m3patch.patching.ledger import Ledger, digest, journal_path, read_ledger
from m3patch.patching.locate import VllmTree, check_target
from m3patch.patching.series import Series
from m3patch.patching.states import FileState, Mode

if TYPE_CHECKING:
    from m3patch.patching import engine
    from m3patch.patching.diffs import PatchFile
    from m3patch.patching.series_lock import PatchPin

Contents = Mapping[str, bytes | None]
PENDING_TRANSACTION = ("an interrupted transaction is pending (vllm/.m3patch/journal.json): "
                       "`m3patch apply` or `m3patch revert` completes or rolls it back")


VERSION_FILE = "vllm/_version.py"


def read_files(tree: VllmTree, paths: list[str]) -> dict[str, bytes | None]:
    """Every path's bytes (None: absent), read on a few threads for a release-sized series."""
    targets = safe_targets(tree.root, paths)
    rels = list(targets)
    data = run_shares(_read_one, list(targets.values()), [r.rpartition("/")[0] for r in rels])
    return dict(zip(rels, data, strict=True))


def _read_one(path: str) -> bytes | None:
    try:
        return read_bytes(path)
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        msg = f"{path}: a folder stands where the series pins a file"
        raise PatchConflict(msg, hint="move the folder aside, then `m3patch status`; "
                            "`pip install --force-reinstall --no-deps vllm` restores the file"
                            ) from None
    except OSError as exc:
        if exc.errno in _ODD_FILE:
            what = _ODD_FILE[exc.errno]
            msg = f"{path}: {what} stands where the series pins a source file"
            raise PatchConflict(msg, hint="remove it, then `pip install --force-reinstall "
                                "--no-deps vllm==<this tree's version>` restores the file "
                                "(`m3patch locate` prints the version)") from None
        msg = f"{path}: cannot read: {exc.strerror}"
        raise TreeIOError(msg, hint="check permissions on the vLLM tree") from None


# read_bytes reads only a regular file within its size bound, never through a link
_ODD_FILE = {errno.EINVAL: "something that is no regular file (a FIFO, a socket or a device)",
             errno.EFBIG: "a file larger than any vLLM source",
             errno.ELOOP: "a symlink",
             errno.ENXIO: "a socket"}  # open(2) of a unix socket


def current_hashes(contents: Contents) -> dict[str, str | None]:
    return {p: None if d is None else digest(d) for p, d in contents.items()}


def transaction_pending(root: Path) -> bool:
    """A journal left by a killed run; only apply/revert (under the tree lock) act on it."""
    return journal_path(root).exists()


def ledger_or_note(tree: VllmTree) -> tuple[Ledger | None, str | None]:
    try:
        return read_ledger(tree.root), None
    except TreeIOError as exc:
        return None, f"ignored: {exc.message}"


@dataclass(frozen=True)
class Target:
    """The version check's outcome: the note for the ledger and the vLLM version the series
    stands on (what the ledger records; after a series rewrote vllm/_version.py, the version
    it was applied on, not the one the file now says)."""

    note: str
    version: str
    commit: str | None

    @property
    def plain(self) -> bool:
        """Nothing to say: the tree is the target release as it is."""
        return self.note == f"{self.version} accepted"


def _safe_ledger(tree: VllmTree) -> Ledger | None:
    try:
        return read_ledger(tree.root)
    except TreeIOError:
        return None


def check_series_target(tree: VllmTree, series: Series, hashes: Mapping[str, tuple[str | None, ...]],
                        mode: Mode) -> Target:
    """The version policy (locate.check_target), with two cases the live version cannot decide:
    a series that patches vllm/_version.py (the file at its pinned pristine image proves the
    target version by hash; at a later pinned image, the ledger of this series proves it wrote
    it), and a tree `apply --offset` ported to another version (its ledger, mode offset, says so).
    Every command on a tree and a series calls this first, so apply, verify, status and revert
    give the same verdict (VersionMismatch, exit 4) on another version's tree."""
    ledger = _safe_ledger(tree)
    ours = ledger is not None and ledger.series == series.id
    pins = hashes.get(VERSION_FILE)
    if pins is not None:
        try:
            current: str | None = digest(read_bytes(tree.root / VERSION_FILE))
        except OSError:
            current = None
        if current is not None and current == pins[0]:
            return Target(f"{tree.version} accepted", tree.version, tree.commit)
        if current is not None and current in pins[1:] and ours and ledger is not None:
            return Target(ledger.version_note, ledger.vllm_version, ledger.vllm_commit)
    try:
        return Target(check_target(tree, series.target_version, series.target_commit),
                      tree.version, tree.commit)
    except VersionMismatch as exc:
        if mode == Mode.OFFSET or (ours and ledger is not None and ledger.mode == Mode.OFFSET):
            return Target(f"offset mode: {exc.message}", tree.version, tree.commit)
        if transaction_pending(tree.root):  # status and verify never recover; apply and revert do, then check again
            msg = f"{exc.message} ({PENDING_TRANSACTION})"
            raise VersionMismatch(msg, hint=f"m3patch apply --vllm-root {tree.root} --series "
                                  f"{series.directory} finishes or undoes it, then checks the "
                                  "version again (a tree of another vLLM stays refused)") from None
        raise


@dataclass(frozen=True)
class Snapshot:
    """The series' files as read, classified against their chains of pins, with the ledger."""

    series: Series
    chains: tuple[engine.Chain, ...]
    contents: dict[str, bytes | None]
    statuses: dict[str, engine.FileStatus]
    ledger: Ledger | None
    ledger_note: str | None = None


def read_and_classify(tree: VllmTree, series: Series,
                      patches: tuple[tuple[PatchFile, PatchPin], ...],
                      contents: Contents | None = None) -> Snapshot:
    from m3patch.patching import engine  # deferred: the already-applied fast path never loads it

    chains = engine.build_chains(patches)
    data = dict(contents) if contents is not None else read_files(tree, [c.path for c in chains])
    # hashing a file releases the GIL: the classification of a release shares the CPUs
    classified = run_shares(lambda c: engine.classify(c, data[c.path]), chains,
                            [c.path.rpartition("/")[0] for c in chains])
    statuses = {c.path: status for c, status in zip(chains, classified, strict=True)}
    ledger, note = ledger_or_note(tree)
    return Snapshot(series, chains, data, statuses, ledger, note)


def ledger_view(snap: Snapshot) -> dict[str, engine.FileStatus]:
    """The states status and verify report, where the ledger of this series explains a file that
    matches no pin: equal to the post-image an offset apply recorded is applied (offset); any
    other content in a file m3patch wrote was modified after apply (never "upstreamed")."""
    ledger = snap.ledger
    ours = ledger is not None and ledger.series == snap.series.id
    recorded = {f.path: f.post for f in ledger.files} if ledger is not None and ours else {}
    offset = ledger is not None and ledger.mode == Mode.OFFSET
    view = {}
    for chain in snap.chains:
        status = snap.statuses[chain.path]
        if status.stage is None and chain.path in recorded:
            if offset and recorded[chain.path] == status.current:
                status = replace(status, state=FileState.APPLIED_OFFSET, stage=len(chain.steps),
                                 hunks=())
            elif status.state != FileState.MISSING:
                status = replace(status, state=FileState.MODIFIED)
        if status.stage is None and status.state != FileState.MISSING:
            # deferred: only a file off every pin needs them (never the already-applied path)
            from m3patch.patching import engine
            from m3patch.patching.pristine import cached_file

            pristine = cached_file(snap.series.target_version, chain.path)
            status = engine.locate_drift(chain, status, snap.contents[chain.path], pristine)
        view[chain.path] = status
    return view


def unpinned_patched(tree: VllmTree, ledger: Ledger | None, series_id: str,
                     pinned_paths: Collection[str]) -> tuple[str, ...]:
    """Files the ledger of a series of this id records as patched, that this lock does not pin,
    and that are not back at their recorded pre-image. A series relocked under the same id
    without a patch would otherwise leave that patch's files patched with every command
    passing: the tree holds another series, whatever its name."""
    if ledger is None or ledger.series != series_id:
        return ()
    extra = [f for f in ledger.files if f.path not in pinned_paths]
    if not extra:
        return ()
    hashes = current_hashes(read_files(tree, [f.path for f in extra]))
    return tuple(f.path for f in extra if hashes[f.path] != f.pre)


def unpinned_message(tree: VllmTree, series: Series, paths: tuple[str, ...]) -> tuple[str, str]:
    """What apply, revert, verify and status say of unpinned_patched files: (message, hint)."""
    msg = (f"{tree.root}: {len(paths)} file(s) patched by an earlier lock of series {series.id} "
           f"that this lock does not pin (e.g. {paths[0]}; vllm/.m3patch/ledger.json records "
           "them): the tree holds another series of the same name")
    hint = (f"revert with the series folder that patched it (`m3patch revert --vllm-root "
            f"{tree.root} --series <that folder>`), or restore vLLM (`pip install "
            f"--force-reinstall --no-deps vllm=={series.target_version}`, then remove "
            f"{tree.root}/vllm/.m3patch); then `m3patch apply --series {series.directory}`")
    return msg, hint


def ledger_notes(series_id: str, hashes: Mapping[str, tuple[str | None, ...]],
                 currents: Mapping[str, str | None], ledger: Ledger | None,
                 ledger_note: str | None) -> list[str]:
    """Where the ledger disagrees with the files (the files win)."""
    notes = [ledger_note] if ledger_note else []
    if ledger is None:
        if any(currents[p] == h[-1] for p, h in hashes.items()):
            notes.append("no ledger, but patched files are present: `m3patch apply` records it")
        return notes
    if ledger.series != series_id:
        notes.append(f"ledger records series {ledger.series}, not {series_id}")
    stale = [f.path for f in ledger.files if f.path in currents and currents[f.path] != f.post
             and currents[f.path] in hashes.get(f.path, ())]  # back at a pin: apply re-applies
    if stale:
        notes.append(f"stale ledger: it records {len(stale)} patched file(s) that are not "
                     f"(e.g. {stale[0]}; vLLM reinstalled?); `m3patch apply` re-applies")
    return notes
