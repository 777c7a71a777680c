"""From a Recipe to what the bench needs: cells, matrix rows, a cell deadline, and provenance.

The rest of m3patch.bench works on plain values (cells, rows); this module is the one place that
reads m3patch.recipe.loader's dataclasses, so a recipe schema change touches one file.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import Any

from m3patch.bench.cells import AgenticCell, AnyCell, Cell, Parallelism, sweep_cells
from m3patch.bench.matrix import MatrixRecipe
from m3patch.errors import UsageError
from m3patch.fsio import read_state
from m3patch.patching.ledger import digest, ledger_path, read_ledger
from m3patch.patching.locate import find_vllm
from m3patch.patching.series import load_series
from m3patch.recipe.loader import Recipe
from m3patch.recipe.server_groups import server_groups

IMAGE_ENV = "M3PATCH_IMAGE"
# `vllm bench serve` spends ~11 s importing before its first request on a 2-core CPU
# (vllm-cpu.md §4) and tokenizes every prompt up front; this covers both on slow machines.
CLIENT_STARTUP_S = 120.0
SESSION_SERVER = "m3patch serve"
# InferenceX's search spaces allow spec-decoding mtp | draft_model | none, and label its EAGLE3
# runs (MiniMax-M3 with the EAGLE3 draft head) mtp.
INFERENCEX_SPEC = {"eagle": "mtp", "eagle3": "mtp", "mtp": "mtp", "draft_model": "draft_model"}


def parallelism_of(recipe: Recipe) -> Parallelism:
    par = recipe.parallelism
    topo = recipe.topology
    if topo is not None and topo.is_dp:
        # A multi-node DP set: DP is the roles' total; vLLM's EP switch spans every rank.
        dp = topo.dp_size
        ep_on = any("--enable-expert-parallel" in args for args in
                    (recipe.vllm_args, *(r.vllm_args for r in topo.roles)))
        return Parallelism(tp=par.tp, pp=1, ep=par.tp * dp if ep_on else 1, dp=dp,
                           dp_attention=False)
    return Parallelism(tp=par.tp, pp=1, ep=par.ep, dp=par.dp, dp_attention=par.dp_attention)


@contextmanager
def in_recipe(recipe: Recipe) -> Iterator[None]:
    """Name the recipe in a sweep error raised by the pure cell code."""
    try:
        yield
    except UsageError as exc:
        msg = f"{recipe.path}: sweep: {exc.message}"
        raise UsageError(msg, hint=exc.hint) from None


def recipe_cells(recipe: Recipe) -> tuple[AnyCell, ...]:
    """The recipe's sweep cells: what `bench` runs, `bench --only` selects from, `matrix` emits."""
    if recipe.sweep.agentic is not None:
        return agentic_cells(recipe)
    return fixed_cells(recipe)


def agentic_cells(recipe: Recipe) -> tuple[AgenticCell, ...]:
    """One cell per (row, concurrency) of an agentic-coding sweep, in the recipe's order."""
    scenario = recipe.sweep.agentic
    assert scenario is not None, "an agentic-coding recipe"
    par = parallelism_of(recipe)
    return tuple(
        AgenticCell(par, conc, row.kv_offload, scenario.trace.label, scenario.duration_s,
                    scenario.request_count, scenario.warmup_request_count)
        for row in scenario.rows for conc in row.concurrencies)


def fixed_cells(recipe: Recipe) -> tuple[Cell, ...]:
    """The fixed-seq-len cells of the recipe's isl/osl rows."""
    sweep = recipe.sweep
    rows = [(row.isl, row.osl, row.concurrencies) for row in sweep.rows]
    with in_recipe(recipe):
        cells = sweep_cells(rows, parallelism_of(recipe), sweep.range_ratio,
                            sweep.prompts_per_concurrency, sweep.warmups_per_concurrency,
                            convention=sweep.length_convention)
    return tuple(replace(cell, chat=sweep.chat) for cell in cells) if sweep.chat else cells


def cell_deadline_s(recipe: Recipe, cell: AnyCell) -> float:
    """Worst case the recipe allows: every wave of `concurrency` requests takes request-s (an
    agentic cell: its duration, then one request-s for the requests still in flight)."""
    if isinstance(cell, AgenticCell):
        warm = math.ceil(cell.warmup_request_count / cell.concurrency)
        if cell.duration_s is not None:
            return CLIENT_STARTUP_S + cell.duration_s + (warm + 1) * recipe.deadlines.request_s
        assert cell.request_count is not None
        waves = warm + math.ceil(cell.request_count / cell.concurrency)
        return CLIENT_STARTUP_S + waves * recipe.deadlines.request_s
    waves = math.ceil((cell.num_prompts + cell.num_warmups) / cell.concurrency)
    return CLIENT_STARTUP_S + waves * recipe.deadlines.request_s


def matrix_recipe(recipe: Recipe, shown_path: str) -> MatrixRecipe:
    cells = recipe_cells(recipe)
    groups = server_groups(recipe, cells)
    return MatrixRecipe(
        path=shown_path, name=recipe.name, platform=recipe.target.platform,
        image=recipe.target.image, model=recipe.model.source_text or recipe.model.source,
        parallelism=parallelism_of(recipe),
        cells=cells, groups=tuple(g.cell_ids for g in groups),
        group_max_model_lens=tuple(max_model_len_of(g.recipe.vllm_args) for g in groups),
        eval_tasks=tuple(t.task for t in recipe.eval.tasks) if recipe.eval else (),
    )  # fmt: skip


def max_model_len_of(argv: tuple[str, ...]) -> int | None:
    """The --max-model-len a server's arguments give it (None: vLLM takes the model's own)."""
    for index, arg in enumerate(argv[:-1]):
        if arg == "--max-model-len" and argv[index + 1].isdigit():
            return int(argv[index + 1])
    return None


def image_of(recipe: Recipe) -> str | None:
    named = recipe.inferencex.image if recipe.inferencex else None
    return os.environ.get(IMAGE_ENV) or recipe.target.image or named


def inferencex_identity(recipe: Recipe) -> dict[str, Any]:
    """InferenceX's identity of the recipe's results, as provenance keys (docs/inferencex-fields.md).

    `spec_decoding` in InferenceX's vocabulary (mtp | draft_model | none: its EAGLE/EAGLE3 runs
    are labelled mtp); m3patch's own `speculative_method` keeps the method vLLM ran."""
    ident = recipe.inferencex
    method = speculative_method(recipe)
    raw = dict(recipe.vllm_args_raw)
    return {
        "hw": ident.hw if ident else None, "precision": ident.precision if ident else None,
        "infmax_model_prefix": ident.model_prefix if ident else None,
        "framework": ident.framework if ident else None,
        "spec_decoding": INFERENCEX_SPEC.get(method, method), "speculative_method": method,
        "dcp_size": _size(raw.get("decode-context-parallel-size")),
        "pcp_size": _size(raw.get("prefill-context-parallel-size")),
    }  # fmt: skip


def _size(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 1


def provenance(recipe: Recipe, python: str | None, server: str) -> dict[str, Any]:
    """Where the numbers came from: recipe bytes, series and patch hashes, vLLM, image, GPUs.

    Read from the tree the server imports (its ledger, if any) and the series lock. `server`
    says who started the server: "m3patch serve" (tree verified, markers gated) or "external".
    A tree without a ledger is an unpatched baseline: series null, no patches.
    """

    tree = find_vllm(python=python)
    ledger = read_ledger(tree.root)
    base: dict[str, Any] = {
        "recipe": str(Path(recipe.path).resolve()), "recipe_name": recipe.name,
        "recipe_sha256": digest(Path(recipe.path).read_bytes()),
        "platform": recipe.target.platform, "image": image_of(recipe),
        "gpu_count": parallelism_of(recipe).gpu_count,
        "vllm_version": tree.version, "vllm_commit": tree.commit, "vllm_root": str(tree.root),
        "series": None, "patches": [], "ledger_sha256": None, "server": server,
        "verified": server == SESSION_SERVER, **inferencex_identity(recipe),
    }  # fmt: skip
    if ledger is None:
        return base
    base.update(series=ledger.series, patches=_patch_hashes(recipe, ledger.patches),
                ledger_sha256=digest(read_state(ledger_path(tree.root))),
                vllm_version=ledger.vllm_version, vllm_commit=ledger.vllm_commit)
    return base


def speculative_method(recipe: Recipe) -> str:
    """The recipe's speculative method as vLLM runs it, or "none"."""
    if recipe.speculative_json is None:
        return "none"
    method = json.loads(recipe.speculative_json).get("method")
    return method if isinstance(method, str) else "none"


def _patch_hashes(recipe: Recipe, patch_ids: tuple[str, ...]) -> list[dict[str, str | None]]:
    lock = load_series(recipe.series_dir).lock
    pins = {pin.id: pin.sha256 for pin in lock.patches} if lock else {}
    return [{"id": pid, "sha256": pins.get(pid)} for pid in patch_ids]
