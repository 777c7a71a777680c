"""Read-side of the API: load a series' patches, classify the tree, verify and status reports.

Files win over the ledger: every state here comes from content hashes and hunk probes; the
ledger is only compared with them to report that it is stale.
"""

from __future__ import annotations

import json
import warnings
from dataclasses import dataclass, field
from typing import Any

from m3patch import engine, txn
from m3patch.diffs import PatchFile, parse_patch, safe_target
from m3patch.errors import TreeIOError, UsageError, VerifyFailed
from m3patch.ledger import Ledger, digest, read_ledger, state_dir
from m3patch.locate import VllmTree
from m3patch.series import PatchPin, Series


@dataclass(frozen=True)
class Loaded:
    series: Series
    chains: tuple[engine.Chain, ...]
    contents: dict[str, bytes | None]
    statuses: dict[str, engine.FileStatus]
    ledger: Ledger | None
    ledger_note: str | None = None


def load_patches(series: Series) -> tuple[tuple[PatchFile, PatchPin], ...]:
    """Parse every patch of the series, refusing one edited since `series lock`."""
    lock = series.require_lock()
    out = []
    for entry in series.patches:
        path = series.patch_path(entry)
        try:
            data = path.read_bytes()
        except OSError as exc:
            msg = f"{path}: cannot read: {exc.strerror}"
            raise UsageError(msg, hint="restore the patch file") from None
        pin = lock.pin(entry.id)
        if digest(data) != pin.sha256:
            msg = f"{path}: changed since series.lock.json was generated"
            raise UsageError(msg, hint=f"m3patch series lock --pristine --series {series.directory}")
        out.append((parse_patch(data, str(path)), pin))
    return tuple(out)


def _read(tree: VllmTree, rel: str) -> bytes | None:
    path = safe_target(tree.root, rel)
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"{path}: cannot read: {exc.strerror}"
        raise TreeIOError(msg, hint="check permissions on the vLLM tree") from None


def classify_all(tree: VllmTree, series: Series,
                 patches: tuple[tuple[PatchFile, PatchPin], ...]) -> Loaded:
    chains = engine.build_chains(patches)
    contents = {c.path: _read(tree, c.path) for c in chains}
    statuses = {c.path: engine.classify(c, contents[c.path]) for c in chains}
    try:
        ledger, note = read_ledger(tree.root), None
    except TreeIOError as exc:
        ledger, note = None, f"ignored: {exc.message}"
    return Loaded(series, chains, contents, statuses, ledger, note)


def ledger_notes(loaded: Loaded) -> list[str]:
    """Where the ledger disagrees with the files (the files win)."""
    notes = [loaded.ledger_note] if loaded.ledger_note else []
    ledger = loaded.ledger
    applied = [c.path for c in loaded.chains if loaded.statuses[c.path].stage == len(c.steps)]
    if ledger is None:
        if applied:
            notes.append("no ledger, but patched files are present: `m3patch apply` records it")
        return notes
    if ledger.series != loaded.series.id:
        notes.append(f"ledger records series {ledger.series}, not {loaded.series.id}")
    recorded = {f.path: f.post for f in ledger.files}
    stale = [p for p, post in recorded.items()
             if p in loaded.statuses and loaded.statuses[p].current != post]
    if stale:
        notes.append(f"stale ledger: it records {len(stale)} patched file(s) that are not "
                     f"(e.g. {stale[0]}; vLLM reinstalled?); `m3patch apply` re-applies")
    return notes


@dataclass(frozen=True)
class VerifyReport:
    series_id: str
    checked: tuple[str, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_failure(self) -> None:
        if self.problems:
            msg = f"{len(self.problems)} problem(s) in the patched tree:\n" + "\n".join(self.problems)
            raise VerifyFailed(msg, hint="m3patch apply (or m3patch status for details)")


def _content_problem(path: str, data: bytes) -> str | None:
    """Does a patched .py compile / .json parse? In memory: no .pyc is written."""
    try:
        if path.endswith(".py"):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # SyntaxWarnings in vLLM sources are not ours
                compile(data, path, "exec", dont_inherit=True)
        elif path.endswith(".json"):
            json.loads(data)
    except (SyntaxError, ValueError) as exc:
        return f"{path}: does not {'compile' if path.endswith('.py') else 'parse'}: {exc}"
    return None


def verify_tree(tree: VllmTree, series: Series) -> VerifyReport:
    """Every file equals its pinned post-image (or the ledger's, after an offset apply)."""
    loaded = classify_all(tree, series, load_patches(series))
    problems = []
    if (state_dir(tree.root) / txn.JOURNAL).exists():
        problems.append("an interrupted transaction is pending: run `m3patch apply`")
    offset = {f.path: f.post for f in loaded.ledger.files} if (
        loaded.ledger is not None and loaded.ledger.mode == "offset") else {}
    for chain in loaded.chains:
        status = loaded.statuses[chain.path]
        expected = offset.get(chain.path, chain.hashes[-1])
        if status.current != expected:
            problems.extend(engine.diagnosis(status) if status.stage is None else
                            [f"{chain.path}: {status.state}, not the pinned post-image"])
            continue
        data = loaded.contents[chain.path]
        problem = None if data is None else _content_problem(chain.path, data)
        problems += [problem] if problem else []
    return VerifyReport(series.id, tuple(c.path for c in loaded.chains), tuple(problems),
                        tuple(ledger_notes(loaded)))


@dataclass(frozen=True)
class StatusReport:
    series_id: str
    vllm_version: str
    patches: tuple[dict[str, Any], ...]
    files: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"series": self.series_id, "vllm_version": self.vllm_version,
                "patches": list(self.patches), "files": list(self.files), "notes": list(self.notes)}


def tree_status(tree: VllmTree, series: Series) -> StatusReport:
    """Per patch and file state, hunk diagnosis, and which patches upstream already carries."""
    patches = load_patches(series)
    notes = []
    if (state_dir(tree.root) / txn.JOURNAL).exists():
        with txn.tree_lock(tree.root):
            recovered = txn.recover(tree.root)
        notes += [recovered] if recovered else []
    loaded = classify_all(tree, series, patches)
    states = engine.patch_states(loaded.chains, loaded.statuses)
    files = tuple({"path": c.path, "state": loaded.statuses[c.path].state,
                   "patches": [s.patch_id for s in c.steps],
                   "sha256": loaded.statuses[c.path].current,
                   "diagnosis": engine.diagnosis(loaded.statuses[c.path])[1:]}
                  for c in loaded.chains)
    rows = tuple({"id": p.id, "state": states.get(p.id, "no files"), "summary": p.summary,
                  "can_drop": states.get(p.id) == engine.UPSTREAM,
                  "files": [c.path for c in loaded.chains
                            if any(s.patch_id == p.id for s in c.steps)]}
                 for p in series.patches)
    return StatusReport(series.id, tree.version, rows, files, (*notes, *ledger_notes(loaded)))
