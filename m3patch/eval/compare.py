"""Accuracy beside throughput: the eval record's scores as table rows, one run or two (pure).

A run folder's `eval/eval.json` (eval.runner) is read back as hostile input; a run without one
simply has no scores (not every recipe declares a gate), a malformed one is ResultsInvalid.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from m3patch.errors import ResultsInvalid
from m3patch.fsio import read_json

RECORD = Path("eval") / "eval.json"
HINT = "rerun the eval (m3patch eval RECIPE --run-dir RUN) to rewrite eval/eval.json"
Scores = dict[tuple[str, str], tuple[float, int, bool]]  # (task, metric) -> score, samples, passed


def record_path(run: Path) -> Path | None:
    """eval/eval.json of a run folder (or beside an aggregate.json), if there is one."""
    folder = run if run.is_dir() else run.parent
    path = folder / RECORD
    return path if path.is_file() else None


def read_scores(path: Path) -> Scores:
    data = read_json(path, error=ResultsInvalid, hint=HINT, expect=dict)
    tasks = data.get("tasks")
    if not isinstance(tasks, list):
        msg = f"{path}: 'tasks' is not a list"
        raise ResultsInvalid(msg, hint=HINT)
    scores: Scores = {}
    for row in tasks:
        score = row.get("score") if isinstance(row, dict) else None
        samples = row.get("samples") if isinstance(row, dict) else None
        if (not isinstance(row, dict) or not isinstance(row.get("task"), str)
                or not isinstance(row.get("metric"), str) or isinstance(score, bool)
                or not isinstance(score, (int, float)) or not math.isfinite(score)
                or isinstance(samples, bool) or not isinstance(samples, int)):
            msg = f"{path}: a task row lacks task, metric, a finite score or a sample count"
            raise ResultsInvalid(msg, hint=HINT)
        scores[(row["task"], row["metric"])] = (float(score), samples, row.get("passed") is True)
    return scores


def run_rows(scores: Scores) -> list[list[str]]:
    """Task, Metric, Score, Samples, Gate: for the table after a run's throughput table."""
    return [[task, metric, f"{score:.4f}", str(samples), "ok" if passed else "FAILED"]
            for (task, metric), (score, samples, passed) in sorted(scores.items())]


def compare_rows(base: Scores, new: Scores) -> list[list[str]]:
    """Task, Metric, Base, New, Change (points): every task either side scored."""
    rows = []
    for key in sorted(set(base) | set(new)):
        old, cur = base.get(key), new.get(key)
        change = f"{(cur[0] - old[0]) * 100:+.2f} pts" if old and cur else "n/a (one side)"
        rows.append([key[0], key[1], f"{old[0]:.4f}" if old else "-",
                     f"{cur[0]:.4f}" if cur else "-", change])
    return rows


def change_cell(base: Scores, new: Scores) -> str:
    """Every task's score change in one cell, for the throughput table's Accuracy column."""
    return "; ".join(f"{task} {change}" for task, _, _, _, change in compare_rows(base, new))


def to_json(base: Scores, new: Scores) -> list[dict[str, Any]]:
    return [{"task": task, "metric": metric,
             "base": base[(task, metric)][0] if (task, metric) in base else None,
             "new": new[(task, metric)][0] if (task, metric) in new else None}
            for task, metric in sorted(set(base) | set(new))]
