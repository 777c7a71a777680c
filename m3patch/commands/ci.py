"""`m3patch ci RECIPE [--run-dir DIR]`: the one CI job, with one exit code and one run folder.

The run pipeline (m3patch.run.pipeline), in this process, reported as four steps, each a result
with a status; the first failure skips the rest and its exit code (errors.py) is the job's:
  recipe        load and validate the recipe, make the run folder
  apply-verify  apply the recipe's series to the tree the recipe's python (or --python) imports,
                verify it,
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
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING, Any, TextIO, cast

from m3patch.bench.runner import CI_EVAL_LOG as EVAL_LOG
from m3patch.bench.runner import CI_SERVE_LOG as SERVE_LOG
from m3patch.bench.runner import CI_SUMMARY as SUMMARY
from m3patch.commands.flags import add_python_flag
from m3patch.errors import (
    Interrupted,
    M3PatchError,
    TreeIOError,
    interrupt,
    raise_if_interrupted,
)
from m3patch.fsio import write_json_atomic

if TYPE_CHECKING:
    from m3patch.run.pipeline import RunPipeline
    from m3patch.run.steps import Step, StepDone, StepResult
from m3patch.output import info, warn
from m3patch.patching import report_json
from m3patch.recipe.evals import EvalWhen
from m3patch.recipe.names import recipe_path
from m3patch.run.pipeline import PlotMode, RunCommand, RunPipeline, RunSpec
from m3patch.run.steps import StepDone, StepStatus, finish, run_steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path,
                        help="recipe YAML or shipped recipe name, e.g. cpu_tiny_moe")
    parser.add_argument("--run-dir", type=Path, help="run folder (default: <results>/ci-<name>-<time>)")
    parser.add_argument("--resume", action="store_true",
                        help="keep the valid cells already in --run-dir (m3patch bench --resume)")
    add_python_flag(parser, what="interpreter whose vLLM tree is patched and serves (default: "
                                 "the recipe's target.python, else this one), as for serve and bench")
    parser.add_argument("--json", action="store_true",
                        help="print the job's report as one JSON object on stdout "
                             "(docs/json-schema.md; the same fields as ci.json)")


def run(args: argparse.Namespace) -> int:

    # CI cancelling the job must unwind like Ctrl-C, so the server's group is stopped.
    signal.signal(signal.SIGTERM, _on_sigterm)
    fields = report_json.start("ci") if args.json else report_json.envelope("ci")
    spec = RunSpec(args.recipe, RunCommand.CI, run_dir=args.run_dir, resume=args.resume,
                   python=args.python, plots=PlotMode.REQUIRED)
    with RunPipeline(spec) as pipeline:
        outcome = run_steps(ci_steps(pipeline), _print_step)
    run_dir = pipeline.plan.run_dir if pipeline.plan is not None else spec.run_dir
    report_json.attach_run(fields, recipe=args.recipe, run_dir=run_dir,
                           python=pipeline.plan.python if pipeline.plan is not None else None,
                           ledger_sha256=pipeline.ledger_sha256,
                           steps=[r.to_json() for r in outcome.results])
    if outcome.exit_code == 0:  # a stop a best-effort step swallowed: no summary says "passed"
        raise_if_interrupted()
    if run_dir is not None:  # no run folder is known before the recipe names one
        write_summary(args.recipe, run_dir, outcome.results, outcome.exit_code, fields,
                      warnings=pipeline.warnings)
    code = finish(outcome)
    for found in pipeline.warnings:
        warn(f"ci: warning marker {found['id']!r}: {found['first']}"
             + (f"; fix: {found['fix']}" if found.get("fix") else ""))
    info(f"ci: all steps passed; artifacts in {run_dir}")
    if args.json:
        report_json.finish(fields)
    return code


def ci_steps(pipeline: RunPipeline) -> list[Step]:
    when = pipeline.eval_when()
    steps: list[Step] = [
        ("recipe", pipeline.load), ("apply-verify", pipeline.apply_verify),
        ("serve-sweep", lambda: _serve_sweep(pipeline, when is EvalWhen.BEFORE_SWEEP)),
        ("results", pipeline.results)]
    if when is EvalWhen.AFTER_SWEEP:  # the sweep's results are kept when the gate fails
        steps.append(("eval", lambda: _eval(pipeline)))
    return steps


def _serve_sweep(pipeline: RunPipeline, eval_first: bool = False) -> StepDone:
    with teed_output(pipeline.planned.run_dir / SERVE_LOG):
        served = pipeline.serve()
        if eval_first:
            pipeline.eval()
        swept = pipeline.sweep()
    if served.status is StepStatus.SKIPPED:
        return StepDone(f"{served.message}; {swept.message}", (SERVE_LOG,))
    return StepDone("server ready, markers passed, sweep done", ("server.log", "serve.json", SERVE_LOG))


def _eval(pipeline: RunPipeline) -> StepDone:
    with teed_output(pipeline.planned.run_dir / EVAL_LOG):
        done = pipeline.eval()
    return StepDone(done.message, (*done.artifacts, EVAL_LOG), done.status)


def _print_step(result: StepResult) -> None:
    info(f"ci: {result.name}: {result.status.value} ({result.seconds:.1f} s) {result.message}")


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    msg = f"received signal {signal.Signals(signum).name}; the job and its server were stopped"
    interrupt(Interrupted(msg, hint="re-run with --resume to keep the finished cells"))


class _Tee(io.TextIOBase):
    """Text to the terminal and the job log. Not a terminal, so progress prints plain lines, as
    in a CI log. A log the disk refuses (full, I/O error) is dropped at its first failure and
    kept in `log_error`: the terminal still gets every line, and the block fails after."""

    def __init__(self, terminal: TextIO, log: TextIO) -> None:
        self.terminal = terminal
        self.log = log
        self.log_error: OSError | None = None

    def write(self, text: str) -> int:
        self.terminal.write(text)
        self.to_log(lambda: self.log.write(text))
        return len(text)

    def flush(self) -> None:
        self.terminal.flush()
        self.to_log(self.log.flush)

    def isatty(self) -> bool:
        return False

    def to_log(self, action: Callable[[], object]) -> None:
        if self.log_error is None:
            try:
                action()
            except OSError as exc:
                self.log_error = exc


def _log_failed(log_path: Path, exc: OSError) -> TreeIOError:
    msg = f"{log_path}: cannot write the job log: {exc.strerror or exc}"
    return TreeIOError(msg, hint=f"free space in {log_path.parent}, or choose another --run-dir; "
                                 "then re-run with --resume to keep the finished cells")


@contextlib.contextmanager
def teed_output(log_path: Path) -> Iterator[None]:
    """The block's stdout and stderr go to stderr and into `log_path` (the job's stdout stays
    clean for what a workflow parses); the error that ends the block is written to the log too
    (the terminal gets it once, from the error handler). A log the run folder cannot hold is
    the run folder's error (7) once the block is done, never an internal one."""
    try:
        log = open(log_path, "w", encoding="utf-8", errors="replace")  # noqa: SIM115
    except OSError as exc:
        raise _log_failed(log_path, exc) from None
    tee = _Tee(sys.stderr, log)
    try:
        with contextlib.redirect_stdout(cast(TextIO, tee)), \
                contextlib.redirect_stderr(cast(TextIO, tee)):
            yield
    except M3PatchError as exc:
        line = f"m3patch: error: {exc}\n"
        tee.to_log(lambda: log.write(line))
        raise
    finally:
        try:
            log.close()
        except OSError as exc:
            tee.log_error = tee.log_error or exc
    if tee.log_error is not None:
        raise _log_failed(log_path, tee.log_error)


def write_summary(recipe: Path, run_dir: Path, results: Sequence[StepResult], code: int,
                  report: Mapping[str, Any] | None = None, *,
                  warnings: Sequence[dict[str, object]] = ()) -> None:
    """ci.json: its own fields (schema 1, recipe, run_dir, exit_code, steps), plus the --json
    envelope's (tool_version, tree_root, vllm_version, series_id, mode, ledger_sha256, ok) with
    that envelope's schema as `report_schema` (`schema` stays ci.json's own)."""
    data: dict[str, Any] = {
        "schema": 1, "recipe": str(recipe), "run_dir": str(run_dir),
        "exit_code": code, "steps": [r.to_json() for r in results],
        "warnings": list(warnings),  # `warn` markers: reported, never a failure
    }
    if report is not None:
        extra = {k: v for k, v in report.items() if k not in data and k != "schema"}
        data.update(extra, report_schema=report["schema"], ok=code == 0)
    write_json_atomic(Path(run_dir) / SUMMARY, data)
