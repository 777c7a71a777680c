"""Hostile variants of every state file m3patch reads back, run through the CLI entry in-process.

Targets (each a file m3patch wrote earlier and reads again): the tree's ledger, journal, lock and
state folder; a series' lock; a run folder's aggregate.json, per-cell files and eval/eval.json.
Each input starts from the real file (written by a real apply on the real 0.33.0 tree, or a
recorded real run) and becomes one hostile variant: path traversal, a symlink (to a file or a
folder outside, dangling, to a FIFO, to /dev/zero), a folder, a FIFO, empty, huge, not UTF-8,
nested 5,000 deep, wrong types, NaN/Infinity, or a well-formed lie (another pin's hashes, other
files' paths, a pass that never happened). The oracle, for every input:
  1. the CLI contract (fuzz_harness.judge): a documented exit code, never 70, no traceback, an
     answer within the time limit;
  2. nothing outside what m3patch owns is written or deleted: a sentinel folder that every link
     points into is byte-for-byte unchanged, and a read-only command leaves the tree unchanged;
  3. no exit 0 the files contradict: `verify` and `apply --verify` exit 0 only when every pinned
     file holds its final post-image; `bench compare` exits 0 only with a change figure.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import random
import re
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fuzz_harness as fz

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from m3patch.patching import memo  # noqa: E402
from m3patch.patching.pristine import copy_tree, pristine_tree  # noqa: E402

SERIES = REPO / "tests" / "data" / "test-series"
RUNS = REPO / "tests" / "data" / "bench" / "runs"
HUGE = 3 << 20


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def snapshot(folder: Path) -> dict[str, str]:
    """Every entry under `folder` (links not followed): path -> content hash / link / kind."""
    out: dict[str, str] = {}
    if not folder.exists():
        return out
    for path in sorted(folder.rglob("*")):
        rel = str(path.relative_to(folder))
        if path.is_symlink():
            out[rel] = "link:" + os.readlink(path)
        elif path.is_file():
            out[rel] = _digest(path.read_bytes())
        else:
            out[rel] = "dir" if path.is_dir() else "other"
    return out


# ---------------------------------------------------------------- hostile variants


def _deep(rng: random.Random) -> str:
    depth = rng.choice((2000, 5000))
    return ("[" * depth + "]" * depth) if rng.random() < 0.5 else ('{"a":' * depth + "1" + "}" * depth)


def _lie_value(rng: random.Random, lies: list[Any]) -> Any:
    return rng.choice(lies) if lies and rng.random() < 0.5 else fz._random_value(rng)


def _mutate_doc(rng: random.Random, doc: Any, lies: list[Any]) -> Any:
    """Structural edits, or one node replaced by a value that is true elsewhere (a lie)."""
    doc = json.loads(json.dumps(doc))
    for _ in range(rng.randint(1, 3)):
        spots = [p for p, _ in fz._nodes(doc) if p]
        if not spots:
            break
        path = rng.choice(spots)
        parent = doc
        for part in path[:-1]:
            parent = parent[part]
        if rng.random() < 0.6:
            parent[path[-1]] = _lie_value(rng, lies)
        else:
            fz._mutate_tree(rng, doc)
    return doc


def _text(doc: Any) -> str:
    return json.dumps(doc, allow_nan=True)  # NaN and Infinity as text: hostile on purpose


def variant(rng: random.Random, path: Path, real: bytes, outside: Path,
            lies: list[Any]) -> str:
    """Replace `path` with one hostile variant of `real` (its last good bytes); the label."""
    _remove(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    kind = rng.choices(["doc", "bytes", "link", "special", "lie-nan"], [5, 2, 2, 1, 1])[0]
    if kind == "link":
        target = rng.choice([outside / "victim.json", outside, outside / "absent.json",
                             outside / "fifo", Path("/dev/zero"), outside / ".bashrc.tmp42"])
        path.symlink_to(target)
        return f"link -> {target.name or target}"
    if kind == "special":
        choice = rng.randrange(3)
        if choice == 0:
            path.mkdir()
            return "a folder"
        if choice == 1:
            os.mkfifo(path)
            return "a FIFO"
        path.write_bytes(b" " * HUGE + real)
        return "huge"
    if kind == "bytes":
        choice = rng.randrange(5)
        data = [b"", real[: rng.randrange(max(1, len(real)))], real.replace(b"e", b"\xff", 3),
                _deep(rng).encode(), real + b"\x00garbage"][choice]
        path.write_bytes(data)
        return ["empty", "torn", "not UTF-8", "deep", "trailing garbage"][choice]
    try:
        doc = json.loads(real)
    except ValueError:
        doc = {}
    if kind == "lie-nan":
        doc = _mutate_doc(rng, doc, [float("nan"), float("inf"), -1e308])
    else:
        doc = _mutate_doc(rng, doc, lies)
    path.write_text(_text(doc))
    return "structural/lie"


# ---------------------------------------------------------------- targets


@dataclass
class Target:
    name: str
    run: Callable[[random.Random, Path], tuple[list[str], str]]  # -> (argv, label)
    read_only: Callable[[list[str]], bool]
    check_zero: Callable[[list[str]], str | None]  # why an exit 0 is contradicted, or None
    # a reader with no command of its own: called inside the CLI's error handler instead
    call: Callable[[], object] | None = None


@dataclass
class Box:
    """One sandbox per fuzz: a private copy of the real tree, a series, a run and a sentinel."""

    root: Path
    series: Path
    run: Path
    outside: Path
    pristine: dict[str, bytes | None] = field(default_factory=dict)
    applied: dict[str, bytes | None] = field(default_factory=dict)
    states: dict[str, bytes] = field(default_factory=dict)
    finals: dict[str, str | None] = field(default_factory=dict)


def _pins(series: Path) -> dict[str, str | None]:
    lock = json.loads((series / "series.lock.json").read_text())
    finals: dict[str, str | None] = {}
    for patch in lock["patches"]:
        for pin in patch["files"]:
            finals[pin["path"]] = pin["post"]
    return finals


def _read_tree(root: Path, paths: list[str]) -> dict[str, bytes | None]:
    return {p: (root / p).read_bytes() if (root / p).exists() else None for p in paths}


def _remove(path: Path) -> None:
    """Whatever stands at `path` (a folder, a link, a FIFO, a file) goes, never followed."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


def _put(path: Path, data: bytes) -> None:
    """Reset a file the last input may have made a link, FIFO or folder: never through it."""
    _remove(path)
    path.write_bytes(data)


def _restore(root: Path, files: dict[str, bytes | None]) -> None:
    for rel, data in files.items():
        path = root / rel
        _remove(path)
        if data is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def make_box(base: Path) -> Box:
    from m3patch.main import main

    outside = base / "outside"
    outside.mkdir(parents=True)
    (outside / "victim.json").write_text('{"keep": true}\n')
    (outside / ".bashrc.tmp42").write_text("keep me\n")
    os.mkfifo(outside / "fifo")
    root = copy_tree(pristine_tree("0.33.0"), base / "site-packages")
    series = Path(shutil.copytree(SERIES, base / "series"))
    run = Path(shutil.copytree(RUNS / "base", base / "run"))
    box = Box(root, series, run, outside)
    box.finals = _pins(series)
    box.pristine = _read_tree(root, list(box.finals))
    with contextlib.redirect_stdout(None), contextlib.redirect_stderr(None):  # type: ignore[type-var]
        assert main(["apply", "--vllm-root", str(root), "--series", str(series)]) == 0
    box.applied = _read_tree(root, list(box.finals))
    state = root / "vllm" / ".m3patch"
    box.states = {"ledger.json": (state / "ledger.json").read_bytes(),
                  "series.lock.json": (series / "series.lock.json").read_bytes(),
                  "aggregate.json": _with_evals((run / "aggregate.json").read_bytes()),
                  # written before aggregates kept the scores: compare reads eval/eval.json
                  "aggregate-without-evals": (run / "aggregate.json").read_bytes()}
    box.states["journal.json"] = json.dumps({"phase": "commit", "ledger": box.states[
        "ledger.json"].decode(), "entries": [
        {"path": p, "pre": _digest(box.pristine[p]) if box.pristine[p] is not None else None,
         "post": h, "stage": f".{Path(p).name}.m3patch-new" if h else None,
         "backup": f".{Path(p).name}.m3patch-pre" if box.pristine[p] is not None else None}
        for p, h in box.finals.items()]}).encode()
    cells = sorted((run / "cells").glob("*.json"))
    box.states["cell"] = cells[0].read_bytes()
    box.states["eval.json"] = json.dumps({"schema": 1, "passed": True, "provenance": {
        "verified": True}, "tasks": [{"task": "t", "metric": "acc", "score": 0.9, "samples": 10,
                                      "passed": True}]}).encode()
    return box


def _with_evals(aggregate: bytes) -> bytes:
    """The recorded aggregate as a gated run writes it: the eval's scores beside the rows."""
    data = json.loads(aggregate)
    data["evals"] = [{"task": "t", "metric": "acc,none", "score_name": "accuracy", "score": 0.9,
                      "score_se": 0.01, "n_eff": 10, "min": 0.5, "baseline": 0.91,
                      "max_drop": 0.05, "drop": 0.01, "passed": True}]
    return json.dumps(data).encode()


def _lies(box: Box) -> list[Any]:
    hashes = [h for h in box.finals.values() if h] + [
        _digest(d) for d in box.pristine.values() if d is not None]
    return [*hashes, *box.finals, "vllm/envs.py", "vllm/.envs.py.m3patch-new", "offset", "strict",
            "stage", "commit", "../../outside/victim.json", str(box.outside), True, False,
            "0.32.0", "m3patch serve"]


def _tree_state(box: Box, rng: random.Random) -> None:
    """Start each input from a pristine or an applied tree, its state folder reset."""
    _remove(box.root / "vllm" / ".m3patch")
    state = box.root / "vllm" / ".m3patch"
    if rng.random() < 0.5:
        _restore(box.root, box.pristine)
    else:
        _restore(box.root, box.applied)
        state.mkdir()
        (state / "ledger.json").write_bytes(box.states["ledger.json"])


def tree_target(box: Box, name: str) -> Target:
    tree = ["--vllm-root", str(box.root), "--series", str(box.series)]

    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        _tree_state(box, rng)
        _put(box.series / "series.lock.json", box.states["series.lock.json"])
        state = box.root / "vllm" / ".m3patch"
        if name == "state-folder":
            _remove(state)
            label = variant(rng, state, b"", box.outside, [])
        elif name == "series.lock.json":
            label = variant(rng, box.series / name, box.states[name], box.outside, _lies(box))
        else:
            state.mkdir(exist_ok=True)
            real = box.states.get(name, b"")
            label = variant(rng, state / name, real, box.outside, _lies(box))
        command = rng.choice([["status"], ["verify"], ["apply", "--verify"], ["apply"],
                              ["revert"], ["status", "--json"]])
        return [*command, *tree], label

    def contradicted(argv: list[str]) -> str | None:
        if argv[0] == "verify" or argv[:2] == ["apply", "--verify"]:
            now = _read_tree(box.root, list(box.finals))
            bad = [p for p, h in box.finals.items()
                   if (None if now[p] is None else _digest(now[p])) != h]
            if bad:
                return f"exit 0 with {bad[0]} off its final pin"
        return None

    return Target(name, run, lambda argv: argv[0] in ("status", "verify"), contradicted)


def run_target(box: Box, name: str) -> Target:
    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        for sub in ("aggregate.json", "eval"):
            _remove(box.run / sub)
        _put(box.run / "aggregate.json",
             box.states["aggregate.json" if name == "aggregate.json" else "aggregate-without-evals"])
        (box.run / "eval").mkdir()
        (box.run / "eval" / "eval.json").write_bytes(box.states["eval.json"])
        where = box.run / "eval" / "eval.json" if name == "eval.json" else box.run / name
        label = variant(rng, where, box.states[name], box.outside, [0, -1, "tput_per_gpu", 1e308])
        return ["bench", "compare", str(RUNS / "base"), str(box.run),
                *rng.choice([[], ["--json"], ["--metric", "median_ttft"]])], label

    def contradicted(argv: list[str]) -> str | None:
        return None  # an exit 0 here needs a change figure: checked by the compare tests

    return Target(name, run, lambda argv: True, contradicted)


TREE_FILES = ("ledger.json", "journal.json", "lock", "state-folder", "series.lock.json")
RUN_FILES = ("aggregate.json", "eval.json")


def targets(box: Box) -> list[Target]:
    return [*(tree_target(box, n) for n in TREE_FILES), *(run_target(box, n) for n in RUN_FILES)]


@dataclass
class Tally:
    tried: int = 0
    by_code: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)
    misses: int = 0  # a reader whose doubt is a miss (a cache): calls that returned nothing


def fuzz(base: Path, inputs: int, seed: int) -> dict[str, Tally]:
    """`inputs` hostile inputs in all, spread over every target; a tally per target."""
    box = make_box(base)
    crash = base / "crash"
    crash.mkdir()
    return run_inputs(box, targets(box), crash, inputs, random.Random(seed))


def run_inputs(box: Box, all_targets: list[Target], crash: Path, inputs: int,
               rng: random.Random) -> dict[str, Tally]:
    """The fuzz loop: one input per target in turn, each judged by the three-part oracle."""
    from state_fuzz_more import run_call  # the in-process runner of command-less readers

    tallies = {t.name: Tally() for t in all_targets}
    sentinel = snapshot(box.outside)
    for index in range(inputs):
        target = all_targets[index % len(all_targets)]
        argv, label = target.run(rng, box.root.parent)
        before = _tree_view(box) if target.read_only(argv) else None
        memo._STATE["read_only"] = False  # as in a fresh process: set per command by main
        if target.call is None:
            outcome = fz.run_cli(argv, crash)
        else:
            outcome, value = run_call(target.call, crash)
            tallies[target.name].misses += outcome.code == 0 and not value
        tally = tallies[target.name]
        tally.tried += 1
        tally.by_code[outcome.code] = tally.by_code.get(outcome.code, 0) + 1
        why = fz.judge(outcome, crash)
        if why is None and snapshot(box.outside) != sentinel:
            why = "wrote or deleted outside what m3patch owns"
        if why is None and before is not None and _tree_view(box) != before:
            why = "a read-only command changed the tree"
        if why is None and outcome.code == 0:
            why = target.check_zero(argv)
        if why is not None:
            tally.failures.append(f"{target.name} [{label}] {' '.join(argv[:2])}: {why}: "
                                  f"{outcome.stderr.strip()[-300:]}")
            for leftover in crash.iterdir():  # the traceback's last frames go with the failure
                frames = re.sub(r"(.)\1{40,}", r"\1...", leftover.read_text(errors="replace"))
                tally.failures[-1] += "\n" + frames[-1500:]
                leftover.unlink()
            _heal(box, sentinel)
            sentinel = snapshot(box.outside)
    return tallies


def _tree_view(box: Box) -> tuple[object, ...]:
    """What a read-only command could change: the pinned files, the state folder, the listing
    of vllm/'s top level (hashing all 3,000 files per input would dominate the run)."""
    files = {p: None if not (box.root / p).is_file() else _digest((box.root / p).read_bytes())
             for p in box.finals}
    state = box.root / "vllm" / ".m3patch"
    inside = snapshot(state) if state.is_dir() and not state.is_symlink() else {}
    listing = sorted(p.name for p in (box.root / "vllm").iterdir())
    return files, inside, listing


def _heal(box: Box, sentinel: dict[str, str]) -> None:
    """After a failure, put the sentinel back so one finding does not mark every later input."""
    (box.outside / "victim.json").write_text('{"keep": true}\n')
    (box.outside / ".bashrc.tmp42").write_text("keep me\n")
    for path in box.outside.iterdir():
        if path.name not in {"victim.json", ".bashrc.tmp42", "fifo"}:
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
            else:
                path.unlink()
