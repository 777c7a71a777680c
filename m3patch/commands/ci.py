"""`m3patch ci RECIPE [--run-dir DIR]`: the one CI job, with one exit code and one run folder.

The run pipeline (m3patch.run.pipeline), in this process, reported as four steps, each a result
with a status; the first failure skips the rest and its exit code (errors.py) is the job's:
  recipe        load and validate the recipe, make the run folder
  apply-verify  apply the recipe's series to the tree the recipe's python imports, verify it,
                copy the ledger into the run folder (m3patch.patching.api.ensure_series)
  serve-sweep   start vLLM on that tree, gate markers, sweep every cell, aggregate, stop the
                server; this step's output goes to stderr and RUN/ci-serve.log, its error included
  results       every per-cell file and aggregate.json re-read and checked; the plots drawn
The run folder then holds what users upload: server.log, serve.json, cells/*.json,
aggregate.json/.csv, the PNG plots, ledger.json, ci-serve.log and ci.json (this summary).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import signal
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, TextIO, cast

from m3patch.errors import Interrupted, M3PatchError
from m3patch.fsio import write_json_atomic

if TYPE_CHECKING:
    from m3patch.run.pipeline import RunPipeline
    from m3patch.run.steps import Step, StepDone, StepResult
from m3patch.output import info, warn
from m3patch.recipe.names import recipe_path
from m3patch.run.pipeline import PlotMode, RunCommand, RunPipeline, RunSpec
from m3patch.run.steps import StepDone, StepStatus, finish, run_steps

SUMMARY = "ci.json"
SERVE_LOG = "ci-serve.log"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path,
                        help="recipe YAML or shipped recipe name, e.g. cpu_tiny_moe")
    parser.add_argument("--run-dir", type=Path, help="run folder (default: <results>/ci-<name>-<time>)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the valid cells already in --run-dir (m3patch bench --resume)")


def run(args: argparse.Namespace) -> int:

    # CI cancelling the job must unwind like Ctrl-C, so the server's group is stopped.
    signal.signal(signal.SIGTERM, _on_sigterm)
    spec = RunSpec(args.recipe, RunCommand.CI, run_dir=args.run_dir, resume=args.resume,
                   plots=PlotMode.REQUIRED)
    with RunPipeline(spec) as pipeline:
        outcome = run_steps(ci_steps(pipeline), _print_step)
    run_dir = pipeline.plan.run_dir if pipeline.plan is not None else spec.run_dir
    if run_dir is not None:  # no run folder is known before the recipe names one
        write_summary(args.recipe, run_dir, outcome.results, outcome.exit_code,
                      warnings=pipeline.warnings)
    code = finish(outcome)
    for found in pipeline.warnings:
        warn(f"ci: warning marker {found['id']!r}: {found['first']}"
             + (f"; fix: {found['fix']}" if found.get("fix") else ""))
    info(f"ci: all steps passed; artifacts in {run_dir}")
    return code


def ci_steps(pipeline: RunPipeline) -> list[Step]:
    return [("recipe", pipeline.load), ("apply-verify", pipeline.apply_verify),
            ("serve-sweep", lambda: _serve_sweep(pipeline)), ("results", pipeline.results)]


def _serve_sweep(pipeline: RunPipeline) -> StepDone:
    with teed_output(pipeline.planned.run_dir / SERVE_LOG):
        served = pipeline.serve()
        swept = pipeline.sweep()
    if served.status is StepStatus.SKIPPED:
        return StepDone(f"{served.message}; {swept.message}", (SERVE_LOG,))
    return StepDone("server ready, markers passed, sweep done", ("server.log", "serve.json", SERVE_LOG))


def _print_step(result: StepResult) -> None:
    info(f"ci: {result.name}: {result.status.value} ({result.seconds:.1f} s) {result.message}")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    msg = f"received signal {signal.Signals(signum).name}; the job and its server were stopped"
    raise Interrupted(msg, hint="re-run with --resume to keep the finished cells")


class _Tee(io.TextIOBase):
    """Text to every target. Not a terminal, so progress prints plain lines, as in a CI log."""

    def __init__(self, *targets: TextIO) -> None:
        self.targets = targets

    def write(self, text: str) -> int:
        for target in self.targets:
            target.write(text)
        return len(text)

    def flush(self) -> None:
        for target in self.targets:
            target.flush()

    def isatty(self) -> bool:
        return False


@contextlib.contextmanager
def teed_output(log_path: Path) -> Iterator[None]:
    """The block's stdout and stderr go to stderr and into `log_path` (the job's stdout stays
    clean for what a workflow parses); the error that ends the block is written to the log too
    (the terminal gets it once, from the error handler)."""
    with open(log_path, "w", encoding="utf-8", errors="replace") as log:
        tee = cast(TextIO, _Tee(sys.stderr, log))
        try:
            with contextlib.redirect_stdout(tee), contextlib.redirect_stderr(tee):
                yield
        except M3PatchError as exc:
            log.write(f"m3patch: error: {exc}\n")
            raise


def write_summary(recipe: Path, run_dir: Path, results: Sequence[StepResult], code: int, *,
                  warnings: Sequence[dict[str, object]] = ()) -> None:
    data = {
        "schema": 1, "recipe": str(recipe), "run_dir": str(run_dir),
        "exit_code": code, "steps": [r.to_json() for r in results],
        "warnings": list(warnings),  # `warn` markers: reported, never a failure
    }
    write_json_atomic(Path(run_dir) / SUMMARY, data)
