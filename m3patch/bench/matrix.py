"""CI job list as a GitHub Actions `strategy.matrix` ({"include": [...]}), pure.

Conventions from InferenceX's generate_sweep_configs.py (anchors.md part 2 §3.2-3.3):
- concurrency doubles from conc-start with the last step clamped to conc-end (the recipe loader
  expands it; 1..6 gives 1, 2, 4, 6);
- TP-only rows are latency rows and start at concurrency 1 ("capturing the single-request
  latency point"): the shipped recipes write it in their rows (tests/recipe/test_recipe_schema.py);
- max-model-len = isl + osl + 256.
The cells come from cells.sweep_cells through spec.recipe_cells, the very cells
`m3patch bench RECIPE --only CELL` selects from; the matrix adds none of its own.
One job per cell by default (InferenceX's shape; each runs `m3patch bench RECIPE --only CELL`),
or one job per recipe with `per="recipe"`.

Eval jobs follow InferenceX's changelog modifiers, which both suppress the throughput jobs:
`evals-only` emits one eval job per recipe that declares an `eval:` section (the gate where one
is declared); `all-evals` emits one for every recipe given and refuses a recipe without one.
An eval job runs the recipe's accuracy gate (`m3patch eval`) against its server, once per
recipe: m3patch's eval does not depend on the sweep's concurrency.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from m3patch.bench.cells import AgenticCell, AnyCell, Cell, Parallelism, SeqLen
from m3patch.errors import UsageError

GITHUB_MATRIX_LIMIT = 256  # GitHub refuses a matrix with more jobs than this


@dataclass(frozen=True)
class MatrixRecipe:
    """What the matrix needs from one recipe (built from a Recipe by spec.matrix_recipe)."""

    path: str
    name: str
    platform: str
    image: str | None
    model: str
    parallelism: Parallelism
    cells: tuple[AnyCell, ...]  # from spec.recipe_cells, in run order
    eval_tasks: tuple[str, ...] = ()  # the recipe's eval task names; empty: no eval section
    groups: tuple[tuple[str, ...], ...] = ()  # cell ids per server group (recipe.regions)

    def group_of(self, cell_id: str) -> int:
        return next((i for i, ids in enumerate(self.groups, start=1) if cell_id in ids), 1)


def exp_name(recipe: MatrixRecipe, seq: SeqLen) -> str:
    label = seq.label if "/" not in seq.label else f"{seq.isl}x{seq.osl}"
    return f"{recipe.name}_{label}"


def agentic_job(recipe: MatrixRecipe, cell: AgenticCell) -> dict[str, Any]:
    """InferenceX's agentic matrix entry keys (scenario-type, kv-offloading, duration)."""
    par, kv = cell.parallelism, cell.kv_offload
    backend = {"name": kv.backend, "version": kv.version} if kv.backend else None
    return {
        "recipe": recipe.path, "name": recipe.name, "platform": recipe.platform,
        "image": recipe.image or "", "model": recipe.model,
        "exp-name": f"{recipe.name}_agentic_{kv.label}", "cell-id": cell.cell_id,
        "scenario-type": "agentic-coding", "conc": cell.concurrency,
        "kv-offloading": kv.tier, "kv-offload-backend": backend, "duration": cell.duration_s,
        "server-group": recipe.group_of(cell.cell_id),
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "dp-attn": par.dp_attention,
        "gpus": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def cell_job(recipe: MatrixRecipe, cell: AnyCell) -> dict[str, Any]:
    if isinstance(cell, AgenticCell):
        return agentic_job(recipe, cell)
    par = cell.parallelism
    return {
        "recipe": recipe.path, "name": recipe.name, "platform": recipe.platform,
        "image": recipe.image or "", "model": recipe.model,
        "exp-name": exp_name(recipe, cell.seq), "cell-id": cell.cell_id,
        "isl": cell.seq.isl, "osl": cell.seq.osl, "conc": cell.concurrency,
        "max-model-len": cell.seq.max_model_len, "random-range-ratio": cell.range_ratio,
        "length-convention": cell.length_convention, "server-group": recipe.group_of(cell.cell_id),
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "dp-attn": par.dp_attention,
        "gpus": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def recipe_job(recipe: MatrixRecipe, cells: Sequence[AnyCell]) -> dict[str, Any]:
    par = recipe.parallelism
    fixed = [cell for cell in cells if isinstance(cell, Cell)]
    return {
        "recipe": recipe.path, "name": recipe.name, "platform": recipe.platform,
        "image": recipe.image or "", "model": recipe.model, "cells": len(cells),
        "max-model-len": max((cell.seq.max_model_len for cell in fixed), default=None),
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "dp-attn": par.dp_attention,
        "gpus": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


class EvalJobs(str, Enum):
    NONE = "none"            # throughput jobs only (the default)
    EVALS_ONLY = "evals-only"  # eval jobs for the recipes that declare a gate; no throughput
    ALL_EVALS = "all-evals"    # an eval job for every recipe (each must declare one); no throughput


def eval_job(recipe: MatrixRecipe) -> dict[str, Any]:
    par = recipe.parallelism
    return {
        "recipe": recipe.path, "name": recipe.name, "platform": recipe.platform,
        "image": recipe.image or "", "model": recipe.model, "job": "eval",
        "eval-tasks": list(recipe.eval_tasks),
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "dp-attn": par.dp_attention,
        "gpus": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def eval_jobs(recipes: Sequence[MatrixRecipe], mode: EvalJobs) -> list[dict[str, Any]]:
    if mode is EvalJobs.ALL_EVALS:
        bare = [r.path for r in recipes if not r.eval_tasks]
        if bare:
            msg = f"all-evals: {', '.join(bare)} declare(s) no eval section"
            raise UsageError(msg, hint="add eval: tasks: [...] to it, or use --evals-only")
    return [eval_job(r) for r in recipes if r.eval_tasks]


def group_job(recipe: MatrixRecipe, index: int, cells: Sequence[AnyCell]) -> dict[str, Any]:
    """One server group: `m3patch bench RECIPE <only-args>` starts one server for it."""
    return {**recipe_job(recipe, cells), "server-group": index,
            "only-args": " ".join(f"--only {cell.cell_id}" for cell in cells)}


def _jobs(recipe: MatrixRecipe, per: str) -> list[dict[str, Any]]:
    if per == "cell":
        return [cell_job(recipe, c) for c in recipe.cells]
    if per == "group":
        groups = recipe.groups or (tuple(c.cell_id for c in recipe.cells),)
        return [group_job(recipe, i, [c for c in recipe.cells if c.cell_id in ids])
                for i, ids in enumerate(groups, start=1)]
    return [recipe_job(recipe, recipe.cells)]


def build_matrix(recipes: Sequence[MatrixRecipe], per: str = "cell",
                 evals: EvalJobs = EvalJobs.NONE) -> dict[str, Any]:
    jobs: list[dict[str, Any]] = []
    if evals is not EvalJobs.NONE:  # InferenceX: the eval modifiers suppress throughput
        return _limited(eval_jobs(recipes, evals))
    for recipe in recipes:
        jobs += _jobs(recipe, per)
    return _limited(jobs)


def _limited(jobs: list[dict[str, Any]]) -> dict[str, Any]:
    if len(jobs) > GITHUB_MATRIX_LIMIT:
        msg = f"the matrix has {len(jobs)} jobs; GitHub Actions accepts at most {GITHUB_MATRIX_LIMIT}"
        raise UsageError(msg, hint="pass fewer recipes, or --per recipe (one job per recipe)")
    return {"include": jobs}
