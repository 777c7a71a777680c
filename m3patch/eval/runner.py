"""One eval of a recipe against a served endpoint: every task's harness, scores, one record.

    RUN/eval/<task>/harness.log        lm-eval's whole output
    RUN/eval/<task>/<model>/results_*.json, samples_*.jsonl   the harness's own files
    RUN/eval/eval.json                 per-task scores, samples, floors, verdicts, provenance

eval.json is written before the verdict raises, so a failed gate keeps its evidence. A task
that cannot be scored (EvalError) stops the eval; a score under its floor (EvalFailed) is
raised once every task has run.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import EvalError, EvalFailed
from m3patch.eval import datasets
from m3patch.eval.harness import (
    Endpoint,
    harness_argv,
    require_interpreter,
    results_file,
    run_harness,
)
from m3patch.eval.scores import TaskVerdict, baseline_score, judge, task_score
from m3patch.fsio import owned_dir, read_json, write_json_atomic
from m3patch.output import info
from m3patch.recipe.evals import EvalSpec, EvalTask

EVAL_DIR = "eval"
EVAL_FILE = "eval.json"
SCHEMA = 1
READ_HINT = "rerun the eval; the harness's results file is unreadable"


@dataclass(frozen=True)
class EvalOutcome:
    verdicts: tuple[TaskVerdict, ...]
    record: Path

    @property
    def passed(self) -> bool:
        return all(v.passed for v in self.verdicts)

    def summary(self) -> str:
        return ", ".join(f"{v.score.task} {v.score.score:.4f} (min {v.min:g}, n={v.score.samples})"
                         for v in self.verdicts)


def preflight(spec: EvalSpec, recipe_path: Path) -> None:
    """What can be checked before any server time is spent: the interpreter, cached datasets."""
    require_interpreter(spec.python)
    for task in spec.tasks:
        if task.task_dir is not None and not task.task_dir.is_dir():
            msg = f"{recipe_path}: eval task {task.task!r}: task-dir {task.task_dir} is not a folder"
            raise EvalError(msg, hint="task-dir is relative to the recipe file; fix the path")
    datasets.require_cached(spec, recipe_path)


def evaluate(spec: EvalSpec, run_dir: Path, endpoint: Endpoint, *,
             check_server: Callable[[], None], provenance: dict[str, Any]) -> EvalOutcome:
    started = time.monotonic()
    record = run_dir / EVAL_DIR / EVAL_FILE
    # An earlier eval's record must never stand for this one (its scores would reach the run's
    # aggregate.json and table if this eval stopped before writing its own); deleted only in a
    # folder of this user's, never through a link planted at RUN/eval (34).
    if os.path.lexists(record.parent):
        owned_dir(record.parent)
    record.unlink(missing_ok=True)
    verdicts, runs = [], []
    for task in spec.tasks:
        out_dir = run_dir / EVAL_DIR / task.task
        argv = harness_argv(spec.python, task, endpoint, out_dir)
        remaining = spec.timeout_s - (time.monotonic() - started)
        run = run_harness(argv, task.task, out_dir, deadline_s=max(remaining, 1.0),
                          check_server=check_server)
        path = results_file(run)
        results = read_json(path, error=EvalError, hint=READ_HINT, expect=dict)
        score = task_score(results, task, str(path))
        verdict = judge(score, task, _baseline(task))
        info(f"eval {task.task}: {task.metric_key} = {score.score:.4f} over {score.samples} "
             f"samples ({'ok' if verdict.passed else 'FAILED'}, {run.seconds:.1f} s)")
        verdicts.append(verdict)
        runs.append({"task": task.task, "argv": list(run.argv), "seconds": round(run.seconds, 3),
                     "results": path.relative_to(run_dir).as_posix(),
                     "log": run.log.relative_to(run_dir).as_posix()})
    outcome = EvalOutcome(tuple(verdicts), record)
    write_json_atomic(record, {
        "schema": SCHEMA, "passed": outcome.passed, "provenance": provenance,
        "endpoint": endpoint.base_url, "model": endpoint.model,
        "seconds": round(time.monotonic() - started, 3),
        "tasks": [v.to_json() for v in verdicts], "harness": runs})
    if not outcome.passed:
        failures = [line for v in verdicts for line in v.failures]
        msg = "accuracy gate failed: " + "; ".join(failures) + f" (scores: {record})"
        raise EvalFailed(msg, hint="the served path computes wrong answers: compare with an "
                                   "unpatched baseline run before changing the floor")
    return outcome


def _baseline(task: EvalTask) -> float | None:
    if task.baseline is None:
        return None
    data = read_json(task.baseline, error=EvalError, expect=dict,
                     hint="point eval.tasks[].baseline at a harness results file or an eval.json")
    return baseline_score(data, task, task.baseline)
