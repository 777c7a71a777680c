"""Read lm-evaluation-harness results and judge them against the recipe's floors (pure).

lm-eval writes one `results_<time>.json` per run: `results[TASK]["METRIC,FILTER"]` is the score,
`results[TASK]["METRIC_stderr,FILTER"]` its standard error, `n-samples[TASK]` the number of
samples (original: in the split, effective: after `limit`). The file is read as hostile input:
a missing task, a missing metric or a non-number is an EvalError naming what it lacked.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import EvalError
from m3patch.recipe.evals import EvalTask
from m3patch.schema import finite_number, short_repr


@dataclass(frozen=True)
class TaskScore:
    task: str
    metric: str          # METRIC,FILTER
    score: float
    stderr: float | None
    samples: int         # effective: what was scored
    samples_in_split: int

    def to_json(self) -> dict[str, Any]:
        return {"task": self.task, "metric": self.metric, "score": self.score,
                "stderr": self.stderr, "samples": self.samples,
                "samples_in_split": self.samples_in_split}


@dataclass(frozen=True)
class TaskVerdict:
    score: TaskScore
    min: float
    baseline: float | None
    max_drop: float | None
    failures: tuple[str, ...]  # empty: passed

    @property
    def passed(self) -> bool:
        return not self.failures

    def to_json(self) -> dict[str, Any]:
        return {**self.score.to_json(), "min": self.min, "baseline": self.baseline,
                "max_drop": self.max_drop, "passed": self.passed, "failures": list(self.failures)}


def _number(value: object, what: str, where: str) -> float:
    number = finite_number(value)
    if number is None:
        msg = f"{where}: {what} is {short_repr(value)}, not a finite number"
        raise EvalError(msg)
    return number


def _mapping(value: object, what: str, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        msg = f"{where}: {what} is missing or not a mapping"
        raise EvalError(msg)
    return value


def task_score(results: dict[str, Any], task: EvalTask, where: str) -> TaskScore:
    """One task's score from a harness results object; `where` names the file in messages."""
    per_task = _mapping(results.get("results"), "'results'", where)
    if task.task not in per_task:
        found = ", ".join(sorted(per_task)) or "none"
        msg = f"{where}: no results for task {task.task!r} (found: {found})"
        raise EvalError(msg, hint="check the task name, or its task-dir, in the recipe's eval")
    row = _mapping(per_task[task.task], f"results.{task.task}", where)
    if task.metric_key not in row:
        keys = ", ".join(k for k in sorted(row) if "," in k and "_stderr," not in k) or "none"
        msg = f"{where}: task {task.task!r} has no metric {task.metric_key!r} (it has: {keys})"
        raise EvalError(msg, hint="set eval.tasks[].metric to one of the keys the task reports")
    score = _number(row[task.metric_key], f"{task.task} {task.metric_key}", where)
    stderr_raw = row.get(f"{task.metric}_stderr,{task.filter}")
    # lm-eval writes the string "N/A" when it could not compute a standard error.
    stderr = None if isinstance(stderr_raw, str) or stderr_raw is None else _number(
        stderr_raw, "stderr", where)
    counts = _mapping(_mapping(results.get("n-samples"), "'n-samples'", where).get(task.task),
                      f"n-samples.{task.task}", where)
    effective = int(_number(counts.get("effective"), "n-samples effective", where))
    original = int(_number(counts.get("original"), "n-samples original", where))
    if effective < 1:
        msg = f"{where}: task {task.task!r} scored {effective} samples"
        raise EvalError(msg, hint="the task's test split is empty or its limit is 0")
    return TaskScore(task.task, task.metric_key, score, stderr, effective, original)


def judge(score: TaskScore, task: EvalTask, baseline: float | None) -> TaskVerdict:
    """Below `min`, or more than `max-drop` under the baseline's score: each a failure line."""
    failures = []
    if score.score < task.min:
        failures.append(f"{task.task} {task.metric_key} = {score.score:.4f}, below min {task.min:g}")
    if task.max_drop is not None and baseline is not None and baseline - score.score > task.max_drop:
        failures.append(f"{task.task} {task.metric_key} = {score.score:.4f}, "
                        f"{baseline - score.score:.4f} under the baseline {baseline:.4f} "
                        f"(max-drop {task.max_drop:g})")
    return TaskVerdict(score, task.min, baseline, task.max_drop, tuple(failures))


def baseline_score(data: dict[str, Any], task: EvalTask, path: Path) -> float:
    """The baseline's score for this task: a harness results file or an m3patch eval.json."""
    if "tasks" in data and "results" not in data:  # m3patch's own eval.json
        for row in data["tasks"] if isinstance(data["tasks"], list) else []:
            if isinstance(row, dict) and row.get("task") == task.task \
                    and row.get("metric") == task.metric_key:
                return _number(row.get("score"), f"{task.task} baseline score", str(path))
        msg = f"{path}: baseline has no {task.task} {task.metric_key} score"
        raise EvalError(msg, hint="point eval.tasks[].baseline at a run that scored this task")
    return task_score(data, task, f"baseline {path}").score
