"""Scores beside throughput: a run's eval rows in aggregate.json and its results table, and
`bench compare` of two gated runs (reading the aggregate's scores, else eval/eval.json)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from m3patch.bench.aggregate import attach_evals, load_aggregate, table_of
from m3patch.errors import ResultsInvalid
from m3patch.eval.compare import (
    accuracy_cell,
    check_evals,
    compare_rows,
    read_evals,
    read_scores,
    record_path,
)
from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]
# The eval record of a real serve --bench run of the embedded default (paths made relative).
RECORD = REPO / "tests" / "data" / "eval" / "eval.json"
RUNS = REPO / "tests" / "data" / "bench" / "runs"


def gated_run(tmp_path: Path, side: str, score: float) -> Path:
    run = shutil.copytree(RUNS / side, tmp_path / side)
    data = json.loads(RECORD.read_text())
    data["tasks"][0]["score"] = score
    (run / "eval").mkdir()
    (run / "eval" / "eval.json").write_text(json.dumps(data))
    return run


def test_the_real_record_reads_back_as_one_row() -> None:
    scores = read_scores(RECORD)
    assert scores == {("tiny_arith", "exact_match,strict-match"): (0.0, 32, True)}
    (row,) = read_evals(RECORD)
    # InferenceX's eval-row names (task, score, score_name, score_se, n_eff), the gate's beside
    assert row == {"task": "tiny_arith", "metric": "exact_match,strict-match",
                   "score_name": "em_strict", "score": 0.0, "n_eff": 32, "score_se": 0.0,
                   "min": 0.0, "baseline": None, "max_drop": None, "drop": None, "passed": True}
    assert accuracy_cell([row]) == "tiny_arith 0.0000 (min 0) ok"


def test_a_baseline_gate_shows_the_drop_and_its_limit() -> None:
    data = json.loads(RECORD.read_text())
    data["tasks"][0].update(score=0.125, min=0.5, baseline=0.96875, max_drop=0.05, passed=False)
    (row,) = check_evals([{**read_evals_from(data), "passed": False}], "x", "h")
    assert row["drop"] == pytest.approx(0.84375)
    assert accuracy_cell([row]) == ("tiny_arith 0.1250 (min 0.5; drop +0.8438 from 0.9688, "
                                    "max 0.05) FAILED")


def read_evals_from(data: dict[str, object]) -> dict[str, object]:
    tasks = data["tasks"]
    assert isinstance(tasks, list)
    task = tasks[0]
    return {"task": task["task"], "metric": task["metric"], "score": task["score"],
            "n_eff": task["samples"], "score_se": task["stderr"], "min": task["min"],
            "baseline": task["baseline"], "max_drop": task["max_drop"], "drop": None,
            "passed": task["passed"]}


@pytest.mark.parametrize(("key", "value"), [
    ("score", float("nan")), ("score", "0.9"), ("score", True), ("n_eff", 0), ("n_eff", 1.5),
    ("min", "high"), ("score_se", float("inf")), ("passed", "yes"), ("task", ""), ("task", 3)])
def test_an_aggregate_eval_row_is_checked_key_by_key(key: str, value: object) -> None:
    row = {**read_evals_from(json.loads(RECORD.read_text())), key: value}
    with pytest.raises(ResultsInvalid, match=f"evals\\[0\\].*{key if key != 'n_eff' else 'samples'}"):
        check_evals([row], "agg.json", "h")
    with pytest.raises(ResultsInvalid, match="expected a list"):
        check_evals({"task": "x"}, "agg.json", "h")


@pytest.mark.parametrize(("key", "change"), [
    ("score", {"score": 9.5}),  # exact_match is a fraction of the samples
    ("score", {"score": -0.25, "min": -1.0}),
    ("score", {"metric": "acc,none", "score": 1.5}),
    ("score_se", {"score_se": -5}),
    ("passed", {"score": 0.25, "min": 0.5, "passed": True}),  # under its floor yet passed
    ("passed", {"score": 0.5, "min": 0.25, "passed": False}),  # over its floor yet failed
    ("passed", {"score": 0.5, "baseline": 0.9, "max_drop": 0.1, "passed": True}),
])
def test_an_impossible_or_contradictory_eval_row_is_refused_naming_the_key(
        key: str, change: dict[str, object]) -> None:
    """Before: a score of 9.5 for exact match, a negative standard error and a `passed` that
    its own score and gate contradict were read back as they stood (and shown as ok)."""
    row = {**read_evals_from(json.loads(RECORD.read_text())), **change}
    with pytest.raises(ResultsInvalid, match=f"agg.json evals\\[0\\]: key '{key}'") as info:
        check_evals([row], "agg.json", "h")
    assert info.value.exit_code == 17


def test_a_metric_that_is_no_fraction_may_score_over_one() -> None:
    row = {**read_evals_from(json.loads(RECORD.read_text())), "metric": "bleu,none",
           "score": 31.5}
    assert check_evals([row], "agg.json", "h")[0]["score"] == 31.5


def test_a_task_scored_twice_for_one_metric_is_refused() -> None:
    """Before: two rows for one (task, metric) were both kept; the compare showed one of them."""
    row = read_evals_from(json.loads(RECORD.read_text()))
    with pytest.raises(ResultsInvalid, match=r"agg.json evals\[1\]: key 'task'.*twice"):
        check_evals([row, {**row, "score": 0.5}], "agg.json", "h")
    other = {**row, "metric": "exact_match,flexible-extract"}
    assert len(check_evals([row, other], "agg.json", "h")) == 2


def test_the_aggregate_carries_the_scores_and_the_table_shows_them(tmp_path: Path) -> None:
    run = gated_run(tmp_path, "base", 0.96875)
    data = attach_evals(run)
    raw = json.loads((run / "aggregate.json").read_text())
    assert "evals" in raw and raw["rows"][0]["dp_attention"] == "false"  # rows as written
    assert [(r["task"], r["score"], r["passed"]) for r in data["evals"]] == [
        ("tiny_arith", 0.96875, True)]
    assert load_aggregate(run)["evals"] == data["evals"]
    columns, lines = table_of(data["rows"], data["evals"])
    assert columns[-1] == "Accuracy" and columns[:3] == ["parallelism", "isl/osl", "conc"]
    assert lines and all(line[-1] == "tiny_arith 0.9688 (min 0) ok" for line in lines)
    assert table_of(data["rows"])[0][-1] != "Accuracy"  # no eval: no column
    (run / "eval" / "eval.json").unlink()
    assert attach_evals(run)["evals"] == []  # a run without a record carries none


def test_a_hostile_evals_field_fails_the_read(tmp_path: Path) -> None:
    run = gated_run(tmp_path, "base", 0.5)
    raw = json.loads((RUNS / "base" / "aggregate.json").read_text())
    raw["evals"] = [{"task": "tiny_arith", "metric": "m,f", "score": "high", "n_eff": 32, "passed": True}]
    (run / "aggregate.json").write_text(json.dumps(raw))
    with pytest.raises(ResultsInvalid, match="evals\\[0\\]"):
        load_aggregate(run)


def test_change_is_in_points_and_one_sided_tasks_say_so() -> None:
    base = {("gsm8k", "exact_match,strict-match"): (0.9553, 1319, True)}
    new = {("gsm8k", "exact_match,strict-match"): (0.9530, 1319, True),
           ("tiny_arith", "exact_match,strict-match"): (0.0, 32, True)}
    assert compare_rows(base, new) == [
        ["gsm8k", "exact_match,strict-match", "0.9553", "0.9530", "-0.23 pts"],
        ["tiny_arith", "exact_match,strict-match", "-", "0.0000", "n/a (one side)"]]


def test_a_malformed_record_is_results_invalid(tmp_path: Path) -> None:
    bad = tmp_path / "eval.json"
    bad.write_text(json.dumps({"tasks": [{"task": "x", "metric": "m,f", "score": "high"}]}))
    with pytest.raises(ResultsInvalid, match="finite score"):
        read_scores(bad)
    assert record_path(tmp_path) is None


def test_bench_compare_prints_accuracy_beside_throughput(tmp_path: Path) -> None:
    base, new = gated_run(tmp_path, "base", 0.5), gated_run(tmp_path, "new", 0.53125)
    out = tmp_path / "cmp.json"
    done = subprocess.run([sys.executable, "-m", "m3patch", "bench", "compare", str(base),
                           str(new), "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert "accuracy (eval/eval.json): base -> new" in done.stdout
    assert "0.5000" in done.stdout and "0.5312" in done.stdout and "+3.12 pts" in done.stdout
    assert json.loads(out.read_text())["accuracy"] == [
        {"task": "tiny_arith", "metric": "exact_match,strict-match", "base": 0.5, "new": 0.53125}]
    stdout = subprocess.run([sys.executable, "-m", "m3patch", "bench", "compare", str(base),
                             str(new), "--json"], capture_output=True, text=True, cwd=REPO,
                            check=False)
    assert json.loads(stdout.stdout)["compare"]["accuracy"][0]["new"] == 0.53125
    plain = subprocess.run([sys.executable, "-m", "m3patch", "bench", "compare",
                            str(RUNS / "base"), str(RUNS / "new")],
                           capture_output=True, text=True, cwd=REPO, check=False)
    assert plain.returncode == 0 and "accuracy" not in plain.stdout  # no eval: no table


def test_bench_compare_puts_the_score_change_on_every_throughput_row(tmp_path: Path) -> None:
    base, new = gated_run(tmp_path, "base", 0.96875), gated_run(tmp_path, "new", 0.125)
    done = subprocess.run([sys.executable, "-m", "m3patch", "bench", "compare", str(base), str(new)],
                          capture_output=True, text=True, cwd=REPO, check=False,
                          env={**os.environ, "COLUMNS": "200"})
    assert done.returncode == 0, done.stderr
    throughput = done.stdout.split("accuracy (eval/eval.json)")[0]
    assert "Accuracy" in throughput
    cells = [line for line in throughput.splitlines() if line.startswith("32/16 ")]
    assert cells and all("tiny_arith -84.38 pts" in line for line in cells), throughput


def test_bench_compare_reads_the_scores_the_aggregate_carries(tmp_path: Path) -> None:
    """The aggregate's `evals` is what compare reads: eval/eval.json beside it (here saying
    otherwise) is only the fallback for aggregates that carry none."""
    base, new = gated_run(tmp_path, "base", 0.5), gated_run(tmp_path, "new", 0.75)
    attach_evals(base), attach_evals(new)
    stale = json.loads(RECORD.read_text())
    stale["tasks"][0]["score"] = 0.0
    (new / "eval" / "eval.json").write_text(json.dumps(stale))
    done = subprocess.run([sys.executable, "-m", "m3patch", "bench", "compare", str(base),
                           str(new), "--json"], capture_output=True, text=True, cwd=REPO,
                          check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["compare"]["accuracy"] == [
        {"task": "tiny_arith", "metric": "exact_match,strict-match", "base": 0.5, "new": 0.75}]


def test_the_compare_heading_names_the_file_the_scores_came_from(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the heading said eval/eval.json whatever the scores were read from."""
    base, new = gated_run(tmp_path, "base", 0.5), gated_run(tmp_path, "new", 0.75)
    attach_evals(base)
    assert main(["bench", "compare", str(base), str(new)]) == 0
    out = capsys.readouterr().out
    assert "accuracy (base: aggregate.json evals, new: eval/eval.json): base -> new" in out
    attach_evals(new)
    assert main(["bench", "compare", str(base), str(new)]) == 0
    assert "accuracy (aggregate.json evals): base -> new" in capsys.readouterr().out


def test_after_the_sweep_the_results_table_prints_once_with_the_scores(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from m3patch.run.pipeline import show_scores

    run = gated_run(tmp_path, "base", 0.125)
    show_scores("cpu_tiny_moe", run, after_sweep=True)
    out = capsys.readouterr().out
    assert out.count("cpu_tiny_moe: per-GPU results") == 1 and "Accuracy" in out
    assert "tiny_arith 0.1250 (min 0) ok" in out  # the recorded verdict, as the gate gave it
    assert json.loads((run / "aggregate.json").read_text())["evals"][0]["score"] == 0.125
    # before the sweep (or with no aggregate yet): the scores alone, the aggregate untouched
    before = gated_run(tmp_path / "b", "new", 0.5)
    kept = (before / "aggregate.json").read_bytes()
    show_scores("cpu_tiny_moe", before, after_sweep=False)
    out = capsys.readouterr().out
    assert "cpu_tiny_moe: accuracy" in out and "per-GPU" not in out
    assert (before / "aggregate.json").read_bytes() == kept


def test_a_change_of_a_metric_that_is_no_fraction_is_no_points() -> None:
    """Before: every change was (new - base) * 100 "pts", so a perplexity going from 12.0 to
    12.5 showed as "+50.00 pts" (a fraction's percentage points, which it is not)."""
    base = {("wikitext", "word_perplexity,none"): (12.0, 62, True),
            ("gsm8k", "exact_match,strict-match"): (0.9553, 1319, True),
            ("mnli", "mcc,none"): (0.25, 100, True)}
    new = {("wikitext", "word_perplexity,none"): (12.5, 62, True),
           ("gsm8k", "exact_match,strict-match"): (0.9530, 1319, True),
           ("mnli", "mcc,none"): (0.5, 100, True)}
    changes = {row[0]: row[4] for row in compare_rows(base, new)}
    assert changes == {"wikitext": "+0.5000", "gsm8k": "-0.23 pts", "mnli": "+25.00 pts"}
