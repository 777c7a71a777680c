"""Accuracy beside throughput: the eval record's scores as rows of the run's aggregate.json, as
the results table's Accuracy column, and as `bench compare`'s score change (pure but for the read).

aggregate.json's `evals` holds one row per task, named as InferenceX's eval rows name them
(utils/collect_eval_results.py: `task`, `score`, `score_name` such as em_strict, `score_se`,
`n_eff`), with the gate's own figures beside them: `metric` (lm-eval's METRIC,FILTER), `min`
(the floor), `baseline`, `max_drop`, `drop` (baseline - score) and `passed`. A run without an
eval has `evals: []`; an aggregate written before the field existed has no `evals` key, and its
scores are read from `eval/eval.json` beside it.

A run folder's `eval/eval.json` (eval.runner) and an aggregate's `evals` are read back as
hostile input: a malformed one is ResultsInvalid, naming the key.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from m3patch.errors import ResultsInvalid
from m3patch.fsio import read_json
from m3patch.schema import finite_number

RECORD = Path("eval") / "eval.json"
EVALS = "evals"  # aggregate.json's key
HINT = "rerun the eval (m3patch eval RECIPE --run-dir RUN) to rewrite eval/eval.json"
Scores = dict[tuple[str, str], tuple[float, int, bool]]  # (task, metric) -> score, samples, passed
EvalRow = dict[str, Any]


def record_path(run: Path) -> Path | None:
    """eval/eval.json of a run folder (or beside an aggregate.json), if there is one."""
    folder = run if run.is_dir() else run.parent
    path = folder / RECORD
    return path if path.is_file() else None


def score_name(metric: str) -> str:
    """InferenceX's name for a score: em_strict / em_flexible for exact match under a strict or
    a flexible filter, accuracy for acc, else lm-eval's metric name."""
    name, _, filt = metric.partition(",")
    if name == "exact_match" and "strict" in filt:
        return "em_strict"
    if name == "exact_match" and ("flex" in filt or "extract" in filt):
        return "em_flexible"
    return "accuracy" if name == "acc" else name


# lm-eval's metrics that are a share of the samples (each sample scores 0 or 1): within [0, 1].
FRACTION_METRICS = frozenset({"exact_match", "acc", "acc_norm"})
SIGNED_METRICS = frozenset({"mcc"})  # a correlation, within [-1, 1]; every other one is >= 0


def _score_problem(metric: str, score: float) -> str | None:
    """Why `score` cannot be a score of `metric`, or None."""
    name = metric.partition(",")[0]
    if name in FRACTION_METRICS and not 0.0 <= score <= 1.0:
        return f"{score!r} is no {name} score: it is a share of the samples, within [0, 1]"
    if name in SIGNED_METRICS and not -1.0 <= score <= 1.0:
        return f"{score!r} is no {name} score: it lies within [-1, 1]"
    if name not in SIGNED_METRICS and score < 0:
        return f"{score!r} is no {name} score: it is never negative"
    return None


def _gate_passes(score: float, floor: Any, baseline: Any, max_drop: Any) -> bool:
    """The verdict eval.scores.judge gives these figures."""
    if floor is not None and score < floor:
        return False
    return max_drop is None or baseline is None or baseline - score <= max_drop


def _finite(value: object) -> bool:
    return finite_number(value) is not None


def _bad(where: str, key: str, problem: str, hint: str) -> ResultsInvalid:
    return ResultsInvalid(f"{where}: key {key!r}: {problem}", hint=hint)


def eval_row(task: object, where: str, hint: str = HINT) -> EvalRow:
    """One aggregate eval row from an eval.json task object, checked field by field."""
    if not isinstance(task, dict):
        raise _bad(where, "tasks[]", "expected an object", hint)
    for key in ("task", "metric"):
        if not isinstance(task.get(key), str) or not task[key]:
            raise _bad(where, key, f"expected a name, got {task.get(key)!r}", hint)
    score: Any = task.get("score")
    samples = task.get("samples")
    if not _finite(score):
        raise _bad(where, "score", f"expected a finite score, got {score!r}", hint)
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise _bad(where, "samples", f"expected a positive sample count, got {samples!r}", hint)
    extra: dict[str, Any] = {"score_se": task.get("stderr"), "min": task.get("min"),
             "baseline": task.get("baseline"), "max_drop": task.get("max_drop")}
    for key, value in extra.items():
        if value is not None and not _finite(value):
            raise _bad(where, key, f"expected a finite number or null, got {value!r}", hint)
    problem = _score_problem(task["metric"], score)
    if problem is not None:
        raise _bad(where, "score", problem, hint)
    if extra["score_se"] is not None and extra["score_se"] < 0:
        raise _bad(where, "score_se", f"a standard error is never negative, got {extra['score_se']!r}",
                   hint)
    base = extra["baseline"]
    passed = task.get("passed")
    if isinstance(passed, bool) and passed != _gate_passes(score, extra["min"], base,
                                                           extra["max_drop"]):
        gate = f"min {extra['min']!r}, baseline {base!r}, max_drop {extra['max_drop']!r}"
        raise _bad(where, "passed", f"{passed} contradicts its score {score!r} ({gate})", hint)
    return {"task": task["task"], "metric": task["metric"], "score_name": score_name(task["metric"]),
            "score": float(score), "n_eff": samples, **extra,
            "drop": None if base is None else float(base) - float(score),
            "passed": task.get("passed") is True}


def read_evals(path: Path) -> list[EvalRow]:
    """The aggregate's eval rows from a run's eval/eval.json."""
    data = read_json(path, error=ResultsInvalid, hint=HINT, expect=dict)
    tasks = data.get("tasks")
    if not isinstance(tasks, list):
        raise _bad(str(path), "tasks", "expected a list", HINT)
    rows = [eval_row(task, f"{path} tasks[{i}]") for i, task in enumerate(tasks)]
    return _unique(rows, f"{path} tasks", HINT)


def evals_of_run(run_dir: Path) -> list[EvalRow]:
    """What the run's aggregate.json carries: its eval rows, none without an eval record."""
    path = record_path(run_dir)
    return [] if path is None else read_evals(path)


def check_evals(rows: object, where: str, hint: str) -> list[EvalRow]:
    """An aggregate's `evals`, read back: every row as eval_row would have written it."""
    if not isinstance(rows, list):
        raise _bad(where, EVALS, f"expected a list, got {type(rows).__name__}", hint)
    checked = []
    for index, row in enumerate(rows):
        at = f"{where} {EVALS}[{index}]"
        if not isinstance(row, dict):
            raise _bad(at, EVALS, "expected an object", hint)
        again = eval_row({"task": row.get("task"), "metric": row.get("metric"),
                          "score": row.get("score"), "samples": row.get("n_eff"),
                          "stderr": row.get("score_se"), "min": row.get("min"),
                          "baseline": row.get("baseline"), "max_drop": row.get("max_drop"),
                          "passed": row.get("passed")}, at, hint)
        if not isinstance(row.get("passed"), bool):
            raise _bad(at, "passed", f"expected true/false, got {row.get('passed')!r}", hint)
        checked.append(again)
    return _unique(checked, f"{where} {EVALS}", hint)


def _unique(rows: list[EvalRow], where: str, hint: str) -> list[EvalRow]:
    """`rows`, each (task, metric) once: a second score for one would hide the first."""
    seen: set[tuple[str, str]] = set()
    for index, row in enumerate(rows):
        key = (row["task"], row["metric"])
        if key in seen:
            at = f"{where}[{index}]"
            raise _bad(at, "task", f"{key[0]} {key[1]} is scored twice", hint)
        seen.add(key)
    return rows


def scores_of(rows: Sequence[EvalRow]) -> Scores:
    return {(r["task"], r["metric"]): (r["score"], r["n_eff"], r["passed"]) for r in rows}


def read_scores(path: Path) -> Scores:
    return scores_of(read_evals(path))


def gate_text(row: EvalRow) -> str:
    """One task's score against its gate: 'tiny_arith 0.9688 (min 0.875) ok'."""
    limits = [] if row["min"] is None else [f"min {row['min']:g}"]
    if row["drop"] is not None:
        limits.append(f"drop {row['drop']:+.4f} from {row['baseline']:.4f}"
                      + ("" if row["max_drop"] is None else f", max {row['max_drop']:g}"))
    gate = f" ({'; '.join(limits)})" if limits else ""
    return f"{row['task']} {row['score']:.4f}{gate} {'ok' if row['passed'] else 'FAILED'}"


def accuracy_cell(rows: Sequence[EvalRow]) -> str:
    """Every task of the run in one cell: the results table's Accuracy column."""
    return "; ".join(gate_text(row) for row in rows)


def compare_rows(base: Scores, new: Scores) -> list[list[str]]:
    """Task, Metric, Base, New, Change (points): every task either side scored."""
    rows = []
    for key in sorted(set(base) | set(new)):
        old, cur = base.get(key), new.get(key)
        change = _change(key[1], old[0], cur[0]) if old and cur else "n/a (one side)"
        rows.append([key[0], key[1], f"{old[0]:.4f}" if old else "-",
                     f"{cur[0]:.4f}" if cur else "-", change])
    return rows


def _change(metric: str, old: float, new: float) -> str:
    """Percentage points for a score within [0, 1] or [-1, 1] (a share, a correlation); the
    plain difference for any other (a perplexity, a BLEU): x100 would make it 100 times larger."""
    name = metric.partition(",")[0]
    if name in FRACTION_METRICS or name in SIGNED_METRICS:
        return f"{(new - old) * 100:+.2f} pts"
    return f"{new - old:+.4f}"


def change_cell(base: Scores, new: Scores) -> str:
    """Every task's score change in one cell, for the throughput table's Accuracy column."""
    return "; ".join(f"{task} {change}" for task, _, _, _, change in compare_rows(base, new))


def to_json(base: Scores, new: Scores) -> list[dict[str, Any]]:
    return [{"task": task, "metric": metric,
             "base": base[(task, metric)][0] if (task, metric) in base else None,
             "new": new[(task, metric)][0] if (task, metric) in new else None}
            for task, metric in sorted(set(base) | set(new))]
