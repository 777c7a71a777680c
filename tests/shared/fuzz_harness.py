"""Fuzz m3patch's loaders through the CLI entry and publish how many inputs ended cleanly.

    python scripts/measure/fuzz_loaders.py [--per-loader 2000] [--seed 0] [--out docs/results/reliability]

Each loader (series manifest, series lock, recipe, changelog, unified diff, bench aggregate,
vLLM bench result file) starts from a real, valid input of this repository and is mutated
(byte edits, hostile tokens, and structural edits of the parsed YAML/JSON). Every mutated input
is run through `m3patch.main.main([...])` in-process; the oracle is the CLI contract: an exit
code documented in m3patch/errors.py (never 70, the internal-error code), an `m3patch:` message,
no traceback, no crash log, and an answer within a time limit. The vLLM bench result file has no
CLI reader of its own (a sweep reads it after the client exits), so it runs through the same
calls the sweep makes, inside the CLI's own error handler.

tests/shared/test_shared_fuzz_loaders.py runs a few hundred inputs per loader with this module; this script
runs more and writes the table to <out>/fuzz_loaders.json.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import shutil
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from m3patch.errors import ALL_ERRORS  # noqa: E402
from m3patch.errors_handler import handle_errors  # noqa: E402
from m3patch.main import main  # noqa: E402

DOCUMENTED = {0, *(e.exit_code for e in ALL_ERRORS)}
TEST_SERIES = REPO / "tests" / "data" / "test-series"
BENCH_DATA = REPO / "tests" / "data" / "bench" / "vllm"
TIME_LIMIT_S = 10
HOSTILE_TOKENS = (
    "\x00", "\t", "\r\n", "\ufeff", "\u202e", "\u2028", "\x0c", "'", '"', "\\", "%", "{", "}",
    "[", "]", ": ", "- ", "&a ", "*a", "!!python/object/apply:os.system ['true']", "!!binary AA",
    "? ", "|", ">", "~", "null", "-1", "0", "1e999", ".nan", "NaN", "Infinity", "true", "0x10",
    "0o777", "2e-400", "../", "/etc/passwd", "a/../../x", "${HOME}", "${NOPE_M3PATCH}",
    "regex:(a+)+$", "@@ -1,1 +1,1 @@\n", "--- /dev/null\n", "+++ b/vllm/x.py\n", "\\ No newline",
    "x" * 5000, "9" * 400, "é", "\udcff",
)
DIFF_TOKENS = ("@@ -0,0 +1 @@\n", "@@ -1 +1 @@\n", "@@ -99999,3 +99999,3 @@\n", "-", "+", " ",
               "diff --git a/vllm/x b/vllm/x\n", "new file mode 120000\n", "GIT binary patch\n",
               "deleted file mode 100644\n", "rename from vllm/a\n", "old mode 100644\n",
               "--- a/vllm/../../etc/passwd\n", "+++ b//etc/passwd\n", "--- a/vllm//logger.py\n")


@dataclass
class Tally:
    tried: int = 0
    by_code: dict[int, int] = field(default_factory=dict)
    failures: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Outcome:
    code: int
    stderr: str
    seconds: float


class _Timeout(Exception):
    pass


def _on_alarm(signum: int, frame: object) -> None:
    raise _Timeout


def run_cli(argv: list[str], crash_dir: Path) -> Outcome:
    """main(argv) in-process with stdout/stderr captured and a wall-clock limit."""
    err, out = io.StringIO(), io.StringIO()
    old = signal.signal(signal.SIGALRM, _on_alarm)
    signal.alarm(TIME_LIMIT_S)
    start = time.monotonic()
    os.environ["M3PATCH_CRASH_DIR"] = str(crash_dir)
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            try:
                code = main(argv)
            except SystemExit as exc:  # argparse usage errors
                code = exc.code if isinstance(exc.code, int) else 2
    except _Timeout:
        code = -1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    return Outcome(code, err.getvalue(), time.monotonic() - start)


def judge(outcome: Outcome, crash_dir: Path) -> str | None:
    """None when the outcome keeps the CLI contract, else why not."""
    if outcome.code == -1:
        return f"no answer within {TIME_LIMIT_S} s"
    if outcome.code not in DOCUMENTED:
        return f"exit {outcome.code} is not a documented exit code"
    if "Traceback" in outcome.stderr:
        return "traceback on stderr"
    if any(crash_dir.iterdir()):
        return "crash log written"
    if outcome.code != 0 and not any(line.startswith(("m3patch", "usage:"))
                                     for line in outcome.stderr.splitlines()):
        return "failure without an m3patch message"
    return None


# ---------------------------------------------------------------- mutators


def _mutate_text(rng: random.Random, text: str, tokens: tuple[str, ...]) -> str:
    for _ in range(rng.randint(1, 4)):
        pos = rng.randint(0, len(text))
        kind = rng.randrange(6)
        if kind == 0:
            text = text[:pos] + rng.choice(tokens) + text[pos:]
        elif kind == 1:
            text = text[:pos] + text[pos + rng.randint(1, 40):]
        elif kind == 2:
            end = min(len(text), pos + rng.randint(1, 80))
            text = text[:end] + text[pos:end] + text[end:]
        elif kind == 3:
            lines = text.split("\n")
            i, j = rng.randrange(len(lines)), rng.randrange(len(lines))
            lines[i], lines[j] = lines[j], lines[i]
            text = "\n".join(lines)
        elif kind == 4:
            text = text[:pos]
        elif text:
            i = rng.randrange(len(text))
            text = text[:i] + chr(rng.choice((0x20, 0x2D, 0x3A, 0x7B, 0xA0, 0x7F, ord(text[i]) ^ 1)))\
                + text[i + 1:]
    return text


def _random_value(rng: random.Random) -> Any:
    return rng.choice([None, True, False, 0, -1, 2**70, 1.5, float("nan"), "", "x", "..",
                       "/etc/passwd", "../../../outside", "a" * 3000, [], [None], {}, {"k": 1},
                       ["a", 1], {"": None}, "regex:(", "0.33.0", "vllm/x.py"])


def _nodes(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], Any]]:
    yield path, tree
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _nodes(value, (*path, key))
    elif isinstance(tree, list):
        for index, value in enumerate(tree):
            yield from _nodes(value, (*path, index))


def _mutate_tree(rng: random.Random, tree: Any) -> Any:
    """Structural edit of parsed YAML/JSON: replace, drop, add or rename one node."""
    spots = list(_nodes(tree))
    path, node = rng.choice(spots)
    if not path:
        return _random_value(rng) if rng.random() < 0.1 else tree
    parent = tree
    for part in path[:-1]:
        parent = parent[part]
    key = path[-1]
    kind = rng.randrange(4)
    if kind == 0:
        parent[key] = _random_value(rng)
    elif kind == 1:
        del parent[key]
    elif kind == 2 and isinstance(node, dict):
        node[rng.choice(["extra", "Schema", "idd", "markerz", "", "id"])] = _random_value(rng)
    elif kind == 3 and isinstance(parent, dict):
        parent[str(key)[::-1] or "?"] = parent.pop(key)
    else:
        parent[key] = [node, node] if rng.random() < 0.5 else {"nested": node}
    return tree


def mutate_yaml(rng: random.Random, seed: str) -> str:
    if rng.random() < 0.5:
        return _mutate_text(rng, seed, HOSTILE_TOKENS)
    tree = yaml.safe_load(seed)
    for _ in range(rng.randint(1, 3)):
        tree = _mutate_tree(rng, tree)
    return yaml.safe_dump(tree, sort_keys=False, allow_unicode=rng.random() < 0.5)


def mutate_json(rng: random.Random, seed: str) -> str:
    if rng.random() < 0.4:
        return _mutate_text(rng, seed, HOSTILE_TOKENS)
    tree = json.loads(seed)
    for _ in range(rng.randint(1, 3)):
        tree = _mutate_tree(rng, tree)
    return json.dumps(tree)


def mutate_diff(rng: random.Random, seed: str) -> str:
    return _mutate_text(rng, seed, DIFF_TOKENS + HOSTILE_TOKENS)


# ---------------------------------------------------------------- loaders


@dataclass(frozen=True)
class Loader:
    name: str
    seed_text: Callable[[Path], str]
    mutate: Callable[[random.Random, str], str]
    run: Callable[[Path, str, Path], Outcome]  # (workdir, mutated text, crash dir)


def _series_copy(work: Path) -> Path:
    target = work / "series"
    if target.exists():
        shutil.rmtree(target)
    shutil.copytree(TEST_SERIES, target)
    return target


def _write(path: Path, text: str) -> None:
    path.write_bytes(text.encode("utf-8", "surrogateescape"))


def _run_manifest(work: Path, text: str, crash: Path) -> Outcome:
    series = _series_copy(work)
    _write(series / "series.yaml", text)
    return run_cli(["series", "show", "--series", str(series)], crash)


def _run_lock(work: Path, text: str, crash: Path) -> Outcome:
    series = _series_copy(work)
    _write(series / "series.lock.json", text)
    return run_cli(["series", "show", "--series", str(series)], crash)


def _pristine() -> Path:
    from m3patch.patching.pristine import pristine_tree

    return pristine_tree("0.33.0")


def _run_diff(work: Path, text: str, crash: Path) -> Outcome:
    # `series lock --tree` parses the patch and applies it exactly, in memory, to the real tree
    series = _series_copy(work)
    (series / "series.lock.json").unlink()
    _write(series / "0002-logger-marks.patch", text)
    return run_cli(["series", "lock", "--series", str(series), "--tree", str(_pristine())], crash)


def _recipe_seed(work: Path) -> str:
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    return yaml.safe_dump(data, sort_keys=False)


def _run_recipe(work: Path, text: str, crash: Path) -> Outcome:
    path = work / "recipe.yaml"
    _write(path, text)
    # the marker lint reads a whole vLLM tree: its own tests cover it, not the 10 s fuzz budget
    return run_cli(["recipe", "validate", "--no-lint-markers", str(path)], crash)


def _run_changelog(work: Path, text: str, crash: Path) -> Outcome:
    # outside git, references (config-keys -> recipes, series) resolve next to the file
    for name in ("recipes", "patches"):
        if not (work / name).exists():
            (work / name).symlink_to(REPO / name)
    path = work / "perf-changelog.yaml"
    _write(path, text)
    return run_cli(["changelog", "check", "--file", str(path)], crash)


def _cell() -> Any:
    from m3patch.bench.cells import Cell
    from m3patch.bench.spec import recipe_cells
    from m3patch.recipe.loader import load_recipe

    recipe = load_recipe(REPO / "recipes" / "cpu_tiny_moe.yaml")
    cells: tuple[Cell, ...] = recipe_cells(recipe)
    return cells[0]


def _aggregate_seed(work: Path) -> str:
    from m3patch.bench import results as res
    from m3patch.bench.aggregate import AGGREGATE_JSON, write_aggregate

    run = work / "seed-run"
    (run / "cells").mkdir(parents=True, exist_ok=True)
    cell = _cell()
    data = json.loads((BENCH_DATA / "isl32-osl16-c1.json").read_text())
    doc = res.cell_document(data, cell, {"series": "vllm-0.32.0"}, 1.0)
    res.write_result(run / "cells" / f"{cell.cell_id}.json", doc)
    write_aggregate(run, {"recipe_name": "cpu_tiny_moe"}, [cell.cell_id])
    return (run / AGGREGATE_JSON).read_text()


def _run_aggregate(work: Path, text: str, crash: Path) -> Outcome:
    path = work / "aggregate.json"
    _write(path, text)
    return run_cli(["bench", "compare", str(path), str(path), "--json", str(work / "cmp.json")],
                   crash)


def _run_result(work: Path, text: str, crash: Path) -> Outcome:
    """What a sweep does with the file `vllm bench serve --save-result` wrote, in the CLI's
    error handler (there is no command that reads only this file)."""
    from m3patch.bench import results as res
    from m3patch.bench.aggregate import write_aggregate

    raw = work / "raw.json"
    _write(raw, text)
    run = work / "run"
    shutil.rmtree(run, ignore_errors=True)
    (run / "cells").mkdir(parents=True)
    os.environ["M3PATCH_CRASH_DIR"] = str(crash)
    err = io.StringIO()
    start = time.monotonic()
    with contextlib.redirect_stderr(err), handle_errors() as outcome:
        cell = _cell()
        data = res.read_json_object(raw)
        res.check_vllm_result(data, raw)
        res.cell_failures(data, cell)
        doc = res.cell_document(data, cell, {"series": "s"}, 1.0)
        res.write_result(run / "cells" / f"{cell.cell_id}.json", doc)
        write_aggregate(run, {"recipe_name": "fuzz"}, [cell.cell_id])
    return Outcome(outcome.code, err.getvalue(), time.monotonic() - start)


LOADERS = (
    Loader("series manifest", lambda w: (TEST_SERIES / "series.yaml").read_text(), mutate_yaml,
           _run_manifest),
    Loader("series lock", lambda w: (TEST_SERIES / "series.lock.json").read_text(), mutate_json,
           _run_lock),
    Loader("unified diff", lambda w: (TEST_SERIES / "0002-logger-marks.patch").read_text(),
           mutate_diff, _run_diff),
    Loader("recipe", _recipe_seed, mutate_yaml, _run_recipe),
    Loader("changelog", lambda w: (REPO / "perf-changelog.yaml").read_text(), mutate_yaml,
           _run_changelog),
    Loader("bench aggregate", _aggregate_seed, mutate_json, _run_aggregate),
    Loader("bench result file", lambda w: (BENCH_DATA / "isl32-osl16-c1.json").read_text(),
           mutate_json, _run_result),
)


def fuzz(loader: Loader, count: int, seed: int, keep_failures: int = 5) -> Tally:
    """Seed input first (must pass), then `count - 1` mutations; failures keep their input."""
    rng = random.Random(f"{loader.name}:{seed}")
    tally = Tally()
    with tempfile.TemporaryDirectory(prefix="m3patch-fuzz-") as tmp:
        work = Path(tmp)
        base = loader.seed_text(work)
        for index in range(count):
            text = base if index == 0 else loader.mutate(rng, base)
            crash = work / f"crash-{index}"
            crash.mkdir()
            outcome = loader.run(work, text, crash)
            tally.tried += 1
            tally.by_code[outcome.code] = tally.by_code.get(outcome.code, 0) + 1
            problem = judge(outcome, crash)
            if index == 0 and outcome.code != 0:
                problem = f"the unmutated seed fails: {outcome.stderr.strip()[:300]}"
            if problem and len(tally.failures) < keep_failures:
                last = outcome.stderr.strip().splitlines()[-1:] or [""]
                tally.failures.append(f"{problem}: {last[0][:300]} <- input {text[:400]!r}")
            elif problem:
                tally.failures.append(problem)
            shutil.rmtree(crash)
    return tally


def _print_table(rows: list[dict[str, Any]]) -> None:
    print(f"{'loader':<20} {'inputs':>7} {'contract kept':>14} {'exit codes (count)':<50}")
    for row in rows:
        codes = ", ".join(f"{c}:{n}" for c, n in sorted(row["exit_codes"].items()))
        print(f"{row['loader']:<20} {row['inputs']:>7} {row['kept']:>14} {codes:<50}")


def cli(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--per-loader", type=int, default=2000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--only", action="append", default=[], help="loader name (repeatable)")
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results" / "reliability")
    args = parser.parse_args(argv)
    rows, started = [], time.time()
    for loader in LOADERS:
        if args.only and loader.name not in args.only:
            continue
        t0 = time.monotonic()
        tally = fuzz(loader, args.per_loader, args.seed)
        rows.append({"loader": loader.name, "inputs": tally.tried,
                     "kept": tally.tried - len(tally.failures),
                     "exit_codes": {str(k): v for k, v in tally.by_code.items()},
                     "failures": tally.failures[:20], "seconds": round(time.monotonic() - t0, 1)})
    _print_table(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    body = {"command": "python scripts/measure/fuzz_loaders.py " + " ".join(argv or sys.argv[1:]),
            "seed": args.seed, "per_loader": args.per_loader,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(started)), "rows": rows}
    out = args.out / "fuzz_loaders.json"
    out.write_text(json.dumps(body, indent=2) + "\n")
    print(f"wrote {out}")
    return 0 if all(not r["failures"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(cli())
