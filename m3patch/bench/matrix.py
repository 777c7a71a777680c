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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from m3patch.bench.cells import Cell, Parallelism, SeqLen
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
    cells: tuple[Cell, ...]  # from cells.sweep_cells, in run order
    groups: tuple[tuple[str, ...], ...] = ()  # cell ids per server group (recipe.regions)

    def group_of(self, cell_id: str) -> int:
        return next((i for i, ids in enumerate(self.groups, start=1) if cell_id in ids), 1)


def exp_name(recipe: MatrixRecipe, seq: SeqLen) -> str:
    label = seq.label if "/" not in seq.label else f"{seq.isl}x{seq.osl}"
    return f"{recipe.name}_{label}"


def cell_job(recipe: MatrixRecipe, cell: Cell) -> dict[str, Any]:
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


def recipe_job(recipe: MatrixRecipe, cells: Sequence[Cell]) -> dict[str, Any]:
    par = recipe.parallelism
    return {
        "recipe": recipe.path, "name": recipe.name, "platform": recipe.platform,
        "image": recipe.image or "", "model": recipe.model, "cells": len(cells),
        "max-model-len": max(cell.seq.max_model_len for cell in cells),
        "tp": par.tp, "pp": par.pp, "ep": par.ep, "dp": par.dp, "dp-attn": par.dp_attention,
        "gpus": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def group_job(recipe: MatrixRecipe, index: int, cells: Sequence[Cell]) -> dict[str, Any]:
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


def build_matrix(recipes: Sequence[MatrixRecipe], per: str = "cell") -> dict[str, Any]:
    jobs: list[dict[str, Any]] = []
    for recipe in recipes:
        jobs += _jobs(recipe, per)
    if len(jobs) > GITHUB_MATRIX_LIMIT:
        msg = f"the matrix has {len(jobs)} jobs; GitHub Actions accepts at most {GITHUB_MATRIX_LIMIT}"
        raise UsageError(msg, hint="pass fewer recipes, or --per recipe (one job per recipe)")
    return {"include": jobs}
