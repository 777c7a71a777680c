"""Scores beside throughput: a run's accuracy table and `bench compare` of two gated runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from m3patch.errors import ResultsInvalid
from m3patch.eval.compare import compare_rows, read_scores, record_path, run_rows

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
    assert run_rows(scores) == [["tiny_arith", "exact_match,strict-match", "0.0000", "32", "ok"]]


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
