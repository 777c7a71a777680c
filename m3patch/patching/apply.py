"""Apply: plan the change from a classified snapshot, then commit it through the writer.

The write half of the pipeline pin -> read -> classify -> plan -> commit; revert.py is its
mirror and shares the report, the lock discipline and the one-series rule defined here. A real
run takes the tree lock, finishes or rolls back a transaction a killed run left (writer.recover),
then reads, plans and commits under that lock. A dry run takes no lock and creates nothing: it plans on the
files as they are and says when a pending transaction would be recovered first.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from m3patch.errors import PatchConflict, TreeIOError, UsageError, VersionMismatch
from m3patch.patching.diffs import safe_targets
from m3patch.patching.ledger import (
    Ledger,
    LedgerFile,
    journal_path,
    new_ledger,
    read_ledger,
    state_dir,
)
from m3patch.patching.locate import VllmTree, read_version
from m3patch.patching.series import Series
from m3patch.patching.series_lock import Patches, Pinned, pinned, with_patches
from m3patch.patching.snapshot import (
    Contents,
    Snapshot,
    Target,
    check_series_target,
    current_hashes,
    ledger_view,
    read_and_classify,
    read_files,
    transaction_pending,
    unpinned_message,
    unpinned_patched,
)
from m3patch.patching.states import FileState, Mode

if TYPE_CHECKING:
    from m3patch.patching import engine, writer
    from m3patch.patching.image_memo import ImagePack

DRY_RUN_PENDING = "an interrupted transaction is pending; a real run recovers it first"


@dataclass(frozen=True)
class ApplyReport:
    series_id: str
    mode: Mode
    dry_run: bool
    applied: tuple[str, ...]  # patch ids this run wrote (reverted, in revert mode)
    already: tuple[str, ...]  # patch ids that were in place before (not applied, in revert mode)
    files_written: tuple[str, ...] = ()  # every path this run wrote or deleted
    offsets: tuple[str, ...] = ()  # offset mode: one line per hunk that moved
    notes: tuple[str, ...] = ()  # journal recovery, version policy, ledger repairs
    deleted: tuple[str, ...] = ()  # the paths of files_written that were deleted
    # offset mode, for --json: every hunk with its path, patch, line and offset
    hunks: tuple[dict[str, Any], ...] = ()
    # the already-applied path read and hashed these; verify_tree(contents=...) reuses them
    contents: Contents | None = field(default=None, repr=False, compare=False)

    def to_json(self) -> dict[str, Any]:
        """The run's fields of the --json object (docs/json-schema.md)."""
        done, other = ("reverted", "not_applied") if self.mode == Mode.REVERT else (
            "applied", "already_applied")
        return {"dry_run": self.dry_run, done: list(self.applied), other: list(self.already),
                "files_written": list(self.files_written), "deleted": list(self.deleted),
                "hunks": list(self.hunks), "notes": list(self.notes)}

    def summary(self) -> str:
        if self.mode == Mode.REVERT:
            verb = "would revert" if self.dry_run else "reverted"
            return f"m3patch: {len(self.applied)} {verb}, {len(self.already)} not applied, 0 conflicts"
        verb = "would apply" if self.dry_run else "applied"
        return (f"m3patch: {len(self.applied)} {verb}, {len(self.already)} already applied, "
                "0 conflicts")


@contextlib.contextmanager
def locked_or_dry(tree: VllmTree, dry_run: bool, notes: list[str]) -> Iterator[None]:
    """A real run: the tree lock, and recovery of a killed run's journal under it. A dry run:
    neither (it must work on a tree the user cannot write), only a note."""
    if dry_run:
        if transaction_pending(tree.root):
            notes.append(DRY_RUN_PENDING)
        yield
        return
    from m3patch.patching import writer  # deferred: the already-applied fast path never writes

    with writer.tree_lock(tree.root):
        recovered = writer.recover(tree.root)
        notes.extend([recovered] if recovered else [])
        yield


def checked_target(tree: VllmTree, series: Series, hashes: Mapping[str, tuple[str | None, ...]],
                   mode: Mode, dry_run: bool) -> tuple[VllmTree, Target, list[str]]:
    """The version check (snapshot.check_series_target), and where it fails with a killed run's
    journal pending: that journal finished or rolled back under the tree lock, then the check
    again on the tree as it now is (its version read afresh). A run killed after it replaced
    vllm/_version.py and before it wrote the ledger leaves the series' version image with no
    ledger of this series, which the check alone refuses (exit 4) for ever. Returns the tree,
    the target and the recovery note; a dry run never recovers."""
    try:
        return tree, check_series_target(tree, series, hashes, mode), []
    except VersionMismatch:
        if dry_run or not transaction_pending(tree.root):
            raise
    from m3patch.patching import writer  # deferred: the already-applied fast path never writes

    with writer.tree_lock(tree.root):
        recovered = writer.recover(tree.root)
    notes = [recovered] if recovered else []
    version, commit = read_version(tree.package_dir)
    tree = replace(tree, version=version, commit=commit)
    try:
        return tree, check_series_target(tree, series, hashes, mode), notes
    except VersionMismatch as exc:
        msg = f"{exc.message} (checked after: {'; '.join(notes) or 'no journal left'})"
        raise VersionMismatch(msg, hint=exc.hint) from None


def refuse_other_series(snap: Snapshot, tree: VllmTree) -> None:
    """One tree holds one series: its ledger names it. Taking over a tree another series
    patched would leave that series' other files patched and its folders unrecorded."""
    ledger, series = snap.ledger, snap.series
    if ledger is not None and ledger.series == series.id:
        stray = unpinned_patched(tree, ledger, series.id, snap.statuses)
        if stray:
            msg, hint = unpinned_message(tree, series, stray)
            raise PatchConflict(msg, hint=hint)
        return
    if ledger is None or not ledger.files:
        return
    msg = (f"{tree.root}: the tree holds series {ledger.series} (vllm/.m3patch/ledger.json), "
           f"not {series.id}; one tree holds one series at a time")
    hint = (f"switch: `m3patch revert --vllm-root {tree.root} --series <folder of "
            f"{ledger.series}>`, then `m3patch apply --vllm-root {tree.root} "
            f"--series {series.directory}`")
    raise PatchConflict(msg, hint=hint)


def _selected(snap: Snapshot, only: Iterable[str] | None) -> tuple[engine.Chain, ...]:
    if not only:
        return snap.chains
    wanted = set(only)
    unknown = wanted - {p.id for p in snap.series.patches}
    if unknown:
        msg = f"--only {sorted(unknown)[0]}: no such patch in series {snap.series.id}"
        raise UsageError(msg, hint=f"m3patch series show --series {snap.series.directory}")
    chosen = []
    for chain in snap.chains:
        ids = {s.patch_id for s in chain.steps}
        if ids & wanted and not ids <= wanted:
            msg = f"--only: {chain.path} is also changed by {sorted(ids - wanted)}; select those too"
            raise UsageError(msg, hint="add every patch that touches the same file to --only")
        if ids & wanted:
            chosen.append(chain)
    return tuple(chosen)


def _plan(snap: Snapshot, chains: Iterable[engine.Chain], mode: Mode,
          images: ImagePack | None = None) -> list[engine.FilePlan]:
    from m3patch.patching import engine  # deferred: the already-applied fast path never plans

    plans, conflicts = [], []
    view = ledger_view(snap)  # offset-applied files, and files modified since m3patch wrote them
    for chain in chains:
        status = snap.statuses[chain.path]
        if status.stage == len(chain.steps) or view[chain.path].state == FileState.APPLIED_OFFSET:
            continue
        if status.stage is not None:
            known = _known_image(chain, status.stage, images)
            plans.append(known or engine.post_image(chain, status.stage, snap.contents[chain.path]))
        elif mode == Mode.OFFSET:
            plans.append(engine.offset_image(chain, snap.contents[chain.path]))
        else:
            conflicts.extend(engine.diagnosis(view[chain.path]))
    if conflicts:
        msg = engine.summarize(conflicts, "refusing to patch files that match no pinned image")
        version = snap.series.target_version
        raise PatchConflict(msg, hint="m3patch status; restore with `pip install --force-reinstall "
                            f"--no-deps vllm=={version}`, or port the patch (apply --offset)")
    return plans


def _known_image(chain: engine.Chain, stage: int, images: ImagePack | None,
                 ) -> engine.FilePlan | None:
    """A file at a pinned stage whose final image the image memo holds (checked against the
    lock's pin) needs no hunk applied; a file the lock deletes needs none under a pack."""
    from m3patch.patching import engine

    if images is None:
        return None
    post = chain.hashes[-1]
    data = None if post is None else images.image(post)
    if post is not None and data is None:
        return None
    return engine.FilePlan(chain.path, chain.hashes[stage], post, data)


def _remember_images(series: Series, snap: Snapshot, plans: list[engine.FilePlan]) -> None:
    """After a run that computed every file's post-image: the image memo for the next run."""
    if len(plans) == len(snap.chains):
        from m3patch.patching import image_memo

        image_memo.save(series.require_lock(),
                        {p.post: p.data for p in plans if p.post is not None and p.data is not None})


def _ledger_for(snap: Snapshot, tree: VllmTree, mode: Mode, target: Target,
                plans: list[engine.FilePlan], made: Mapping[str, tuple[str, ...]]) -> Ledger:
    planned = {p.path: p for p in plans}
    old = {f.path: f for f in snap.ledger.files} if snap.ledger else {}
    rebuilt = _added_dirs(tree, snap, set(old))
    view = ledger_view(snap)
    files = []
    for chain in snap.chains:
        plan = planned.get(chain.path)
        if plan is not None:
            files.append(LedgerFile(chain.path, plan.pre, plan.post, made.get(chain.path, ())))
        elif view[chain.path].state == FileState.APPLIED_OFFSET:  # keep what --offset recorded
            files.append(old[chain.path])
            mode = Mode.OFFSET
        elif snap.statuses[chain.path].stage == len(chain.steps):
            dirs = old[chain.path].dirs if chain.path in old else rebuilt.get(chain.path, ())
            files.append(LedgerFile(chain.path, chain.hashes[0], chain.hashes[-1], dirs))
    done = {f.path for f in files}
    paths_of: dict[str, set[str]] = {}
    for chain in snap.chains:
        for step in chain.steps:
            paths_of.setdefault(step.patch_id, set()).add(chain.path)
    patches = tuple(p.id for p in snap.series.patches if paths_of.get(p.id, set()) <= done)
    return new_ledger(series=snap.series.id, mode=mode, vllm_version=target.version,
                      vllm_commit=target.commit, version_note=target.note, patches=patches,
                      files=tuple(files))


def _added_dirs(tree: VllmTree, snap: Snapshot, recorded: set[str]) -> dict[str, tuple[str, ...]]:
    """For a ledger rebuilt over files already added (the ledger lost or corrupt): per added
    file it no longer records, the folders that hold nothing but what the series adds, which
    its apply must have created (a wheel has no empty folder), shallowest first; so revert
    removes them as after a recorded apply."""
    added = {c.path for c in snap.chains if c.hashes[0] is None and c.hashes[-1] is not None
             and snap.statuses[c.path].stage == len(c.steps)}
    if not added - recorded:
        return {}
    ours: dict[str, bool] = {}

    def only_added(folder: str) -> bool:
        if folder not in ours:
            try:
                with os.scandir(tree.root / folder) as found:
                    entries = [(e.name, e.is_dir(follow_symlinks=False)) for e in found]
            except OSError:
                entries = [("", False)]  # unreadable: never claimed
            ours[folder] = all(f"{folder}/{name}" in added or (is_dir and only_added(
                f"{folder}/{name}")) for name, is_dir in entries)
        return ours[folder]

    made: dict[str, tuple[str, ...]] = {}
    claimed: set[str] = set()
    for path in sorted(added - recorded):
        dirs = [d for d in reversed(_folders_below_vllm(path)) if only_added(d)]
        made[path] = tuple(d for d in dirs if d not in claimed)
        claimed.update(dirs)
    return made


def _record(led: Ledger) -> tuple[object, ...]:
    return (led.series, led.mode, led.patches, led.vllm_version,
            {f.path: (f.pre, f.post) for f in led.files})


def _same(a: Ledger | None, b: Ledger) -> bool:
    return a is not None and _record(a) == _record(b)


def _depth(folder: str) -> int:
    return folder.count("/")


def _folders_below_vllm(path: str) -> list[str]:
    """The folders above `path` and below vllm/, deepest first (vllm/a/b/c.py: vllm/a/b, vllm/a);
    plain strings, as paths are normalized when read: PurePosixPath.parents per planned file
    was a tenth of a release-sized apply."""
    parts = path.split("/")
    return ["/".join(parts[:n]) for n in range(len(parts) - 1, 1, -1)]


def missing_dirs(tree: VllmTree, plans: list[engine.FilePlan]) -> dict[str, tuple[str, ...]]:
    """Per new file, the folders this run must create for it (shallowest first); a folder
    needed by two new files is named once, so exactly the created folders are recorded."""
    made: dict[str, tuple[str, ...]] = {}
    claimed: set[str] = set()
    there: dict[str, bool] = {}  # folder -> exists, once per folder
    for plan in plans:
        if plan.pre is not None or plan.post is None:
            continue
        parents = _folders_below_vllm(plan.path)
        for d in parents:
            if d not in there:
                there[d] = (tree.root / d).exists()
        missing = [d for d in reversed(parents) if not there[d]]
        made[plan.path] = tuple(d for d in missing if d not in claimed)
        claimed.update(missing)
    return made


def _emptied_dirs(tree: VllmTree, plans: list[engine.FilePlan]) -> dict[str, tuple[str, ...]]:
    """Per deleted file, the folders (below vllm/) this run's deletions leave empty, counting
    its additions: they go with the file, as with `git apply` (an empty folder would import as
    an empty namespace package), and the ledger names them so a revert re-creates them."""
    gone = {p.path for p in plans if p.post is None}
    kept = {d for p in plans if p.post is not None for d in _folders_below_vllm(p.path)}
    candidates = {d for g in gone for d in _folders_below_vllm(g)}
    emptied: set[str] = set()
    for folder in sorted(candidates - kept, key=_depth, reverse=True):  # children first
        try:
            entries = {f"{folder}/{e.name}" for e in (tree.root / folder).iterdir()}
        except OSError:
            continue
        if entries <= gone | emptied:
            emptied.add(folder)
    out: dict[str, tuple[str, ...]] = {}
    claimed: set[str] = set()
    for path in sorted(gone):
        parents = list(reversed(_folders_below_vllm(path)))
        out[path] = tuple(d for d in parents if d in emptied and d not in claimed)
        claimed.update(out[path])
    return out


def folders_of(tree: VllmTree, plans: list[engine.FilePlan]) -> dict[str, tuple[str, ...]]:
    """Per file this run adds or deletes, the folders that exist only because of it: created
    with a new file, removed with a deleted one. Recorded in the ledger (LedgerFile.dirs)."""
    return {**missing_dirs(tree, plans), **_emptied_dirs(tree, plans)}


def _already_applied(tree: VllmTree, pins: Pinned, version: str, dry_run: bool,
                     notes: list[str]) -> ApplyReport | None:
    """The common case, decided without the lock or any patch parsed: no journal, a ledger of
    this series, and every file equal to the post-image it records (the final pin, or after
    `apply --offset` the offset post-image). Anything else: None, and the locked path decides."""
    series = pins.series
    folder = state_dir(tree.root)
    if folder.is_symlink() or folder.parent.is_symlink():
        return None  # the locked path refuses it (HostilePatch), never reads through it
    try:  # a journal, or a temp file of a killed run: the locked path recovers and cleans up
        if not {p.name for p in state_dir(tree.root).iterdir()} <= {"ledger.json", "lock"}:
            return None
    except OSError:
        return None
    try:
        ledger = read_ledger(tree.root)
    except TreeIOError:
        return None
    ids = tuple(p.id for p in series.patches)
    if ledger is None or (ledger.series, ledger.patches, ledger.vllm_version) != (
            series.id, ids, version):
        return None
    recorded = {f.path: (f.pre, f.post) for f in ledger.files}
    if recorded.keys() != pins.hashes.keys():
        return None
    contents = read_files(tree, list(pins.hashes))
    currents = current_hashes(contents)
    for path, hashes in pins.hashes.items():
        pre, post = recorded[path]
        exact = (pre, post) == (hashes[0], hashes[-1])
        if currents[path] != post or not (exact or ledger.mode == Mode.OFFSET):
            return None  # an offset ledger: files equal to the post-images --offset recorded
        if not exact and post in hashes:
            return None  # the files win: a file at an earlier pin is pending, whatever it says
    if journal_path(tree.root).exists():
        return None  # a transaction that began while we read
    return ApplyReport(series_id=series.id, mode=Mode.STRICT, dry_run=dry_run, applied=(),
                       already=ids, notes=tuple(notes), contents=contents)


def to_changes(tree: VllmTree, chains: Iterable[engine.Chain], plans: list[engine.FilePlan],
               dirs: Mapping[str, tuple[str, ...]], new_file: str) -> list[writer.Change]:
    """The writer's changes for these plans: a new file with the folders to create for it (and
    the mode git recorded where the series `new_file`s it: "add", or "delete" for a revert),
    a deleted file with the folders to remove after it; every path re-checked as confined."""
    from m3patch.patching import engine, writer  # deferred: only a run that writes needs them

    by_path = {c.path: c for c in chains}
    safe_targets(tree.root, [p.path for p in plans])
    changes = []
    for p in plans:
        folders = dirs.get(p.path, ())
        if p.pre is None:
            changes.append(writer.Change(p.path, p.pre, p.post, p.data,
                                         engine.new_file_mode(by_path[p.path], new_file),
                                         make_dirs=folders))
        else:
            changes.append(writer.Change(p.path, p.pre, p.post, p.data,
                                         drop_dirs=folders if p.post is None else ()))
    return changes


def _images(series: Series, mode: Mode, only: Iterable[str] | None) -> ImagePack | None:
    """The image memo of this lock for a plain strict apply (offset mode applies hunks where
    they now fit, and --only some patches leaves other files at intermediate pins)."""
    if only or mode != Mode.STRICT:
        return None
    from m3patch.patching import image_memo  # deferred: only a run that plans needs it

    return image_memo.load(series.require_lock())


def apply_series(tree: VllmTree, series: Series, *, dry_run: bool = False,
                 only: Iterable[str] | None = None, mode: Mode | str = Mode.STRICT) -> ApplyReport:
    """Apply the whole series (or `only` some patches) as one transaction; idempotent."""
    if mode not in (Mode.STRICT, Mode.OFFSET):
        msg = f"unknown mode {mode!r}"
        raise UsageError(msg, hint="use mode='strict' or mode='offset'")
    mode = Mode(mode)
    pins = pinned(series)
    tree, target, recovered = checked_target(tree, series, pins.hashes, mode, dry_run)
    notes = recovered + [n for n in (tree.patch_note(), None if target.plain else target.note) if n]
    if not only and mode == Mode.STRICT:
        done = _already_applied(tree, pins, target.version, dry_run, notes)
        if done is not None:
            return done
    images = _images(series, mode, only)

    def transaction(patches: Patches) -> tuple[tuple[engine.Chain, ...], list[engine.FilePlan]]:
        with locked_or_dry(tree, dry_run, notes):
            snap = read_and_classify(tree, series, patches)
            refuse_other_series(snap, tree)
            chains = _selected(snap, only)
            plans = _plan(snap, chains, mode, images)
            made = folders_of(tree, plans)
            ledger = _ledger_for(snap, tree, mode, target, plans, made)
            if not dry_run and (plans or not _same(snap.ledger, ledger)):
                if not plans:
                    notes.append("files already patched; the ledger was missing or stale: "
                                 "rewritten")
                from m3patch.patching import writer  # deferred: only a run that writes needs it

                writer.commit(tree.root, to_changes(tree, chains, plans, made, "add"),
                              ledger.to_bytes())
                if images is None:
                    _remember_images(series, snap, plans)
        return chains, plans

    chains, plans = with_patches(series, pins.raw, transaction)
    wanted = {s.patch_id for c in chains for s in c.steps}
    by_path = {c.path: c for c in chains}
    pending = {s.patch_id for p in plans for s in by_path[p.path].steps}
    offsets = tuple(f"{p.path}: {pid} hunk {h.index} applied at line {h.line} (offset {h.offset:+d})"
                    for p in plans for pid, h in p.offsets if h.offset)
    hunk_state = "pending" if dry_run else "applied"  # the probe's state is the one before the run
    hunks = tuple({"path": p.path, **h.fields(pid), "state": hunk_state}
                  for p in plans for pid, h in p.offsets)
    order = [p.id for p in series.patches if p.id in wanted]
    return ApplyReport(series_id=series.id, mode=mode, dry_run=dry_run,
                       applied=tuple(i for i in order if i in pending),
                       already=tuple(i for i in order if i not in pending),
                       files_written=tuple(p.path for p in plans), offsets=offsets,
                       notes=tuple(notes), deleted=tuple(p.path for p in plans if p.post is None),
                       hunks=hunks)
