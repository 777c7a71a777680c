"""`m3patch bench RECIPE` decisions taken before any server starts: resume, --only, overwrite.

The recorded real run tests/data/bench/runs/base stands in for a finished sweep of the shipped
CPU recipe (range-ratio 0.8, concurrency 1, 2, 4); nothing here starts vLLM.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import sys
from pathlib import Path

import pytest

from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]
BASE_RUN = REPO / "tests" / "data" / "bench" / "runs" / "base"


@pytest.fixture
def recipe(tmp_path: Path) -> Path:
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)  # the recorded runs' shape
    path = tmp_path / "cpu_tiny_moe.yaml"
    path.write_text(text.replace("series: ../patches", f"series: {REPO}/patches"))
    return path


def test_resume_of_finished_cells_aggregates_without_a_server(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(BASE_RUN, tmp_path / "run")
    (run / "aggregate.json").unlink()
    (run / "aggregate.csv").unlink()
    assert main(["bench", str(recipe), "--resume", "--run-dir", str(run), "--no-plots"]) == 0
    assert "aggregated" in capsys.readouterr().err
    rows = json.loads((run / "aggregate.json").read_text())["rows"]
    assert rows == json.loads((BASE_RUN / "aggregate.json").read_text())["rows"]
    assert (run / "aggregate.csv").is_file()


def test_existing_results_are_not_overwritten_without_resume(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = shutil.copytree(BASE_RUN, tmp_path / "run")
    assert main(["bench", str(recipe), "--run-dir", str(run)]) == 2
    err = capsys.readouterr().err
    assert "already holds per-cell results" in err and "--resume" in err


def test_only_names_an_existing_cell(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["bench", str(recipe), "--only", "isl32-osl16-c3", "--run-dir",
                 str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "no sweep cell isl32-osl16-c3" in err and "isl32-osl16-tp1-pp1-ep1-dp1-c2" in err


def test_a_resumed_cell_with_another_range_ratio_is_measured_again(
    recipe: Path, tmp_path: Path
) -> None:
    from m3patch.bench.runner import all_finished, select_cells
    from m3patch.recipe.loader import load_recipe

    run = shutil.copytree(BASE_RUN, tmp_path / "run")
    assert all_finished(run, select_cells(load_recipe(recipe), ()))
    recipe.write_text(recipe.read_text().replace("range-ratio: 0.8", "range-ratio: 0.5"))
    assert not all_finished(run, select_cells(load_recipe(recipe), ()))


def test_an_external_server_that_does_not_answer_is_18_and_no_tree_is_touched(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as sock:  # a port nothing listens on: bound, never listening
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        code = main(["bench", str(recipe), "--url", url, "--run-dir", str(tmp_path / "r")])
    assert code == 18
    err = capsys.readouterr().err
    assert f"{url}/health" in err and "--url" in err
    assert not (tmp_path / "r" / "ledger.json").exists()  # apply-verify skipped: not our tree


def _results_here(recipe: Path, results: Path, *edits: tuple[str, str]) -> None:
    """The recipe's results under `results`, its text edited (old, new) for the case at hand."""
    text = re.sub(r"(?m)^results: .*$", f"results: {results}", recipe.read_text())
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    recipe.write_text(text)


@pytest.mark.parametrize(("case", "code"), [("no-model", 19), ("flag-typo", 24),
                                            ("no-vllm", 3)])
def test_a_refused_run_leaves_no_run_folder(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str, code: int
) -> None:
    """19 and 24 refuse before the folder is made; 3 (apply-verify finds no vLLM in --python)
    after it: the empty folder this run made is removed again."""
    results, model = tmp_path / "results", tmp_path / "model"
    if case != "no-model":
        model.mkdir()
        (model / "config.json").write_text("{}")
    typo = "max-model-lenn" if case == "flag-typo" else "max-model-len"
    _results_here(recipe, results, ("  max-model-len: 512", f"  {typo}: 512"),
                  ("  source: ${M3PATCH_TINY_MODEL:-~/.cache/m3patch/tiny-moe}",
                   f"  source: {model}"))
    python = ["--python", sys.executable] if case == "no-vllm" else []
    assert main(["bench", str(recipe), *python]) == code, capsys.readouterr().err
    assert not results.exists() or not any(results.iterdir())


def test_resume_takes_the_newest_run_folder_that_holds_results(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    results = tmp_path / "results"
    _results_here(recipe, results)
    run = shutil.copytree(BASE_RUN, results / "20260101T000000Z")
    (run / "aggregate.json").unlink()
    (results / "20260102T000000Z" / "cells").mkdir(parents=True)  # a run that measured nothing
    assert main(["bench", str(recipe), "--resume", "--no-plots"]) == 0
    assert "aggregated" in capsys.readouterr().err
    assert (run / "aggregate.json").is_file()


def _run_with_cells(folder: Path, written_at: float) -> Path:
    """A copy of the recorded run without its aggregate, its cell files written at `written_at`."""
    run = shutil.copytree(BASE_RUN, folder)
    (run / "aggregate.json").unlink()
    for cell in (run / "cells").iterdir():
        os.utime(cell, (written_at, written_at))
    return run


def test_resume_never_takes_a_ci_run_folder(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: the newest folder by name won, and `ci-...` sorts after every bench run's UTC
    time: bench --resume aggregated (and would have measured into) ci's folder."""
    results = tmp_path / "results"
    _results_here(recipe, results)
    bench = _run_with_cells(results / "20260101T000000Z", 1_700_000_000)
    ci = _run_with_cells(results / "ci-cpu_tiny_moe-20260102-000000", 1_800_000_000)
    (ci / "ci-serve.log").write_text("ci's server\n")
    (results / "serve-20260103-000000").mkdir()
    (results / "serve-20260103-000000" / "server.log").write_text("a served run\n")
    assert main(["bench", str(recipe), "--resume", "--no-plots"]) == 0, capsys.readouterr().err
    assert (bench / "aggregate.json").is_file()
    assert not (ci / "aggregate.json").exists()


def test_resume_takes_the_run_whose_results_were_written_last(
    recipe: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before: a bench run named by --run-dir (`baseline`) sorted after every UTC-time name."""
    results = tmp_path / "results"
    _results_here(recipe, results)
    old = _run_with_cells(results / "baseline", 1_700_000_000)
    new = _run_with_cells(results / "20260101T000000Z", 1_800_000_000)
    assert main(["bench", str(recipe), "--resume", "--no-plots"]) == 0, capsys.readouterr().err
    assert (new / "aggregate.json").is_file()
    assert not (old / "aggregate.json").exists()
