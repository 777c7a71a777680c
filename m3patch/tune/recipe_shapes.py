"""The MoE shape a recipe's deployment runs: model config + parallelism + shared-expert fusion.

Pure apart from reading the model's config.json, which must already be on this machine (a
local model directory in the recipe, `--model-config`, or the Hugging Face cache): m3patch
never downloads. The mapping mirrors vLLM 0.33.0 (shared/design/vllm-0.33.md §4.3):
with expert parallelism the experts split over TP x DP ranks and the width stays whole;
without it every rank holds every expert at width / (TP x DP); ROCm's AITER shared-expert
fusion adds the shared experts to the local ones and is off with EP.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import UsageError
from m3patch.fsio import read_json
from m3patch.recipe.loader import Recipe
from m3patch.recipe.model_files import env_hub_cache
from m3patch.tune.shapes import MoEShape, shapes_from_model_config

_TRUE = ("1", "true")
FSE_ENV = "VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS"


@dataclass(frozen=True)
class RecipeDeployment:
    """What decides the shape, as the recipe launches vLLM."""

    moe_ranks: int  # TP x DP: the ranks the MoE layers are split over
    expert_parallel: bool
    fused_shared_experts: bool


def deployment(recipe: Recipe) -> RecipeDeployment:
    par = recipe.parallelism
    # dp-attention launches TP1 x DP=tp with EP (Parallelism.argv); vLLM's EP and its
    # flattened MoE TP both span every TP x DP rank.
    ranks = par.tp if par.dp_attention else par.tp * par.dp
    ep = par.dp_attention or par.ep > 1
    env = dict(recipe.env)
    fse = (recipe.target.platform.startswith("rocm")
           and env.get("VLLM_ROCM_USE_AITER", "").lower() in _TRUE
           and env.get("VLLM_ROCM_USE_AITER_MOE", "1").lower() in _TRUE
           and env.get(FSE_ENV, "").lower() in _TRUE
           and not ep)  # vLLM refuses the fusion under EP (a warning, then unfused)
    return RecipeDeployment(ranks, ep, fse)


def hub_cache_dirs() -> list[Path]:
    """Where huggingface_hub keeps snapshots: the one lookup `model check` and the eval
    datasets use too, so the tuner reads the model config from the same cache."""
    return [env_hub_cache(os.environ)]


def _cached_hub_config(repo_id: str) -> Path | None:
    folder = "models--" + repo_id.replace("/", "--")
    for cache in hub_cache_dirs():
        snapshots = cache / folder / "snapshots"
        ref = cache / folder / "refs" / "main"
        if ref.is_file():
            pinned = snapshots / ref.read_text(encoding="utf-8").strip() / "config.json"
            if pinned.is_file():
                return pinned
        found = sorted(snapshots.glob("*/config.json")) if snapshots.is_dir() else []
        if found:
            return found[-1]
    return None


def model_config_path(recipe: Recipe, override: Path | None) -> Path:
    if override is not None:
        return override
    source = recipe.model.source
    if recipe.model.is_local:
        path = Path(source) / "config.json"
        if path.is_file():
            return path
        msg = (f"recipe {recipe.path}: model.source {source} has no config.json, so the "
               f"MoE shape cannot be derived")
        raise UsageError(msg, hint=f"pass --model-config PATH/config.json, or fix model.source "
                                   f"in {recipe.path}")
    cached = _cached_hub_config(source)
    if cached is not None:
        return cached
    where = ", ".join(str(d) for d in hub_cache_dirs())
    msg = (f"recipe {recipe.path}: model.source {source!r} is a Hugging Face id and its "
           f"config.json is not on this machine (looked in {where}); m3patch never downloads")
    raise UsageError(msg, hint=f"m3patch tune --recipe {recipe.path} --model-config "
                               f"/path/to/{source.rsplit('/', 1)[-1]}/config.json")


def read_model_config(path: Path) -> dict[str, Any]:
    # links: the Hugging Face cache links each snapshot file to its blob
    config: dict[str, Any] = read_json(path, error=UsageError, expect=dict, links=True,
                                       hint="pass the model's config.json with --model-config")
    return config


def shape_for_recipe(recipe: Recipe, *, model_config: Path | None, dtype: str,
                     block_shape: tuple[int, int] | None) -> MoEShape:
    if recipe.target.platform == "cpu":
        msg = (f"recipe {recipe.path} targets the CPU platform, which runs no fused-MoE "
               f"Triton kernel: there is nothing to tune")
        raise UsageError(msg, hint="pass a GPU recipe, e.g. m3patch tune --recipe "
                                   "recipes/h200_tp8.yaml")
    path = model_config_path(recipe, model_config)
    plan = deployment(recipe)
    return shapes_from_model_config(
        read_model_config(path), tp=plan.moe_ranks, ep=plan.expert_parallel,
        fused_shared_experts=plan.fused_shared_experts, dtype=dtype, block_shape=block_shape,
        where=str(path))
