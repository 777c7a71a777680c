"""`m3patch matrix --evals-only / --all-evals`: InferenceX's eval modifiers, throughput suppressed."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from m3patch.bench.matrix import EvalJobs, MatrixRecipe, build_matrix
from m3patch.bench.spec import matrix_recipe
from m3patch.errors import UsageError
from m3patch.recipe.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]


def shipped(name: str) -> MatrixRecipe:
    return matrix_recipe(load_recipe(REPO / "recipes" / f"{name}.yaml"), f"recipes/{name}.yaml")


def test_evals_only_is_one_eval_job_per_gated_recipe_and_no_throughput() -> None:
    gated, bare = shipped("mi300x_tp8"), replace(shipped("h200_tp8"), eval_tasks=())
    jobs = build_matrix([gated, bare], evals=EvalJobs.EVALS_ONLY)["include"]
    assert [(j["name"], j["job"], j["eval-tasks"], j["gpus"]) for j in jobs] == [
        ("mi300x_tp8", "eval", ["gsm8k"], 8)]
    assert all("conc" not in j for j in jobs)


def test_all_evals_refuses_a_recipe_without_a_gate() -> None:
    bare = replace(shipped("h200_tp8"), eval_tasks=())
    with pytest.raises(UsageError, match=r"all-evals: recipes/h200_tp8\.yaml declare"):
        build_matrix([shipped("mi300x_tp8"), bare], evals=EvalJobs.ALL_EVALS)


def test_default_matrix_has_no_eval_jobs() -> None:
    jobs = build_matrix([shipped("cpu_tiny_moe")])["include"]
    assert jobs and all("job" not in j for j in jobs)


def test_cli_flags_are_exclusive_and_emit_json() -> None:
    run = [sys.executable, "-m", "m3patch", "matrix"]
    done = subprocess.run([*run, "--all-evals", "recipes/mi300x_tp8.yaml", "recipes/h200_tp8.yaml"],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert done.returncode == 0, done.stderr
    assert [j["name"] for j in json.loads(done.stdout)["include"]] == ["mi300x_tp8", "h200_tp8"]
    both = subprocess.run([*run, "--all-evals", "--evals-only", "recipes/h200_tp8.yaml"],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert both.returncode == 2
