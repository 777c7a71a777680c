"""Tile-config search space and its pruning per batch size. Pure.

The space always holds vLLM's own default config for each batch size (`naming.default_config`):
a tuned pick must be measured against the fallback it replaces, and a search that cannot see
the default can pick something slower (the first H200 tuning run did, at EP8 M=64 and M=128).
Every rule below is stated relative to that default and tests/tune/test_tune_cpu.py checks, for the
M3 shapes and others, that no rule ever drops it. The rules:

- block FP8 clamps BLOCK_SIZE_K to the quant block at launch, so a deeper K tile is the same
  kernel as the clamped one (exact duplicate);
- GROUP_SIZE_M at or above the number of M tiles gives one and the same program order
  (exact duplicate; the default's value, else the largest, is the one kept);
- BLOCK_SIZE_M taller than both the tokens an expert receives and the default's BLOCK_SIZE_M
  only adds padding rows; short M tiles at >= 256 tokens per expert re-read the weights;
- warp counts far from the tile size, 64-deep K tiles for compute-bound FP8, N tiles wider
  than the quant block and configs over the shared-memory limit are heuristics that the
  default never meets.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass, replace

from m3patch.tune.naming import default_config
from m3patch.tune.shapes import MoEShape
from m3patch.tune.tile import TileConfig

SMEM_LIMIT_BYTES = 227 * 1024  # H100/H200 per-block opt-in shared memory

__all__ = ["FULL_AXES", "REDUCED_BF16_AXES", "SpaceAxes", "TileConfig", "space_for_shape"]


@dataclass(frozen=True)
class SpaceAxes:
    block_m: tuple[int, ...] = (16, 32, 64, 128)
    block_n: tuple[int, ...] = (32, 64, 128, 256)
    block_k: tuple[int, ...] = (64, 128, 256)
    group_m: tuple[int, ...] = (1, 16, 32)
    num_warps: tuple[int, ...] = (4, 8)
    num_stages: tuple[int, ...] = (2, 3, 4, 5)


FULL_AXES = SpaceAxes()
# BF16 is tuned only to find its own best config for the FP8-vs-BF16 comparison: a reduced grid.
REDUCED_BF16_AXES = SpaceAxes(block_m=(16, 32, 64), block_n=(64, 128), block_k=(64, 128),
                              group_m=(1, 16), num_warps=(4, 8), num_stages=(3, 4))


def uses_naive_assignment(shape: MoEShape, batch: int) -> bool:
    """vLLM skips moe_align_block_size (one token per M tile) when routing is this sparse
    (fused_moe.py _prepare_expert_assignment); with EP it always aligns (expert map)."""
    return not shape.expert_parallel and batch * shape.top_k * 4 <= shape.num_experts


def tokens_per_expert(shape: MoEShape, batch: int) -> float:
    return batch * shape.top_k / shape.num_experts


def m_tiles(shape: MoEShape, batch: int, block_m: int) -> int:
    """`num_pid_m` of the kernel: cdiv(EM, BLOCK_SIZE_M), EM being the length of the sorted
    token ids that moe_align_block_size allocates (or numel * BLOCK_SIZE_M on the naive path)."""
    numel = batch * shape.top_k
    if uses_naive_assignment(shape, batch):
        return numel
    padded = numel + shape.num_experts * (block_m - 1)
    if numel < shape.num_experts:
        padded = min(numel * block_m, padded)
    return -(-padded // block_m)


def _next_pow2(value: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(value, 1.0))))


def fits_shared_memory(cfg: TileConfig, elem_bytes: int) -> bool:
    per_stage = (cfg.block_m + cfg.block_n) * cfg.block_k * elem_bytes
    return cfg.num_stages * per_stage <= SMEM_LIMIT_BYTES


def _block_fp8_duplicate(cfg: TileConfig, shape: MoEShape) -> bool:
    if shape.block_shape is None:
        return False
    group_n, group_k = shape.block_shape
    # K above the quant block is clamped at launch; N above it is a heuristic (vLLM's default
    # never exceeds block_shape[0]).
    return bool(group_k % cfg.block_k or group_n % cfg.block_n)


def keep_config(cfg: TileConfig, shape: MoEShape, batch: int, *, rocm: bool = False) -> bool:
    """True when the config is worth timing for this batch size (never False for the default)."""
    if _block_fp8_duplicate(cfg, shape):
        return False
    default = default_config(shape, batch, rocm=rocm)
    per_expert = 1.0 if uses_naive_assignment(shape, batch) else tokens_per_expert(shape, batch)
    if cfg.block_m > max(16, _next_pow2(per_expert), default.block_m):
        return False  # taller than the tokens and than vLLM's own tile: padding rows only
    if per_expert >= 256 and cfg.block_m < min(64, default.block_m):
        return False  # compute-bound: short tiles re-read the weights too often
    tile = cfg.block_m * cfg.block_n
    if cfg.num_warps == 8 and tile < 64 * 128:
        return False
    if cfg.num_warps == 4 and tile > 128 * 128:
        return False
    fp8 = shape.dtype == "fp8_w8a8"
    if fp8 and cfg.block_k == 64 and per_expert >= 64:
        return False  # fp8 compute-bound tiles want the full 128-deep block per scale load
    return fits_shared_memory(cfg, 1 if fp8 else 2)


def all_configs(axes: SpaceAxes) -> list[TileConfig]:
    grid = itertools.product(axes.block_m, axes.block_n, axes.block_k, axes.group_m,
                             axes.num_warps, axes.num_stages)
    return [TileConfig(*values) for values in grid]


def _prefer(cfg: TileConfig, held: TileConfig, default: TileConfig) -> bool:
    """Between two configs with one schedule: the default, else the larger GROUP_SIZE_M."""
    if held == default:
        return False
    return cfg == default or cfg.group_m > held.group_m


def drop_group_duplicates(configs: Iterable[TileConfig], shape: MoEShape, batch: int,
                          default: TileConfig) -> list[TileConfig]:
    """One config per distinct program order: GROUP_SIZE_M >= num_pid_m all give
    group_id 0 and group_size_m = num_pid_m, so they launch the same kernel schedule."""
    kept: dict[TileConfig, TileConfig] = {}
    for cfg in configs:
        tiles = m_tiles(shape, batch, cfg.block_m)
        schedule = replace(cfg, group_m=min(cfg.group_m, tiles))
        held = kept.get(schedule)
        if held is None or _prefer(cfg, held, default):
            kept[schedule] = cfg
    return sorted(kept.values())


def configs_for_batch(shape: MoEShape, batch: int, axes: SpaceAxes, *, rocm: bool = False
                      ) -> list[TileConfig]:
    """The pruned grid plus vLLM's default (added when the axes do not contain it, e.g. the
    reduced BF16 grid at large batch)."""
    default = default_config(shape, batch, rocm=rocm)
    kept = [cfg for cfg in all_configs(axes) if keep_config(cfg, shape, batch, rocm=rocm)]
    configs = drop_group_duplicates(kept, shape, batch, default)
    if default not in configs:
        configs.append(default)
    return sorted(configs)


def space_for_shape(shape: MoEShape, batches: Iterable[int], axes: SpaceAxes, *,
                    rocm: bool = False) -> dict[int, list[TileConfig]]:
    """Batch size -> configs to time; every list holds vLLM's default for that batch size."""
    return {batch: configs_for_batch(shape, batch, axes, rocm=rocm) for batch in batches}


def unique_configs(plans: Iterable[dict[int, list[TileConfig]]]) -> list[TileConfig]:
    """Every config some (shape, batch) will time: the set to compile up front."""
    seen: set[TileConfig] = set()
    for plan in plans:
        for configs in plan.values():
            seen.update(configs)
    return sorted(seen)
