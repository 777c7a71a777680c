"""Tile-config search space and its pruning per batch size. Pure.

The pruning rules follow what the fused-MoE kernel does with a tile: rows of a BLOCK_SIZE_M tile
belong to one expert, so an M tile far taller than the tokens an expert receives is padding;
GROUP_SIZE_M only reorders M tiles, so it matters only when an expert has several; block-FP8
clamps BLOCK_SIZE_K to the quant block at launch, so larger K tiles are the same kernel.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterable
from dataclasses import dataclass

from m3patch.tune.shapes import MoEShape

SMEM_LIMIT_BYTES = 227 * 1024  # H100/H200 per-block opt-in shared memory


@dataclass(frozen=True, order=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return (f"M{self.block_m}-N{self.block_n}-K{self.block_k}-G{self.group_m}"
                f"-w{self.num_warps}-s{self.num_stages}")

    def to_vllm(self) -> dict[str, int]:
        """The dict vLLM's table holds for one batch size (and passes as **config)."""
        return {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n,
                "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_vllm(cls, entry: dict[str, int]) -> TileConfig:
        return cls(entry["BLOCK_SIZE_M"], entry["BLOCK_SIZE_N"], entry["BLOCK_SIZE_K"],
                   entry["GROUP_SIZE_M"], entry["num_warps"], entry["num_stages"])


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


def _next_pow2(value: float) -> int:
    return 1 << max(0, math.ceil(math.log2(max(value, 1.0))))


def fits_shared_memory(cfg: TileConfig, elem_bytes: int) -> bool:
    per_stage = (cfg.block_m + cfg.block_n) * cfg.block_k * elem_bytes
    return cfg.num_stages * per_stage <= SMEM_LIMIT_BYTES


def keep_config(cfg: TileConfig, shape: MoEShape, batch: int) -> bool:
    """True when the config is worth timing for this batch size."""
    if shape.block_shape is not None:
        group_n, group_k = shape.block_shape
        if group_k % cfg.block_k or group_n % cfg.block_n:
            return False  # K above the quant block is clamped at launch: a duplicate
    per_expert = tokens_per_expert(shape, batch)
    if uses_naive_assignment(shape, batch):
        per_expert = 1.0  # one token per M tile
    if cfg.block_m > max(16, _next_pow2(per_expert)):
        return False  # the tile would be mostly padding rows
    if per_expert >= 256 and cfg.block_m < 64:
        return False  # compute-bound: short tiles re-read the weights too often
    if cfg.group_m > 1 and per_expert < 2 * cfg.block_m:
        return False  # one M tile per expert: grouping reorders nothing
    tile = cfg.block_m * cfg.block_n
    if cfg.num_warps == 8 and tile < 64 * 128:
        return False
    if cfg.num_warps == 4 and tile > 128 * 128:
        return False
    if cfg.block_k == 64 and per_expert >= 64 and shape.dtype == "fp8_w8a8":
        return False  # fp8 compute-bound tiles want the full 128-deep block per scale load
    elem = 1 if shape.dtype == "fp8_w8a8" else 2
    return fits_shared_memory(cfg, elem)


def all_configs(axes: SpaceAxes) -> list[TileConfig]:
    grid = itertools.product(axes.block_m, axes.block_n, axes.block_k, axes.group_m,
                             axes.num_warps, axes.num_stages)
    return [TileConfig(*values) for values in grid]


def configs_for_batch(shape: MoEShape, batch: int, axes: SpaceAxes) -> list[TileConfig]:
    return [cfg for cfg in all_configs(axes) if keep_config(cfg, shape, batch)]


def space_for_shape(shape: MoEShape, batches: Iterable[int], axes: SpaceAxes
                    ) -> dict[int, list[TileConfig]]:
    """Batch size -> configs to time; every list is non-empty (the space must cover each M)."""
    plan = {batch: configs_for_batch(shape, batch, axes) for batch in batches}
    empty = [batch for batch, configs in plan.items() if not configs]
    if empty:
        msg = f"{shape.key}: the search space leaves no config for batch sizes {empty}"
        raise ValueError(msg)
    return plan


def unique_configs(plans: Iterable[dict[int, list[TileConfig]]]) -> list[TileConfig]:
    """Every config some (shape, batch) will time: the set to compile up front."""
    seen: set[TileConfig] = set()
    for plan in plans:
        for configs in plan.values():
            seen.update(configs)
    return sorted(seen)
