"""The API serve, bench and CI import. Every failure raises an M3PatchError subclass.

    from m3patch.patching.api import apply_series, verify_tree, read_ledger
    from m3patch.patching.locate import find_vllm
    from m3patch.patching.series import load_series

    tree = find_vllm(python=None, vllm_root=None)
    series = load_series(Path("patches/vllm-0.33.0"))
    report = apply_series(tree, series)          # idempotent; report.summary() is the last line
    verify_tree(tree, series).raise_for_failure()
    ledger = read_ledger(tree.root)              # provenance: ledger.series, ledger.patches
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import TYPE_CHECKING

from m3patch.errors import PatchConflict, TreeIOError, UsageError, VerifyFailed, VersionMismatch
from m3patch.patching.diffs import check_rel_path, safe_target
from m3patch.patching.ledger import (
    Ledger,
    LedgerFile,
    digest,
    file_digest,
    journal_path,
    ledger_path,
    new_ledger,
    read_ledger,
    state_dir,
)
from m3patch.patching.locate import VllmTree, check_target
from m3patch.patching.series import Series
from m3patch.patching.tree_state import (
    Contents,
    Loaded,
    Pinned,
    StatusReport,
    VerifyReport,
    classify_all,
    current_hashes,
    load_patches,
    pinned,
    read_files,
    tree_status,
    verify_tree,
)

if TYPE_CHECKING:
    from m3patch.patching import engine, writer

__all__ = ["ApplyReport", "StatusReport", "VerifyReport", "apply_series", "read_ledger",
           "revert_series", "tree_status", "verify_tree"]


@dataclass(frozen=True)
class ApplyReport:
    series_id: str
    mode: str
    dry_run: bool
    applied: tuple[str, ...]  # patch ids this run wrote
    already: tuple[str, ...]  # patch ids that were in place before
    files_written: tuple[str, ...]  # every path this run wrote or deleted
    offsets: tuple[str, ...]  # offset mode: one line per hunk that moved
    notes: tuple[str, ...]  # journal recovery, version policy, ledger repairs
    deleted: tuple[str, ...] = ()  # the paths of files_written that were deleted
    # the already-applied path read and hashed these; verify_tree(contents=...) reuses them
    contents: Contents | None = field(default=None, repr=False, compare=False)

    def summary(self) -> str:
        if self.mode == "revert":
            verb = "would revert" if self.dry_run else "reverted"
            return f"m3patch: {len(self.applied)} {verb}, {len(self.already)} not applied, 0 conflicts"
        verb = "would apply" if self.dry_run else "applied"
        return (f"m3patch: {len(self.applied)} {verb}, {len(self.already)} already applied, "
                "0 conflicts")


def _version_note(tree: VllmTree, series: Series, mode: str) -> str:
    try:
        return check_target(tree, series.target_version, series.target_commit)
    except VersionMismatch as exc:
        if mode != "offset":
            raise
        return f"offset mode: {exc.message}"


def _selected(loaded: Loaded, only: Iterable[str] | None) -> tuple[engine.Chain, ...]:
    if not only:
        return loaded.chains
    wanted = set(only)
    unknown = wanted - {p.id for p in loaded.series.patches}
    if unknown:
        msg = f"--only {sorted(unknown)[0]}: no such patch in series {loaded.series.id}"
        raise UsageError(msg, hint=f"m3patch series show --series {loaded.series.directory}")
    chosen = []
    for chain in loaded.chains:
        ids = {s.patch_id for s in chain.steps}
        if ids & wanted and not ids <= wanted:
            msg = f"--only: {chain.path} is also changed by {sorted(ids - wanted)}; select those too"
            raise UsageError(msg, hint="add every patch that touches the same file to --only")
        if ids & wanted:
            chosen.append(chain)
    return tuple(chosen)


def _plan(loaded: Loaded, chains: Iterable[engine.Chain],
          statuses: dict[str, engine.FileStatus], mode: str) -> list[engine.FilePlan]:
    from m3patch.patching import engine

    plans, conflicts = [], []
    for chain in chains:
        status = statuses[chain.path]
        if status.stage == len(chain.steps):
            continue
        if status.stage is not None:
            plans.append(engine.post_image(chain, status.stage, loaded.contents[chain.path]))
        elif mode == "offset":
            plans.append(engine.offset_image(chain, loaded.contents[chain.path]))
        else:
            conflicts.extend(engine.diagnosis(status))
    if conflicts:
        msg = "refusing to patch files that match no pinned image:\n" + "\n".join(conflicts)
        version = loaded.series.target_version
        raise PatchConflict(msg, hint="m3patch status; restore with `pip install --force-reinstall "
                            f"--no-deps vllm=={version}`, or port the patch (apply --offset)")
    return plans


def _ledger_for(loaded: Loaded, tree: VllmTree, mode: str, note: str,
                plans: list[engine.FilePlan], made: Mapping[str, tuple[str, ...]]) -> Ledger:
    planned = {p.path: p for p in plans}
    old_dirs = {f.path: f.dirs for f in loaded.ledger.files} if loaded.ledger else {}
    files = []
    for chain in loaded.chains:
        plan = planned.get(chain.path)
        if plan is not None:
            files.append(LedgerFile(chain.path, plan.pre, plan.post, made.get(chain.path, ())))
        elif loaded.statuses[chain.path].stage == len(chain.steps):
            files.append(LedgerFile(chain.path, chain.hashes[0], chain.hashes[-1],
                                    old_dirs.get(chain.path, ())))
    done = {f.path for f in files}
    patches = tuple(p.id for p in loaded.series.patches
                    if all(c.path in done for c in loaded.chains
                           if any(s.patch_id == p.id for s in c.steps)))
    return new_ledger(series=loaded.series.id, mode=mode, vllm_version=tree.version,
                      vllm_commit=tree.commit, version_note=note, patches=patches,
                      files=tuple(files))


def _record(led: Ledger) -> tuple[object, ...]:
    return led.series, led.mode, led.patches, led.vllm_version, {f.path: (f.pre, f.post) for f in led.files}


def _same(a: Ledger | None, b: Ledger) -> bool:
    return a is not None and _record(a) == _record(b)


def _missing_dirs(tree: VllmTree, plans: list[engine.FilePlan]) -> dict[str, tuple[str, ...]]:
    """Per new file, the folders this apply must create for it (shallowest first); a folder
    needed by two new files is named once, so exactly the created folders are recorded."""
    made: dict[str, tuple[str, ...]] = {}
    claimed: set[str] = set()
    for plan in plans:
        if plan.pre is not None or plan.post is None:
            continue
        parents = list(PurePosixPath(plan.path).parents)[:-2]  # stop above vllm/
        missing = [str(d) for d in reversed(parents) if not (tree.root / d).exists()]
        made[plan.path] = tuple(d for d in missing if d not in claimed)
        claimed.update(missing)
    return made


def _already_applied(tree: VllmTree, pins: Pinned, dry_run: bool,
                     notes: list[str]) -> ApplyReport | None:
    """The common case, decided without the lock or any patch parsed: no journal, every file at
    its final pinned hash, and a ledger that records exactly that. Anything else: None."""
    series = pins.series
    try:  # a journal, or a temp file of a killed run: the locked path recovers and cleans up
        if not {p.name for p in state_dir(tree.root).iterdir()} <= {"ledger.json", "lock"}:
            return None
    except OSError:
        return None
    contents = read_files(tree, list(pins.hashes))
    currents = current_hashes(contents)
    if any(currents[p] != h[-1] for p, h in pins.hashes.items()):
        return None
    try:
        ledger = read_ledger(tree.root)
    except TreeIOError:
        return None
    ids = tuple(p.id for p in series.patches)
    want = (series.id, "strict", ids, tree.version, {p: (h[0], h[-1]) for p, h in pins.hashes.items()})
    if ledger is None or _record(ledger) != want or journal_path(tree.root).exists():
        return None  # the journal again: a transaction that began while we read
    return ApplyReport(series.id, "strict", dry_run, (), ids, (), (), tuple(notes),
                       contents=contents)


def apply_series(tree: VllmTree, series: Series, *, dry_run: bool = False,
                 only: Iterable[str] | None = None, mode: str = "strict") -> ApplyReport:
    """Apply the whole series (or `only` some patches) as one transaction; idempotent."""
    if mode not in ("strict", "offset"):
        msg = f"unknown mode {mode!r}"
        raise UsageError(msg, hint="use mode='strict' or mode='offset'")
    note = _version_note(tree, series, mode)
    pins = pinned(series)
    notes = [] if note == f"{tree.version} accepted" else [note]
    if not only and mode == "strict":
        done = _already_applied(tree, pins, dry_run, notes)
        if done is not None:
            return done
    from m3patch.patching import (
        engine,
        writer,  # here: the already-applied path needs neither
    )

    patches = load_patches(series, pins.raw)
    with writer.tree_lock(tree.root):
        recovered = None if dry_run else writer.recover(tree.root)
        notes += [recovered] if recovered else []
        loaded = classify_all(tree, series, patches)
        chains = _selected(loaded, only)
        plans = _plan(loaded, chains, dict(loaded.statuses), mode)
        made = _missing_dirs(tree, plans)
        ledger = _ledger_for(loaded, tree, mode, note, plans, made)
        wanted = {s.patch_id for c in chains for s in c.steps}
        pending = {s.patch_id for p in plans for c in chains if c.path == p.path for s in c.steps}
        if not dry_run and (plans or not _same(loaded.ledger, ledger)):
            if not plans:
                notes.append("files already patched; the ledger was missing or stale: rewritten")
            by_path = {c.path: c for c in chains}
            changes = [writer.Change(p.path, p.pre, p.post, p.data,
                                  engine.new_file_mode(by_path[p.path], "add") if p.pre is None else None,
                                  made.get(p.path, ())) for p in plans]
            for change in changes:
                safe_target(tree.root, change.path)
            writer.commit(tree.root, changes, ledger.to_bytes())
    offsets = tuple(f"{p.path}: {pid} hunk {h.index} applied at line {h.line} (offset {h.offset:+d})"
                    for p in plans for pid, h in p.offsets if h.offset)
    order = [p.id for p in series.patches if p.id in wanted]
    return ApplyReport(series.id, mode, dry_run, tuple(i for i in order if i in pending),
                       tuple(i for i in order if i not in pending),
                       tuple(p.path for p in plans), offsets, tuple(notes),
                       tuple(p.path for p in plans if p.post is None))


def revert_plans(loaded: Loaded) -> list[engine.FilePlan]:
    from m3patch.patching import engine

    plans, conflicts = engine.revert_plans(loaded.chains, loaded.statuses, loaded.contents,
                                           loaded.ledger)
    if conflicts:
        msg = "cannot revert files that match no pinned image:\n" + "\n".join(conflicts)
        raise PatchConflict(msg, hint="reinstall vLLM: `pip install --force-reinstall --no-deps "
                            f"vllm=={loaded.series.target_version}`")
    return plans


def _revert_change(loaded: Loaded, plan: engine.FilePlan) -> writer.Change:
    """A file the revert deletes takes the folders the apply made for it (from the ledger)."""
    from m3patch.patching import engine, writer

    chain = next(c for c in loaded.chains if c.path == plan.path)
    recorded = {f.path: f.dirs for f in loaded.ledger.files} if loaded.ledger else {}
    drop = tuple(check_rel_path(d, "ledger.json dirs") for d in recorded.get(plan.path, ()))
    return writer.Change(plan.path, plan.pre, plan.post, plan.data,
                      engine.new_file_mode(chain, "delete") if plan.pre is None else None,
                      drop_dirs=drop if plan.post is None else ())


def revert_series(tree: VllmTree, series: Series, *, dry_run: bool = False) -> ApplyReport:
    """Restore every file to its exact pinned pre-image (verified), then remove the ledger."""
    from m3patch.patching import writer

    patches = load_patches(series)
    with writer.tree_lock(tree.root):
        notes = [n for n in [None if dry_run else writer.recover(tree.root)] if n]
        loaded = classify_all(tree, series, patches)
        plans = revert_plans(loaded)
        if not dry_run and (plans or loaded.ledger is not None):
            changes = [_revert_change(loaded, p) for p in plans]
            for change in changes:
                safe_target(tree.root, change.path)
            writer.commit(tree.root, changes, None)
            _check_written(tree, plans)
    reverted = {s.patch_id for p in plans for c in loaded.chains if c.path == p.path
                for s in c.steps}
    order = [p.id for p in series.patches]
    return ApplyReport(series.id, "revert", dry_run, tuple(i for i in order if i in reverted),
                       tuple(i for i in order if i not in reverted),
                       tuple(p.path for p in plans), (), tuple(notes),
                       tuple(p.path for p in plans if p.post is None))


def _check_written(tree: VllmTree, plans: list[engine.FilePlan]) -> None:
    """Re-read what the transaction wrote: a revert promises the exact pinned pre-images."""
    for plan in plans:
        got = file_digest(tree.root / plan.path)
        if got != plan.post:
            msg = f"{plan.path}: sha256 {got} after the write, expected {plan.post}"
            raise VerifyFailed(msg, hint="m3patch status; the disk or another writer interfered")


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
    """
    report = apply_series(tree, series)
    verify = verify_tree(tree, series, contents=report.contents)
    verify.raise_for_failure()
    try:
        ledger_bytes = ledger_path(tree.root).read_bytes()
    except OSError as exc:
        msg = f"{ledger_path(tree.root)}: cannot read the ledger apply just wrote ({exc.strerror})"
        raise TreeIOError(msg, hint="m3patch status; then m3patch apply --verify") from None
    return EnsuredTree(tree, series, report, verify, ledger_bytes)
