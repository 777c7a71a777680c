"""`m3patch ci RECIPE [--run-dir DIR]`: the one CI job, with one exit code and one run folder.

Steps, in order, each a result with a status; the first failure skips the rest and its exit code
(errors.py) is the job's:
  recipe        load and validate the recipe
  apply-verify  apply the recipe's series to the tree the recipe's python imports, verify it,
                copy the ledger into the run folder (in-process: m3patch.patching.api)
  serve-sweep   `m3patch bench RECIPE --run-dir DIR` in a child process (its own signal
                handling and process group discipline): apply+verify again (idempotent), start
                vLLM, gate markers, sweep every cell, aggregate, plot
  results       every per-cell file and aggregate.json re-read and checked; plots drawn if absent
The run folder then holds what users upload: server.log, serve.json, cells/*.json,
aggregate.json/.csv, the PNG plots, ledger.json, and ci.json (this summary).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import ALL_ERRORS, INTERNAL_ERROR_EXIT, M3PatchError, ResultsInvalid
from m3patch.fsio import write_bytes_atomic, write_json_atomic
from m3patch.recipe.names import recipe_path

SUMMARY = "ci.json"
SERVE_LOG = "ci-serve.log"
PLOT_NAMES = ("throughput_per_gpu.png", "interactivity_vs_throughput.png")
StepFn = Callable[[], tuple[str, tuple[str, ...]]]  # -> (message, artifacts)


@dataclass(frozen=True)
class StepResult:
    name: str
    status: str  # ok | failed | skipped
    exit_code: int
    seconds: float
    message: str
    artifacts: tuple[str, ...] = ()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path,
                        help="recipe YAML or shipped recipe name, e.g. cpu_tiny_moe")
    parser.add_argument("--run-dir", type=Path, help="run folder (default: <results>/ci-<name>-<time>)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the valid cells already in --run-dir (m3patch bench --resume)")


def run(args: argparse.Namespace) -> int:
    from m3patch.output import info

    state: dict[str, Any] = {"run_dir": args.run_dir, "resume": args.resume}
    steps: list[tuple[str, StepFn]] = [
        ("recipe", lambda: _load_recipe(args.recipe, state)),
        ("apply-verify", lambda: _apply_verify(state)),
        ("serve-sweep", lambda: _serve_sweep(args.recipe, state)),
        ("results", lambda: check_results(state["run_dir"])),
    ]
    results: list[StepResult] = []
    failure: M3PatchError | None = None
    try:
        for name, step in steps:
            if failure is not None:
                results.append(StepResult(name, "skipped", 0, 0.0, "an earlier step failed"))
                continue
            result, failure = _run_step(name, step)
            results.append(result)
            info(f"ci: {name}: {result.status} ({result.seconds:.1f} s) {result.message}")
    finally:
        if state.get("run_dir") is not None:
            _write_summary(args.recipe, state["run_dir"], results)
    if failure is not None:
        raise failure
    info(f"ci: all steps passed; artifacts in {state['run_dir']}")
    return 0


def exit_code_of(results: list[StepResult]) -> int:
    """The reduction: the first failed step's code, else 0."""
    return next((r.exit_code for r in results if r.status == "failed"), 0)


def _run_step(name: str, step: StepFn) -> tuple[StepResult, M3PatchError | None]:
    started = time.monotonic()
    try:
        message, artifacts = step()
    except M3PatchError as exc:
        first = str(exc).splitlines()[0]
        return StepResult(name, "failed", exc.exit_code, time.monotonic() - started, first), exc
    return StepResult(name, "ok", 0, time.monotonic() - started, message, artifacts), None


def _load_recipe(path: Path, state: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    from m3patch.recipe.loader import load_recipe

    recipe = load_recipe(path)
    state["recipe"] = recipe
    if state["run_dir"] is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        state["run_dir"] = Path(recipe.results_dir) / f"ci-{recipe.name}-{stamp}"
    Path(state["run_dir"]).mkdir(parents=True, exist_ok=True)
    return f"{recipe.name} (series {recipe.series_dir})", ()


def _apply_verify(state: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    from m3patch.patching.api import ensure_series
    from m3patch.patching.locate import find_vllm
    from m3patch.patching.series import load_series

    recipe = state["recipe"]
    tree = find_vllm(python=recipe.target.python or sys.executable)
    ensured = ensure_series(tree, load_series(recipe.series_dir))
    copy = Path(state["run_dir"]) / "ledger.json"
    write_bytes_atomic(copy, ensured.ledger_bytes)
    return ensured.report.summary().removeprefix("m3patch: "), (copy.name,)


def bench_argv(recipe: Path, run_dir: Path, *, resume: bool) -> list[str]:
    extra = ["--resume"] if resume else []
    return [sys.executable, "-m", "m3patch", "bench", str(recipe), "--run-dir", str(run_dir), *extra]


def _serve_sweep(recipe: Path, state: dict[str, Any]) -> tuple[str, tuple[str, ...]]:
    run_dir = Path(state["run_dir"])
    code = _run_child(bench_argv(recipe, run_dir, resume=state["resume"]), run_dir / SERVE_LOG)
    if code != 0:
        raise _error_for(code, f"`m3patch bench` exited {code}; see {run_dir / SERVE_LOG}")
    return "server ready, markers passed, sweep done", ("server.log", "serve.json", SERVE_LOG)


def _run_child(argv: list[str], log_path: Path) -> int:
    """Run the child, teeing its output to the log; on ^C let it shut vLLM down first."""
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        assert proc.stdout is not None
        try:
            for chunk in iter(proc.stdout.readline, b""):
                log.write(chunk)
                sys.stderr.buffer.write(chunk)
                sys.stderr.flush()
            return proc.wait()
        except KeyboardInterrupt:
            # The child shares our process group and got the same SIGINT; give it its grace.
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            raise


def _error_for(code: int, message: str) -> M3PatchError:
    """Re-raise a child's failure under its own class, so the job keeps the child's exit code."""
    for cls in ALL_ERRORS:
        if cls.exit_code == code:
            return cls(message, hint=f"read the log, then rerun: {' '.join(sys.argv)}")
    error = M3PatchError(message, hint="a bug in m3patch: report it with the log")
    error.exit_code = code if code > 0 else INTERNAL_ERROR_EXIT  # signals show as negative codes
    return error


def check_results(run_dir: Path) -> tuple[str, tuple[str, ...]]:
    from m3patch.bench.aggregate import cell_files, load_aggregate
    from m3patch.bench.results import read_cell_file

    cells = cell_files(run_dir)
    if not cells:
        msg = f"{run_dir}: no per-cell result files under cells/"
        raise ResultsInvalid(msg, hint=f"m3patch ci RECIPE --resume --run-dir {run_dir}")
    for path in cells:
        read_cell_file(path)
    aggregate = load_aggregate(run_dir)
    plots = _ensure_plots(run_dir, aggregate)
    names = tuple(p.relative_to(run_dir).as_posix() for p in (*cells, *plots))
    return f"{len(cells)} cells, aggregate ok, {len(plots)} plots", (
        "aggregate.json", "aggregate.csv", *names)


def _ensure_plots(run_dir: Path, aggregate: dict[str, Any]) -> list[Path]:
    found = [p for name in PLOT_NAMES for p in sorted(run_dir.rglob(name))[:1]]
    if len(found) == len(PLOT_NAMES):
        return found
    from m3patch.bench.plots import PlotRun, draw, run_title

    return draw([PlotRun("run", run_title(aggregate), tuple(aggregate["rows"]))], run_dir)


def _write_summary(recipe: Path, run_dir: Path, results: list[StepResult]) -> None:
    data = {
        "schema": 1, "recipe": str(recipe), "run_dir": str(run_dir),
        "exit_code": exit_code_of(results), "steps": [asdict(r) for r in results],
    }
    write_json_atomic(Path(run_dir) / SUMMARY, data)
