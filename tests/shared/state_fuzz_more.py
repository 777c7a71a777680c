"""Hostile variants of the rest of what m3patch reads back: the per-cell result files a resumed
run keeps, the user's recipe, the multi-node rendezvous records, and every cache (the parsed
patch memo, the compile memo, the marker-lint source cache, the tune cache, vLLM's parser
answers). Same variants and the same three-part oracle as state_fuzz.py:
  1. a documented exit code, never 70, no traceback, an answer within the time limit;
  2. the sentinel folder every link points into is unchanged (nothing written or deleted
     outside what m3patch owns);
  3. no "all clear" the files contradict: a resumed run that passes keeps only cells that say
     they are what the run needs; a set that counts every node ready only has records that say
     so; a cache answer that wins is one the file really holds.
Files without a command of their own (rendezvous records, the tune and parser caches) run
through the calls their readers make, inside the CLI's own error handler. ci.json is written
and never read back by m3patch, so it has no target here.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import signal
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import fuzz_harness as fz
import state_fuzz as sf

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "tests"))

from core_helpers import gate_recorded_run  # noqa: E402

from m3patch.errors_handler import handle_errors  # noqa: E402


@contextlib.contextmanager
def env(**values: str) -> Iterator[None]:
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in old.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def run_call(call: Callable[[], object], crash: Path) -> tuple[fz.Outcome, object]:
    """`call()` inside the CLI's error handler (what a command around it would exit with), with
    the harness's time limit; the outcome and what the call returned (None on a failure)."""
    err = io.StringIO()
    old = signal.signal(signal.SIGALRM, fz._on_alarm)
    signal.alarm(fz.TIME_LIMIT_S)
    start = time.monotonic()
    os.environ["M3PATCH_CRASH_DIR"] = str(crash)
    value: object = None
    try:
        with contextlib.redirect_stderr(err), handle_errors() as outcome:
            value = call()
        code = outcome.code
    except fz._Timeout:
        code = -1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return fz.Outcome(code, err.getvalue(), time.monotonic() - start), value


def recorded_recipe(folder: Path) -> Path:
    """The recipe of the recorded real run (tests/data/bench/runs/base), on this interpreter
    (no vLLM) and a model folder that is not there: a run that must measure stops at 19."""
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)
    text = text.replace("task-dir: evals/", f"task-dir: {REPO}/recipes/evals/")
    series = Path(shutil.copytree(REPO / "patches" / "vllm-0.32.0", folder / "vllm-0.32.0"))
    text = text.replace("series: vllm-0.32.0", f"series: {series}")
    text = text.replace("${M3PATCH_TINY_MODEL:-~/.cache/m3patch/tiny-moe}", str(folder / "no-model"))
    text = text.replace("${M3PATCH_CPU_VENV:-~/.cache/m3patch/vllm-cpu-venv}/bin/python",
                        sys.executable)
    path = folder / "cpu_tiny_moe.yaml"
    path.write_text(text)
    return path


@dataclass
class World:
    """The state the new targets share: a gated recorded run, its recipe, a cache folder."""

    box: sf.Box
    recipe: Path
    recipe_bytes: bytes
    run: Path
    run_files: dict[str, bytes]
    cache: Path
    crash: Path


def make_world(base: Path, box: sf.Box) -> World:
    folder = base / "resume"
    folder.mkdir()
    recipe = recorded_recipe(folder)
    run = Path(shutil.copytree(sf.RUNS / "base", folder / "run"))
    gate_recorded_run(run, recipe, eval_passed=True)
    files = {str(p.relative_to(run)): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    cache = base / "cache"
    cache.mkdir()
    crash = base / "crash-more"
    crash.mkdir()
    return World(box, recipe, recipe.read_bytes(), run, files, cache, crash)


def _reset_run(world: World) -> None:
    sf._put(world.recipe, world.recipe_bytes)
    sf._remove(world.run)
    for rel, data in world.run_files.items():
        (world.run / rel).parent.mkdir(parents=True, exist_ok=True)
        (world.run / rel).write_bytes(data)


def _json_file(path: Path) -> Any:
    """The JSON a plain file holds, or None (a link, a FIFO, a folder, not JSON)."""
    if path.is_symlink() or not path.is_file():
        return None
    try:
        return json.loads(path.read_bytes(), parse_constant=lambda c: None)
    except (ValueError, RecursionError):
        return None


# ---------------------------------------------------------------- a resumed run's cell files


def cell_target(world: World) -> sf.Target:
    cells = sorted((world.run / "cells").glob("*.json"))
    names = [c.name for c in cells]
    recipe_sha = hashlib.sha256(world.recipe_bytes).hexdigest()
    lies = [False, "external http://127.0.0.1:1", "0" * 64, recipe_sha, *[n[:-5] for n in names],
            0, -1, float("nan"), "m3patch serve", True]

    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        _reset_run(world)
        name = rng.choice(names)
        label = sf.variant(rng, world.run / "cells" / name, world.run_files[f"cells/{name}"],
                           world.box.outside, lies)
        # ci renders the plots (about 1 s): one input in five
        command = ["ci"] if rng.random() < 0.2 else ["bench", "--no-plots"]
        return [command[0], str(world.recipe), "--resume", "--run-dir", str(world.run),
                *command[1:]], f"{name}: {label}"

    def contradicted(argv: list[str]) -> str | None:
        for name in names:
            doc = _json_file(world.run / "cells" / name)
            meta = doc.get("m3patch") if isinstance(doc, dict) else None
            cell = meta.get("cell") if isinstance(meta, dict) else None
            prov = meta.get("provenance") if isinstance(meta, dict) else None
            if not isinstance(cell, dict) or cell.get("cell_id") != name[:-5]:
                return f"exit 0 over cells/{name}, which is no result of cell {name[:-5]}"
            if argv[0] == "ci" and not (isinstance(prov, dict) and prov.get("verified") is True
                                        and prov.get("recipe_sha256") == recipe_sha):
                return f"ci exit 0 over cells/{name}, not measured on a gated server of this recipe"
        return None

    return sf.Target("cell (--resume)", run, lambda argv: False, contradicted)


# ---------------------------------------------------------------- the user's recipe


def _yaml_variant(rng: random.Random, path: Path, real: bytes, outside: Path) -> str:
    """A recipe variant: the state variants (links, FIFO, huge, deep, NaN, a structural lie of
    the parsed document, written as JSON, which is YAML), or YAML's own: an alias bomb, a
    deeply nested flow sequence, a tag."""
    import yaml

    if rng.random() < 0.25:
        sf._remove(path)
        choice = rng.randrange(4)
        text = real.decode()
        if choice == 0:  # billion laughs: aliases that expand without end
            bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
                f"{c}: &{c} [*{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}, *{p}]\n"
                for p, c in zip("abcdefgh", "bcdefghi", strict=True))
            path.write_text(text + bomb)
            return "alias bomb"
        if choice == 1:
            path.write_text(text + "deep: " + "[" * 5000 + "]" * 5000 + "\n")
            return "deep flow"
        if choice == 2:
            path.write_text(text.replace("model:", "model: !!python/name:os.system\nmodel2:", 1))
            return "python tag"
        path.write_text(re.sub(r"(ready-s|port|max-num-seqs): [0-9.]+",
                               lambda m: f"{m.group(1)}: {rng.choice(['.nan', '.inf', '-.inf'])}",
                               text))
        return "NaN values"
    doc = yaml.safe_load(real)
    return sf.variant(rng, path, json.dumps(doc).encode(), outside,
                      [float("nan"), -1, 0, "../../outside", "/dev/zero", [], {}, "x" * 10000])


def recipe_target(world: World) -> sf.Target:
    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        label = _yaml_variant(rng, world.recipe, world.recipe_bytes, world.box.outside)
        command = rng.choice([["recipe", "validate"], ["serve", "--dry-run"], ["recipe", "show"]])
        if command[0] == "serve":
            return ["serve", str(world.recipe), "--dry-run", "--allow-other-vllm"], label
        return [*command, str(world.recipe)], label

    def contradicted(argv: list[str]) -> str | None:
        path = world.recipe
        if not path.is_file() or path.resolve().is_relative_to(world.box.outside):
            return "exit 0 with no plain recipe file in place"
        return None

    def finish() -> None:
        sf._put(world.recipe, world.recipe_bytes)

    return sf.Target("recipe", _then(run, finish), lambda argv: True, contradicted)


def _then(run: Callable[[random.Random, Path], tuple[list[str], str]],
          before: Callable[[], None]) -> Callable[[random.Random, Path], tuple[list[str], str]]:
    def wrapped(rng: random.Random, base: Path) -> tuple[list[str], str]:
        before()
        return run(rng, base)

    return wrapped


def spec_target(world: World) -> sf.Target:
    """The series' shipped launch spec (vllm-cli.json, pinned by the lock), read by the recipe
    check and the dry run."""
    path = world.recipe.parent / "vllm-0.32.0" / "vllm-cli.json"
    real = path.read_bytes()

    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        label = sf.variant(rng, path, real, world.box.outside, ["0.33.0", "0.32.0", [], {}, None])
        if rng.random() < 0.5:
            return ["recipe", "validate", str(world.recipe)], label
        return ["serve", str(world.recipe), "--dry-run", "--allow-other-vllm"], label

    def contradicted(_: list[str]) -> str | None:
        if path.is_symlink() or not path.is_file() or path.read_bytes() != real:
            return "exit 0 with the launch spec not the bytes the lock pins"
        return None

    def reset() -> None:
        _reset_run(world)
        sf._put(path, real)

    return sf.Target("series launch spec", _then(run, reset), lambda argv: True, contradicted)


# ---------------------------------------------------------------- caches the tree commands read


def cache_target(world: World, name: str) -> sf.Target:
    """The parsed-patch memo (one patch's entry), the compile memo or the image memo (the
    series' post-images), through status / verify / apply (--verify) / revert on the real tree
    with M3PATCH_CACHE at the world's cache folder."""
    from m3patch.patching import compile_memo, image_memo, parse_cache
    from m3patch.patching.ledger import digest
    from m3patch.patching.series import load_series

    box = world.box
    tree = ["--vllm-root", str(box.root), "--series", str(box.series)]
    with env(M3PATCH_CACHE=str(world.cache)):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            from m3patch.main import main
            from m3patch.patching import memo

            memo._STATE["read_only"] = False  # an earlier read-only command in this process
            main(["revert", *tree])
            main(["apply", "--verify", *tree])
        patch = sorted(box.series.glob("*.patch"))[0]
        path = (parse_cache._path(digest(patch.read_bytes())) if name == "parsed memo"
                else compile_memo.memo_path() if name == "compile memo"
                else image_memo._path(image_memo.pack_key(load_series(box.series).require_lock())))
    real = path.read_bytes()
    zero = sf.tree_target(box, "ledger.json").check_zero
    hashes = [h for h in box.finals.values() if h]

    def run(rng: random.Random, _: Path) -> tuple[list[str], str]:
        sf._tree_state(box, rng)
        for folder in ("parsed", "compiled", "images"):  # the others too: labels stay true
            _restore_folder(world.cache / folder)
        if rng.random() < 0.2:  # the cache's folder itself: a link (outside), a file, a FIFO
            sf._remove(path.parent)
            if rng.random() < 0.5:
                path.parent.symlink_to(box.outside)
                label = "folder: link -> outside"
            else:
                label = "folder: " + sf.variant(rng, path.parent, b"", box.outside, [])
        elif name == "image memo" and rng.random() < 0.6:
            label = _pack_variant(rng, path, real, hashes)
        else:
            label = sf.variant(rng, path, real, box.outside, [*hashes, "x" * 64, 2, 1])
        command = rng.choice([["status"], ["verify"], ["apply", "--verify"], ["apply"],
                              ["revert"]])
        return [*command, *tree], label

    def _restore_folder(folder: Path) -> None:
        if folder.is_symlink() or (folder.exists() and not folder.is_dir()):
            sf._remove(folder)
        folder.mkdir(parents=True, exist_ok=True)

    return sf.Target(name, run, lambda argv: argv[0] in ("status", "verify"), zero)


def _pack_variant(rng: random.Random, path: Path, real: bytes, hashes: list[str]) -> str:
    """An image pack that keeps its shape but lies: images swapped, bytes changed at the same
    length, lengths shifted, a header entry naming another pin, or the header's JSON mutated."""
    magic, header_line, rest = real.split(b"\n", 2)
    header = json.loads(header_line)
    images = header["images"]
    choice = rng.randrange(5)
    if choice == 0 and len(images) > 1:  # two images' hashes swapped
        i, j = rng.sample(range(len(images)), 2)
        images[i][0], images[j][0] = images[j][0], images[i][0]
    elif choice == 1 and rest:  # one byte changed, every length still right
        at = rng.randrange(len(rest))
        rest = rest[:at] + bytes([rest[at] ^ 0x20]) + rest[at + 1:]
    elif choice == 2:  # a length moved from one image to the next
        i, delta = rng.randrange(len(images)), rng.choice([-1, 1])
        images[i][1] += delta
        images[(i + 1) % len(images)][1] -= delta
    elif choice == 3:  # an entry claims another pin's hash
        rng.choice(images)[0] = rng.choice(hashes)
    else:
        header = sf._mutate_doc(rng, header, [*hashes, "x" * 64, -1, 2**40, None, True])
    sf._remove(path)
    path.write_bytes(magic + b"\n" + json.dumps(header).encode() + b"\n" + rest)
    return ["swapped", "flipped byte", "shifted length", "claims another pin", "header"][choice]


# ---------------------------------------------------------------- readers without a command


def rendezvous_target(world: World) -> sf.Target:
    """RUN/nodes/<set-id>/<role>-<rank>.json as the head reads them: this set's records, the
    comparison with its own tree, and the check that no other live set holds the folder."""
    from m3patch.cluster import rendezvous as rv
    from m3patch.recipe.topology import NodeId

    run = world.cache.parent / "mn-run"
    set_id = "set-1"
    nodes = (NodeId("head", 0), NodeId("worker", 0))
    now = time.time()
    good = {n: {"schema": rv.SCHEMA, "set_id": set_id, "role": n.role, "rank": n.rank,
                "host": f"h{n.rank}", "pid": 100 + n.rank, "pgid": 100 + n.rank,
                "series": "s", "ledger_sha256": "a" * 64, "tree_sha256": "b" * 64,
                "verified": True, "state": "ready", "exit_code": None, "reason": "",
                "heartbeat": now, "fingerprint": {"vllm_version": "0.33.0"}} for n in nodes}
    lies = [True, False, "exited", "ready", "starting", 0, 1, "set-2", "c" * 64, None, now + 1e9,
            float("nan"), "worker", "head", -1]

    answer: dict[str, object] = {}

    def call() -> object:
        answer.clear()
        rv.require_free(run, set_id, now=now)
        records = rv.read_records(run, set_id, nodes)
        answer["waiting"] = rv.compare(nodes, records, "s", "b" * 64, "m3patch serve R",
                                       {"vllm_version": "0.33.0"})
        return answer["waiting"]

    def run_input(rng: random.Random, _: Path) -> tuple[list[str], str]:
        sf._remove(run)
        for node, doc in good.items():
            folder = rv.nodes_dir(run, set_id)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / rv.record_path(run, set_id, node).name).write_text(json.dumps(doc))
        node = rng.choice(nodes)
        where = rv.record_path(run, set_id, node)
        if rng.random() < 0.2:  # a record of another set in the same run folder
            where = rv.record_path(run, "set-0", node)
            where.parent.mkdir(parents=True, exist_ok=True)
        label = sf.variant(rng, where, json.dumps(good[node]).encode(), world.box.outside, lies)
        return ["<rendezvous>", str(where.relative_to(run))], label

    def contradicted(_: list[str]) -> str | None:
        if answer.get("waiting") != []:
            return None  # still waiting for a node: no verdict yet
        for node in nodes:
            doc = _json_file(rv.record_path(run, set_id, node))
            if not isinstance(doc, dict):
                return f"every node counted ready though {node}'s record is not one"
            want = {"verified": True, "tree_sha256": "b" * 64, "set_id": set_id, "series": "s",
                    "role": node.role, "rank": node.rank}
            wrong = {k: doc.get(k) for k, v in want.items() if doc.get(k) != v}
            if doc.get("state") == "exited":
                wrong["state"] = "exited"
            if wrong:
                return f"every node counted ready though {node}'s record says {wrong}"
        return None

    return sf.Target("rendezvous record", run_input, lambda argv: False, contradicted,
                     call=call)


def tune_cache_target(world: World) -> sf.Target:
    """The tuner's result cache (JSON lines) as a tune job reads it back: a line that could win
    the pick unfairly (NaN, negative, zero time) must never come back."""
    from m3patch.tune.cache import Result, ResultCache

    path = world.cache / "tune" / "results.jsonl"
    path.parent.mkdir(parents=True)
    good = [{"shape": "s", "batch": b, "config": f"c{b}", "stage": "quick", "us": 10.0 + b,
             "error": None, "note": ""} for b in (1, 2, 4)]
    real = "".join(json.dumps(line) + "\n" for line in good).encode()
    box = {"value": None}

    def call() -> object:
        cache = ResultCache(path)
        box["value"] = cache
        cache.add(Result("s", 8, "c8", "quick", 5.0, None, ""))  # and a write through it
        return {k: v for k, v in cache.results.items() if v.batch != 8}  # what was read back

    def run_input(rng: random.Random, _: Path) -> tuple[list[str], str]:
        box["value"] = None
        if rng.random() < 0.5:
            return ["<tune cache>"], sf.variant(rng, path, real, world.box.outside,
                                                [float("nan"), -1.0, 0, 1e-300, True, "best"])
        sf._remove(path)
        lines = [dict(line) for line in good]
        lines[rng.randrange(3)]["us"] = rng.choice([float("nan"), -1.0, 0, float("inf"), "3",
                                                     -0.0, None, [1]])
        path.write_text("".join(json.dumps(line) + "\n" for line in lines))
        return ["<tune cache>"], "a lying time"

    def contradicted(_: list[str]) -> str | None:
        cache = box["value"]
        for result in getattr(cache, "results", {}).values():
            if result.stage != "failed" and not (isinstance(result.us, float | int)
                                                 and math.isfinite(result.us) and result.us > 0):
                return f"a cached time {result.us!r} came back trusted"
        return None

    return sf.Target("tune cache", run_input, lambda argv: False, contradicted, call=call)


def marker_cache_target(world: World) -> sf.Target:
    """The marker-lint source cache, read back for a tree (the whole-tree entry): any doubt is
    a miss, never a hang, a crash or a cache of another key."""
    from m3patch.marker_lint import cache as marker_cache

    folder = world.cache / "marker-sources"
    folder.mkdir()
    key = "k-fuzz"
    real = json.dumps({"schema": marker_cache.CACHE_SCHEMA, "key": key, "root": "/r",
                       "digests": {"vllm/a.py": "d"},
                       "files": {"vllm/a.py": [["vllm/a.py", 3, ["Using ", None], True, None]]}}
                      ).encode()
    path = folder / f"{key}.json"

    def run_input(rng: random.Random, _: Path) -> tuple[list[str], str]:
        return ["<marker cache>"], sf.variant(rng, path, real, world.box.outside,
                                              ["k-other", "vllm/b.py", 3, None, [], "x"])

    def call() -> object:
        return marker_cache._read_cache(path, key)

    return sf.Target("marker-lint cache", run_input, lambda argv: False, lambda argv: None,
                     call=call)


def parser_cache_target(world: World) -> sf.Target:
    """vLLM's parser answers cached per interpreter and version (vllm-cli/<hash>.json), and one
    launch's cached verdict (vllm-cli/verdicts/<hash>.json, trusted only while the tree files
    it names hash as recorded)."""
    from m3patch.patching.locate import tree_at
    from m3patch.serving import vllm_parser

    tree = tree_at(world.box.root)
    with env(M3PATCH_CACHE=str(world.cache)):
        options = vllm_parser.cache_path(sys.executable, "0.33.0")
        verdict = vllm_parser._verdict_path(sys.executable, tree, ["--port", "1"], {})
    for path in (options, verdict):
        path.parent.mkdir(parents=True, exist_ok=True)
    real = {options: json.dumps({"vllm_version": "0.33.0", "actions": []}).encode(),
            verdict: json.dumps({"files": {"envs.py": hashlib.sha256(
                (tree.package_dir / "envs.py").read_bytes()).hexdigest()}, "dump": {
                "vllm_version": "0.33.0", "actions": []}}).encode()}
    chosen: dict[str, Any] = {}

    def run_input(rng: random.Random, _: Path) -> tuple[list[str], str]:
        chosen["path"] = path = rng.choice((options, verdict))
        label = sf.variant(rng, path, real[path], world.box.outside,
                           ["0.32.0", "0.33.0", [], {}, None, "--port", "../../x", "/etc/passwd"])
        return ["<parser cache>", path.parent.name], label

    def call() -> object:
        with env(M3PATCH_CACHE=str(world.cache)):
            if chosen["path"] == options:
                return vllm_parser.cached_actions(sys.executable, "0.33.0")
            chosen["trusted"] = vllm_parser._cached_verdict(verdict, tree)
            return chosen["trusted"]

    def contradicted(_: list[str]) -> str | None:
        """A verdict trusted only when the file holds it and every tree file it names hashes
        as recorded."""
        if chosen["path"] != verdict or chosen.pop("trusted", None) is None:
            return None
        doc = _json_file(verdict)
        files = doc.get("files") if isinstance(doc, dict) else None
        if not isinstance(files, dict) or not files:
            return "a verdict trusted that names no tree files"
        for rel, want in files.items():
            path = tree.package_dir / str(rel)
            if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != want:
                return f"a verdict trusted though {rel} is not as recorded"
        return None

    return sf.Target("vllm-cli parser cache", run_input, lambda argv: False, contradicted,
                     call=call)


# ---------------------------------------------------------------- the loop


def targets(world: World) -> list[sf.Target]:
    return [cell_target(world), recipe_target(world), spec_target(world),
            cache_target(world, "parsed memo"),
            cache_target(world, "compile memo"), cache_target(world, "image memo"),
            rendezvous_target(world),
            tune_cache_target(world), marker_cache_target(world), parser_cache_target(world)]


def fuzz(base: Path, inputs: int, seed: int) -> dict[str, sf.Tally]:
    """`inputs` hostile inputs in all, spread over every new target; a tally per target."""
    box = sf.make_box(base)
    world = make_world(base, box)
    with env(M3PATCH_CACHE=str(world.cache), M3PATCH_VLLM_ROOT=str(box.root)):
        return sf.run_inputs(box, targets(world), world.crash, inputs, random.Random(seed))
