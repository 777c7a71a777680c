"""Read-side of the API: pins from the lock, the tree's files, verify and status reports.

Files win over the ledger: every state here comes from content hashes and hunk probes; the
ledger is only compared with them to report that it is stale. `pinned` answers "which pinned
image is each file" from series.lock.json alone; patches are parsed (unidiff) only when a file
is off every pin and needs a per-hunk diagnosis, or when something must be written.
"""

from __future__ import annotations

import json
import os
import sys
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from m3patch.errors import TreeIOError, UsageError, VerifyFailed
from m3patch.patching.diffs import safe_target
from m3patch.patching.ledger import Ledger, digest, journal_path, read_ledger
from m3patch.patching.locate import VllmTree, compile_with
from m3patch.patching.series import Series

if TYPE_CHECKING:
    from m3patch.patching import engine
    from m3patch.patching.diffs import PatchFile
    from m3patch.patching.series import PatchPin

Contents = Mapping[str, bytes | None]


@dataclass(frozen=True)
class Pinned:
    series: Series
    hashes: dict[str, tuple[str | None, ...]]  # per file: pristine, then after each patch on it
    raw: dict[str, bytes]  # per patch id: the .patch bytes, read once and checked against the lock


def pinned(series: Series) -> Pinned:
    """The lock's chain of hashes per file; refuses a patch edited since `series lock`."""
    lock = series.require_lock()
    raw = {}
    for entry in series.patches:
        path = series.patch_path(entry)
        try:
            data = path.read_bytes()
        except OSError as exc:
            msg = f"{path}: cannot read: {exc.strerror}"
            raise UsageError(msg, hint="restore the patch file") from None
        if digest(data) != lock.pin(entry.id).sha256:
            msg = f"{path}: changed since series.lock.json was generated"
            raise UsageError(msg, hint=f"m3patch series lock --pristine --series {series.directory}")
        raw[entry.id] = data
    hashes: dict[str, list[str | None]] = {}
    for pin in lock.patches:
        for file in pin.files:
            hashes.setdefault(file.path, [file.pre]).append(file.post)
    return Pinned(series, {p: tuple(h) for p, h in hashes.items()}, raw)


def load_patches(series: Series, raw: Mapping[str, bytes] | None = None,
                 ) -> tuple[tuple[PatchFile, PatchPin], ...]:
    """Parse every patch of the series (bytes from `pinned`, else read and checked here)."""
    from m3patch.patching.diffs import parse_patch

    raw = pinned(series).raw if raw is None else raw
    lock = series.require_lock()
    return tuple((parse_patch(raw[e.id], str(series.patch_path(e))), lock.pin(e.id))
                 for e in series.patches)


def read_files(tree: VllmTree, paths: list[str]) -> dict[str, bytes | None]:
    out: dict[str, bytes | None] = {}
    for rel in paths:
        path = safe_target(tree.root, rel)
        try:
            out[rel] = path.read_bytes()
        except FileNotFoundError:
            out[rel] = None
        except OSError as exc:
            msg = f"{path}: cannot read: {exc.strerror}"
            raise TreeIOError(msg, hint="check permissions on the vLLM tree") from None
    return out


def current_hashes(contents: Contents) -> dict[str, str | None]:
    return {p: None if d is None else digest(d) for p, d in contents.items()}


def ledger_or_note(tree: VllmTree) -> tuple[Ledger | None, str | None]:
    try:
        return read_ledger(tree.root), None
    except TreeIOError as exc:
        return None, f"ignored: {exc.message}"


@dataclass(frozen=True)
class Loaded:
    series: Series
    chains: tuple[engine.Chain, ...]
    contents: dict[str, bytes | None]
    statuses: dict[str, engine.FileStatus]
    ledger: Ledger | None
    ledger_note: str | None = None


def classify_all(tree: VllmTree, series: Series,
                 patches: tuple[tuple[PatchFile, PatchPin], ...],
                 contents: Contents | None = None) -> Loaded:
    from m3patch.patching import engine

    chains = engine.build_chains(patches)
    data = dict(contents) if contents is not None else read_files(tree, [c.path for c in chains])
    statuses = {c.path: engine.classify(c, data[c.path]) for c in chains}
    ledger, note = ledger_or_note(tree)
    return Loaded(series, chains, data, statuses, ledger, note)


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
    stale = [f.path for f in ledger.files if f.path in currents and currents[f.path] != f.post]
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
    compiler: str = ""  # which interpreter compiled the patched .py files, and why that one

    @property
    def ok(self) -> bool:
        return not self.problems

    def raise_for_failure(self) -> None:
        if self.problems:
            msg = f"{len(self.problems)} problem(s) in the patched tree:\n" + "\n".join(self.problems)
            raise VerifyFailed(msg, hint="m3patch apply (or m3patch status for details)")


def _compile_here(sources: Mapping[str, bytes]) -> dict[str, str]:
    errors = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # SyntaxWarnings in vLLM sources are not ours
        for path, data in sources.items():
            try:
                compile(data, path, "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                errors[path] = str(exc)
    return errors


def content_problems(python: str | None, contents: Contents) -> tuple[str, list[str]]:
    """Compile every .py with the tree's interpreter (in memory: no .pyc is written) and parse
    every .json. Returns (which interpreter compiled, problems)."""
    sources = {p: d for p, d in contents.items() if d is not None and p.endswith(".py")}
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    if python is None:
        who = f"{here}: m3patch's own; no interpreter known for this tree (pass --python)"
        errors = _compile_here(sources)
    elif os.path.realpath(python) == os.path.realpath(sys.executable):
        who, errors = f"{here}: the tree's interpreter", _compile_here(sources)
    else:
        version, errors = compile_with(python, dict(sources))
        who = f"{python} (Python {version}): the tree's interpreter"
    problems = [f"{p}: does not compile with {who.split(':')[0]}: {e}" for p, e in errors.items()]
    for path, data in contents.items():
        if data is not None and path.endswith(".json"):
            try:
                json.loads(data)
            except ValueError as exc:
                problems.append(f"{path}: does not parse: {exc}")
    return who, problems


def verify_tree(tree: VllmTree, series: Series, *, contents: Contents | None = None) -> VerifyReport:
    """Every file equals its pinned post-image (or the ledger's, after an offset apply), every
    patched .py compiles, every .json parses. `contents`: the files as just read and hashed by
    this process (apply's already-applied path), so they are not read twice."""
    pins = pinned(series)
    problems = []
    if journal_path(tree.root).exists():
        problems.append("an interrupted transaction is pending: run `m3patch apply`")
    data = contents if contents is not None else read_files(tree, list(pins.hashes))
    currents = current_hashes(data)
    ledger, note = ledger_or_note(tree)
    offset = {f.path: f.post for f in ledger.files} if (
        ledger is not None and ledger.mode == "offset") else {}
    off = [p for p, h in pins.hashes.items() if currents[p] != offset.get(p, h[-1])]
    if off:  # only now parse the patches: the diagnosis needs per-hunk probes
        from m3patch.patching import engine

        loaded = classify_all(tree, series, load_patches(series, pins.raw), data)
        for path in off:
            status = loaded.statuses[path]
            problems.extend(engine.diagnosis(status) if status.stage is None else
                            [f"{path}: {status.state}, not the pinned post-image"])
    who, bad = content_problems(tree.python, {p: data[p] for p in pins.hashes if p not in off})
    notes = ledger_notes(series.id, pins.hashes, currents, ledger, note)
    return VerifyReport(series.id, tuple(pins.hashes), (*problems, *bad), tuple(notes), who)


@dataclass(frozen=True)
class StatusReport:
    series_id: str
    vllm_version: str
    patches: tuple[dict[str, Any], ...]
    files: tuple[dict[str, Any], ...]
    notes: tuple[str, ...]

    @property
    def conflicts(self) -> tuple[str, ...]:
        """Files that neither apply nor revert can take as they are (exit 5 in `status`)."""
        bad = ("partially applied", "drifted", "upstreamed")
        return tuple(f["path"] for f in self.files if f["state"] in bad)

    def to_json(self) -> dict[str, Any]:
        return {"series": self.series_id, "vllm_version": self.vllm_version,
                "patches": list(self.patches), "files": list(self.files), "notes": list(self.notes),
                "conflicts": list(self.conflicts)}


def _offset_applied(loaded: Loaded) -> dict[str, engine.FileStatus]:
    """After an offset apply, a file equal to the post-image the ledger recorded is applied."""
    ledger = loaded.ledger
    posts = {f.path: f.post for f in ledger.files} if ledger and ledger.mode == "offset" else {}
    return {c.path: replace(s, state="applied (offset)", stage=len(c.steps), hunks=())
            if s.stage is None and posts.get(c.path) == s.current else s
            for c in loaded.chains for s in [loaded.statuses[c.path]]}


def tree_status(tree: VllmTree, series: Series) -> StatusReport:
    """Per patch and file state, hunk diagnosis, and which patches upstream already carries."""
    from m3patch.patching import engine, writer

    pins = pinned(series)
    notes = []
    if journal_path(tree.root).exists():
        with writer.tree_lock(tree.root):
            recovered = writer.recover(tree.root)
        notes += [recovered] if recovered else []
    loaded = classify_all(tree, series, load_patches(series, pins.raw))
    statuses = _offset_applied(loaded)
    states = engine.patch_states(loaded.chains, statuses)
    files = tuple({"path": c.path, "state": statuses[c.path].state,
                   "patches": [s.patch_id for s in c.steps],
                   "sha256": statuses[c.path].current,
                   "diagnosis": engine.diagnosis(statuses[c.path])[1:]}
                  for c in loaded.chains)
    rows = tuple({"id": p.id, "state": states.get(p.id, "no files"), "summary": p.summary,
                  "can_drop": states.get(p.id) == engine.UPSTREAM,
                  "files": [c.path for c in loaded.chains
                            if any(s.patch_id == p.id for s in c.steps)]}
                 for p in series.patches)
    currents = {p: s.current for p, s in loaded.statuses.items()}
    notes += ledger_notes(series.id, pins.hashes, currents, loaded.ledger, loaded.ledger_note)
    return StatusReport(series.id, tree.version, rows, files, tuple(notes))
