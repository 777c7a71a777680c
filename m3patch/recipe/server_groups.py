"""Cells grouped by the server they need (pure): each cell's server is the recipe with the
overrides of every sweep region the cell falls in (recipe.regions) and, with
`sweep.max-model-len: per-cell`, its own max-model-len; cells with the same server form a group.
Kept apart from recipe.regions, which the recipe loader uses to read the schema: this module
works on the loaded Recipe, so it sits above the loader.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from m3patch.recipe.agentic import KvOffload, kv_offload_args, kv_offload_markers
from m3patch.recipe.launch import flatten_vllm_args
from m3patch.recipe.loader import Recipe
from m3patch.recipe.regions import MAX_MODEL_LEN_MARGIN


@dataclass(frozen=True)
class ServerGroup:
    """One server form and the cells (ids, in run order) measured against it."""

    index: int
    recipe: Recipe  # the recipe with this group's vllm-args and env
    cell_ids: tuple[str, ...]


def agentic_variant(recipe: Recipe, kv_offload: KvOffload, conc: int) -> Recipe:
    """The recipe as an agentic cell's server needs it: InferenceX's --max-num-seqs 2 x CONC
    (with `max-num-seqs: per-concurrency`) and the row's KV-offload arguments and markers."""
    scenario = recipe.sweep.agentic
    assert scenario is not None, "an agentic-coding recipe"
    args: dict[str, Any] = dict(recipe.vllm_args_raw)
    if scenario.max_num_seqs_per_concurrency:
        args["max-num-seqs"] = 2 * conc
    budget = scenario.dram_budget_gb(recipe.parallelism.tp) if kv_offload.tier == "dram" else 0
    args.update(kv_offload_args(kv_offload, budget, recipe.parallelism.tp,
                                recipe.target.platform))
    markers = recipe.markers + kv_offload_markers(kv_offload)
    spec_json = recipe.speculative_json
    if scenario.speculative and spec_json is not None:
        spec_json = json.dumps({**json.loads(spec_json), **dict(scenario.speculative)})
    return replace(recipe, vllm_args=flatten_vllm_args(args), markers=markers,
                   speculative_json=spec_json)


def server_variant(recipe: Recipe, isl: int, osl: int, conc: int) -> Recipe:
    """The recipe as the server for this cell needs it."""
    sweep = recipe.sweep
    matching = [r for r in sweep.regions if r.matches(isl, osl, conc)]
    if not matching and not sweep.per_cell_max_model_len:
        return recipe
    args: dict[str, Any] = dict(recipe.vllm_args_raw)
    env: dict[str, str] = dict(recipe.env)
    for region in matching:
        args.update(region.vllm_args)
        env.update(region.env)
    if sweep.per_cell_max_model_len:
        args["max-model-len"] = isl + osl + MAX_MODEL_LEN_MARGIN
    return replace(recipe, vllm_args=flatten_vllm_args(args), env=tuple(env.items()))


def server_groups(recipe: Recipe, cells: Sequence[Any]) -> tuple[ServerGroup, ...]:
    """Cells grouped by the server they need, groups in the order their first cell runs."""
    by_form: dict[tuple[object, ...], tuple[Recipe, list[str]]] = {}
    for cell in cells:
        if hasattr(cell, "kv_offload"):  # an agentic cell: its tier and concurrency decide
            variant = agentic_variant(recipe, cell.kv_offload, cell.concurrency)
        else:
            variant = server_variant(recipe, cell.seq.isl, cell.seq.osl, cell.concurrency)
        key = (variant.vllm_args, variant.env)
        by_form.setdefault(key, (variant, []))[1].append(cell.cell_id)
    return tuple(ServerGroup(i, variant, tuple(ids))
                 for i, (variant, ids) in enumerate(by_form.values(), start=1))

