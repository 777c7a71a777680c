"""Verify: every file equals its pinned post-image, every patched .py compiles, every .json parses.

Read-only: an interrupted transaction is reported as a problem, never recovered here.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from m3patch.errors import VerifyFailed
from m3patch.patching import compile_memo, compile_pool
from m3patch.patching.ledger import digest
from m3patch.patching.locate import VllmTree, compile_with, interpreter_of
from m3patch.patching.series import Series
from m3patch.patching.series_lock import load_patches, pinned
from m3patch.patching.snapshot import (
    PENDING_TRANSACTION,
    Contents,
    check_series_target,
    current_hashes,
    ledger_notes,
    ledger_or_note,
    ledger_view,
    read_and_classify,
    read_files,
    transaction_pending,
    unpinned_message,
    unpinned_patched,
)
from m3patch.patching.states import Mode, state_name


@dataclass(frozen=True)
class VerifyReport:
    series_id: str
    checked: tuple[str, ...]
    problems: tuple[str, ...]
    notes: tuple[str, ...] = field(default=())
    compiler: str = ""  # which interpreter compiled the patched .py files, and why that one
    # per file off its pinned post-image: path, state, sha256 and per-hunk fields (for --json)
    files: tuple[dict[str, Any], ...] = ()
    fix: str = "m3patch apply (or m3patch status for details)"

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def problem_count(self) -> int:
        """Problems, not lines: a file's hunk diagnosis lines (indented) belong to its line."""
        return sum(1 for line in self.problems if not line.startswith(" "))

    def to_json(self) -> dict[str, Any]:
        return {"checked": list(self.checked), "problem_count": self.problem_count,
                "problems": [line.strip() for line in self.problems], "files": list(self.files),
                "notes": list(self.notes), "compiler": self.compiler}

    def raise_for_failure(self) -> None:
        if self.problems:
            from m3patch.patching import engine  # deferred: the already-applied path never fails

            headline = f"{self.problem_count} problem(s) in the patched tree"
            msg = engine.summarize(self.problems, headline)
            raise VerifyFailed(msg, hint=self.fix)


def _memoized(sources: Mapping[str, bytes], hashes: Mapping[str, str | None], key: str | None,
              compile_all: Callable[[dict[str, bytes]], dict[str, str]]) -> dict[str, str]:
    """`compile_all` of the sources the interpreter `key` (None: this one) is not known to
    compile (compile_memo, by sha256); its successes are remembered where writes are allowed.
    `hashes`: the sha256 of each source as verify just computed it (else hashed here)."""
    good = compile_memo.known_good(key)
    keys = {path: hashes.get(path) or digest(data) for path, data in sources.items()}
    todo = {path: data for path, data in sources.items() if keys[path] not in good}
    errors = compile_all(todo) if todo else {}
    compile_memo.remember(good, [keys[p] for p in todo if p not in errors], key)
    return errors


def _compile_here(sources: dict[str, bytes]) -> dict[str, str]:
    """Compile each source with this interpreter, spread over the CPUs (compile_pool)."""
    items = list(sources.items())
    verdicts = compile_pool.compile_all(items)
    return {path: error for (path, _), error in zip(items, verdicts, strict=True)
            if error is not None}


def content_problems(python: str | None, contents: Contents,
                     hashes: Mapping[str, str | None]) -> tuple[str, list[str]]:
    """Compile every .py with the tree's interpreter (in memory: no .pyc is written) and parse
    every .json; `hashes`: the contents' sha256 (current_hashes). Returns (which interpreter
    compiled, problems)."""
    sources = {p: d for p, d in contents.items() if d is not None and p.endswith(".py")}
    here = f"{sys.executable} (Python {sys.version.split()[0]})"
    if python is None:
        who = f"{here}: m3patch's own; no interpreter known for this tree (pass --python)"
        errors = _memoized(sources, hashes, None, _compile_here)
    elif os.path.realpath(python) == os.path.realpath(sys.executable):
        who = f"{here}: the tree's interpreter"
        errors = _memoized(sources, hashes, None, _compile_here)
    else:
        version, key = interpreter_of(python)
        errors = _memoized(sources, hashes, key, lambda todo: compile_with(python, todo)[1])
        who = f"{python} (Python {version}): the tree's interpreter"
    problems = [f"{p}: does not compile with {who.split(':')[0]}: {e}" for p, e in errors.items()]
    for path, data in contents.items():
        if data is not None and path.endswith(".json"):
            try:
                json.loads(data)
            except (ValueError, RecursionError) as exc:  # nested too deep for Python's reader
                problems.append(f"{path}: does not parse: {exc}")
    return who, problems


def verify_tree(tree: VllmTree, series: Series, *, contents: Contents | None = None) -> VerifyReport:
    """Every file equals its pinned post-image (or the ledger's, after an offset apply), every
    patched .py compiles, every .json parses. `contents`: the files as just read and hashed by
    this process (apply's already-applied path), so they are not read twice."""
    pins = pinned(series)
    target = check_series_target(tree, series, pins.hashes, Mode.STRICT)
    problems = [PENDING_TRANSACTION] if transaction_pending(tree.root) else []
    data = contents if contents is not None else read_files(tree, list(pins.hashes))
    currents = current_hashes(data)
    ledger, note = ledger_or_note(tree)
    offset = {f.path: f.post for f in ledger.files} if (
        ledger is not None and ledger.mode == Mode.OFFSET) else {}
    # the files win: an offset post-image that equals an earlier pin (a pristine file, say) is
    # that pin, never "applied at offsets", whatever the ledger records
    off = [p for p, h in pins.hashes.items() if currents[p] != h[-1] and (
        p not in offset or currents[p] != offset[p] or currents[p] in h)]
    files = []
    if off:  # only now parse the patches: the diagnosis needs per-hunk probes
        from m3patch.patching import engine  # deferred: the already-applied path never needs it

        view = ledger_view(read_and_classify(tree, series, load_patches(series, pins.raw), data))
        for path in off:
            status = view[path]
            problems.extend(engine.diagnosis(status) if status.stage is None else
                            [f"{path}: {status.state}, not the pinned post-image"])
            files.append({"path": path, "state": state_name(status.state),
                          "sha256": status.current,
                          "hunks": [h.fields(pid) for pid, h in status.hunks],
                          "differs_at": status.differs_at})
    stray = unpinned_patched(tree, ledger, series.id, pins.hashes)
    fix = VerifyReport.fix
    if stray:  # apply refuses such a tree: the way back is the other series' revert
        problem, fix = unpinned_message(tree, series, stray)
        problems.append(problem)
    who, bad = content_problems(tree.python, {p: data[p] for p in pins.hashes if p not in off},
                                currents)
    notes = [] if target.plain else [target.note]
    notes += ledger_notes(series.id, pins.hashes, currents, ledger, note)
    return VerifyReport(series_id=series.id, checked=tuple(pins.hashes),
                        problems=(*problems, *bad), notes=tuple(notes), compiler=who,
                        files=tuple(files), fix=fix)
