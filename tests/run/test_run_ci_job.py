"""`m3patch ci`: step results, one exit code, the run folder (real tree; the serve step's child
fails for want of a model, which is a real failure of the real serve step, run in-process)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from core_helpers import gate_recorded_run

from m3patch.bench.runner import check_results
from m3patch.commands import ci
from m3patch.errors import ResultsInvalid
from m3patch.patching.ledger import ledger_path

REPO = Path(__file__).resolve().parents[2]


def _recipe(tmp_path: Path) -> Path:
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = text.replace('vllm-version: "0.32.0"', 'vllm-version: "0.33.0"')
    # the committed test series (stable lock) rather than patches/vllm-0.33.0, which moves
    text = text.replace("series: vllm-0.32.0", f"series: {REPO}/tests/data/test-series")
    text = text.replace("${M3PATCH_TINY_MODEL:-~/.cache/m3patch/tiny-moe}", str(tmp_path / "no-model"))
    text = text.replace("${M3PATCH_CPU_VENV:-~/.cache/m3patch/vllm-cpu-venv}/bin/python", sys.executable)
    text = text.replace("range-ratio: 1.0", "range-ratio: 0.8")  # vLLM's client rejects 1.0
    text = text.split("\neval:")[0] + "\n"  # the job's steps; the gate: test_serving_eval.py
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def _ci(tmp_path: Path, recipe: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "m3patch", "ci", str(recipe), "--run-dir", str(tmp_path / "run")]
    return subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, **env},
                          cwd=REPO, check=False, timeout=300)


def test_bad_recipe_fails_first_step_and_skips_the_rest(tmp_path: Path) -> None:
    done = _ci(tmp_path, tmp_path / "missing.yaml", {})
    assert done.returncode == 2, done.stderr
    # no run folder is known before the recipe names one, unless --run-dir gave it
    summary = json.loads((tmp_path / "run" / ci.SUMMARY).read_text())
    assert [(s["name"], s["status"]) for s in summary["steps"]] == [
        ("recipe", "failed"), ("apply-verify", "skipped"), ("serve-sweep", "skipped"),
        ("results", "skipped")]
    assert summary["exit_code"] == 2
    assert "Traceback" not in done.stderr


def test_apply_verify_on_the_real_tree_then_the_serve_steps_exit_code_is_the_jobs(
    tmp_path: Path, vllm_tree: Path
) -> None:
    # A model folder the pre-apply check accepts; this interpreter has no vllm, so the serve
    # step gets past apply and fails when it starts the server.
    (tmp_path / "no-model").mkdir()
    (tmp_path / "no-model" / "config.json").write_text("{}")
    done = _ci(tmp_path, _recipe(tmp_path), {"M3PATCH_VLLM_ROOT": str(vllm_tree)})
    summary = json.loads((tmp_path / "run" / ci.SUMMARY).read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert "model files on disk; launch checked by static checks" in steps["recipe"]["message"]
    # vLLM's own parser is not asked before the start: it answers beside the server
    assert "answers alongside the start" in steps["recipe"]["message"]
    assert steps["apply-verify"]["status"] == "ok", done.stderr
    assert steps["apply-verify"]["message"].endswith("0 conflicts")
    copied = (tmp_path / "run" / "ledger.json").read_bytes()
    assert copied == ledger_path(vllm_tree).read_bytes()  # the ledger artifact is the tree's own
    assert steps["serve-sweep"]["status"] == "failed"
    assert steps["serve-sweep"]["exit_code"] == done.returncode == summary["exit_code"] == 10
    # the server's own error (ServerExited: this interpreter cannot import vllm)
    assert "No module named 'vllm'" in (tmp_path / "run" / "server.log").read_text()
    assert steps["results"]["status"] == "skipped"


def test_resume_of_a_finished_run_passes_in_process_without_a_tree_or_server(tmp_path: Path) -> None:
    """The recorded real run stands in for a finished sweep: ci --resume re-aggregates, re-reads
    and plots it, touching no tree (apply-verify skipped) and starting no server."""
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)  # the recorded run's shape
    recipe = tmp_path / "cpu_tiny_moe.yaml"
    recipe.write_text(text.replace("series: vllm-", f"series: {REPO}/patches/vllm-"))
    run = shutil.copytree(REPO / "tests" / "data" / "bench" / "runs" / "base", tmp_path / "run")
    gate_recorded_run(run, recipe, eval_passed=True)
    cmd = [sys.executable, "-m", "m3patch", "ci", str(recipe), "--resume", "--run-dir", str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    steps = json.loads((run / ci.SUMMARY).read_text())["steps"]
    assert [(s["name"], s["status"]) for s in steps] == [
        ("recipe", "ok"), ("apply-verify", "skipped"), ("serve-sweep", "ok"), ("results", "ok"),
        ("eval", "skipped")]  # no server to ask: every cell was already measured
    assert steps[3]["message"] == "3 cells, aggregate ok, 2 plots"
    assert "aggregated" in (run / ci.SERVE_LOG).read_text()  # the step's own output, teed
    assert not (run / "ledger.json").exists() and not (run / "server.log").exists()
    assert sorted(p.name for p in (run / "plots").glob("*.png")) == [
        "interactivity_vs_throughput.png", "throughput_per_gpu.png"]
    assert "ci: all steps passed" in done.stderr and done.stdout == ""


def _recorded(tmp_path: Path) -> tuple[Path, Path]:
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)
    text = text.replace("task-dir: evals/", f"task-dir: {REPO}/recipes/evals/")
    # no model on disk: a resume that must measure again fails before any server starts (19)
    text = text.replace("${M3PATCH_TINY_MODEL:-~/.cache/m3patch/tiny-moe}", str(tmp_path / "none"))
    recipe = tmp_path / "cpu_tiny_moe.yaml"
    recipe.write_text(text.replace("series: vllm-", f"series: {REPO}/patches/vllm-"))
    return recipe, shutil.copytree(REPO / "tests" / "data" / "bench" / "runs" / "base",
                                   tmp_path / "run")


@pytest.mark.parametrize("case", ["eval-failed", "eval-missing", "ungated-cells", "other-recipe"])
def test_resume_never_turns_a_failed_gate_or_ungated_cells_into_a_pass(tmp_path: Path,
                                                                        case: str) -> None:
    """Before: with finished cells and eval/eval.json `passed: false`, `ci --resume` skipped
    apply-verify, serve and eval, printed "all steps passed" and wrote ci.json ok: true; it also
    kept cells of an ungated external server (verified: false) under another recipe's hash.
    Now such a run has something left to measure or judge: it needs a server again (here the
    model is absent, so it fails before one starts), and never reports a pass."""
    recipe, run = _recorded(tmp_path)
    if case != "ungated-cells":
        gate_recorded_run(run, recipe, eval_passed=None if case == "eval-missing" else
                          case != "eval-failed")
    if case == "other-recipe":
        recipe.write_text(recipe.read_text() + "# edited after the run\n")
    cmd = [sys.executable, "-m", "m3patch", "ci", str(recipe), "--resume", "--run-dir", str(run)]
    done = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
    summary = json.loads((run / ci.SUMMARY).read_text())
    assert done.returncode != 0 and summary["ok"] is False, done.stderr
    assert "all steps passed" not in done.stderr


def test_results_without_cells_is_results_invalid(tmp_path: Path) -> None:
    with pytest.raises(ResultsInvalid, match="no per-cell result files under cells/"):
        check_results(tmp_path)


@pytest.mark.serve
@pytest.mark.slow
def test_ci_job_script_end_to_end_on_the_real_cpu_server(tmp_path: Path, tiny_model: Path) -> None:
    """scripts/ci_job.sh on the embedded default: real apply, vllm-cpu serve, sweep, results."""
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = text.replace("series: vllm-", f"series: {REPO}/patches/vllm-")
    text = text.replace("range-ratio: 1.0", "range-ratio: 0.8")  # m3patch bench rejects 1.0
    text = text.replace("task-dir: evals/", f"task-dir: {REPO}/recipes/evals/")
    # A `warn` marker on a warning this host's CPU worker logs: reported, the job still passes.
    text = text.replace("markers:\n", "markers:\n  warn:\n    - id: no-tcmalloc\n"
                        "      text: libtcmalloc is not found in LD_PRELOAD\n"
                        "      fix: preload libtcmalloc\n", 1)
    recipe = tmp_path / "cpu_tiny_moe.yaml"
    recipe.write_text(text)
    run_dir = tmp_path / "run"
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "ci_job.sh"), str(recipe), str(run_dir)],
        capture_output=True, text=True, check=False, timeout=900,
        env={**os.environ, "M3PATCH_PYTHON": sys.executable, "M3PATCH_TINY_MODEL": str(tiny_model)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((run_dir / ci.SUMMARY).read_text())
    assert [s["status"] for s in summary["steps"]] == ["ok"] * 5  # the last: the accuracy gate
    for artifact in ("server.log", "serve.json", "aggregate.json", "aggregate.csv", "ledger.json",
                     "eval/eval.json"):
        assert (run_dir / artifact).is_file(), artifact
    assert len(list((run_dir / "cells").glob("*.json"))) >= 2
    assert len(list(run_dir.rglob("*.png"))) == 2
    assert "m3patch[provenance]: series=vllm-0.32.0" in (run_dir / "server.log").read_text()
    # The results table prints once, after the gate, with its score on every line (teed)
    table = (run_dir / ci.EVAL_LOG).read_text().split("per-GPU results", 1)[1]
    assert "Accuracy" in table and re.search(r"tiny_arith [01]\.\d{4} \(min 0\.\d+\) ok", table)
    assert "per-GPU results" not in (run_dir / ci.SERVE_LOG).read_text()
    (warned,) = summary["warnings"]
    assert warned["id"] == "no-tcmalloc" and warned["fix"] == "preload libtcmalloc"
    assert "WARNING: no-tcmalloc (fix: preload libtcmalloc)" in summary["steps"][2]["message"] or \
        "no-tcmalloc" in done.stderr
    aggregate = json.loads((run_dir / "aggregate.json").read_text())
    assert "no-tcmalloc" in json.dumps(aggregate)  # beside the numbers, in the provenance
