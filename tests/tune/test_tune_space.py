"""CPU tests for the tuner's search space: vLLM's default is never pruned, and the one
pruning rule that claims exact equivalence (GROUP_SIZE_M) is checked against the kernel's own
program-id mapping, read from the 0.33.0 source."""

from __future__ import annotations

import dataclasses
import itertools

import pytest

from m3patch.patching.pristine import pristine_tree
from m3patch.tune import kernel_source, naming, space
from m3patch.tune.shapes import DEFAULT_BATCH_SIZES, MoEShape
from m3patch.tune.space import FULL_AXES, REDUCED_BF16_AXES, TileConfig

BLOCK = (128, 128)
EP8 = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", BLOCK, True)
TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", BLOCK, False)
# The M3 deployments of shared/design/vllm-0.33.md §4.3 plus other families' shapes
# (DeepSeek-like 256 experts top-8, Mixtral-like 8 experts top-2, top-1 routing).
FP8_SHAPES = (EP8, TP8, MoEShape(129, 384, 6144, 4, "fp8_w8a8", BLOCK),
              MoEShape(128, 768, 6144, 4, "fp8_w8a8", BLOCK),
              MoEShape(32, 3072, 6144, 4, "fp8_w8a8", BLOCK, True),
              MoEShape(128, 1536, 6144, 4, "fp8_w8a8", BLOCK),
              MoEShape(256, 256, 7168, 8, "fp8_w8a8", BLOCK),
              MoEShape(8, 14336, 4096, 2, "fp8_w8a8", BLOCK),
              MoEShape(64, 1024, 2048, 1, "fp8_w8a8", BLOCK, True))
ALL_SHAPES = FP8_SHAPES + tuple(dataclasses.replace(s, dtype="bf16", block_shape=None)
                                for s in FP8_SHAPES)
BATCHES = sorted({*DEFAULT_BATCH_SIZES, 3, 5, 7, 12, 17, 33, 65, 100, 129, 300, 513, 700, 5000})


@pytest.mark.parametrize("rocm", [False, True])
@pytest.mark.parametrize("shape", ALL_SHAPES, ids=lambda s: s.key)
def test_no_rule_prunes_vllms_default(shape: MoEShape, rocm: bool) -> None:
    """The rules on their own, before the safety net that appends the default."""
    for batch in BATCHES:
        default = naming.default_config(shape, batch, rocm=rocm)
        assert space.keep_config(default, shape, batch, rocm=rocm), (batch, default.key)
        kept = space.drop_group_duplicates(
            [dataclasses.replace(default, group_m=g) for g in FULL_AXES.group_m] + [default],
            shape, batch, default)
        assert default in kept, (batch, default.key)


@pytest.mark.parametrize("shape", FP8_SHAPES, ids=lambda s: s.key)
def test_default_is_in_the_full_grid_itself(shape: MoEShape) -> None:
    """The full axes contain every default, so it is timed like any other config (not only
    appended): the same compile and quick pass, the same chance to be refined."""
    grid = set(space.all_configs(FULL_AXES))
    for batch in BATCHES:
        assert naming.default_config(shape, batch) in grid
        plan = space.configs_for_batch(shape, batch, FULL_AXES)
        assert naming.default_config(shape, batch) in plan


def test_reduced_bf16_space_still_holds_the_default() -> None:
    bf16 = dataclasses.replace(TP8, dtype="bf16", block_shape=None)
    plan = space.space_for_shape(bf16, DEFAULT_BATCH_SIZES, REDUCED_BF16_AXES)
    for batch, configs in plan.items():
        assert naming.default_config(bf16, batch) in configs, batch
    # At 8192 the BF16 default has BLOCK_M 128, outside the reduced grid: appended.
    assert TileConfig(128, 128, 64, 1, 8, 3) in plan[8192]


def test_the_first_h200_runs_missing_defaults_are_now_timed() -> None:
    """The first H200 tuning run: EP8 M=64 and M=128 picked configs slower than the default, which
    the old rules (G>1 with one tile per expert; BLOCK_M above tokens/expert) had dropped."""
    for batch, expected in ((64, TileConfig(16, 128, 128, 32, 4, 3)),
                            (128, TileConfig(64, 128, 128, 32, 4, 3))):
        assert naming.default_config(EP8, batch) == expected
        assert expected in space.configs_for_batch(EP8, batch, FULL_AXES)


def test_space_stays_small_enough_for_one_device_call() -> None:
    full = len(space.all_configs(FULL_AXES))
    for shape in (EP8, TP8):
        plan = space.space_for_shape(shape, DEFAULT_BATCH_SIZES, FULL_AXES)
        assert max(len(c) for c in plan.values()) < full / 4
        for batch, configs in plan.items():
            for cfg in configs:  # the block-FP8 launch clamp: no K tile deeper than the block
                assert cfg.block_k <= 128 and 128 % cfg.block_n == 0, (batch, cfg.key)
                assert space.fits_shared_memory(cfg, 1)


def test_block_m_and_short_tile_rules_follow_tokens_per_expert() -> None:
    assert space.uses_naive_assignment(TP8, 8) and not space.uses_naive_assignment(TP8, 9)
    assert not space.uses_naive_assignment(EP8, 1)  # EP passes an expert map: always aligned
    assert {c.block_m for c in space.configs_for_batch(TP8, 1, FULL_AXES)} == {16}
    # 3 tokens per expert: taller than the tokens, but up to vLLM's own 64-row tile.
    assert {c.block_m for c in space.configs_for_batch(TP8, 96, FULL_AXES)} == {16, 32, 64}
    big = space.configs_for_batch(EP8, 8192, FULL_AXES)  # 2048 tokens per expert
    assert {c.block_m for c in big} == {64, 128}
    assert {c.group_m for c in big} == {1, 16, 32}


# ---------------------------------------------------------------- GROUP_SIZE_M equivalence


def _program_order(num_pid_m: int, num_pid_n: int, group_m: int) -> list[tuple[int, int]]:
    """fused_moe_kernel's pid -> (pid_m, pid_n), the lines test_mapping_is_the_kernels checks."""
    order = []
    for pid in range(num_pid_m * num_pid_n):
        num_pid_in_group = group_m * num_pid_n
        group_id = pid // num_pid_in_group
        first_pid_m = group_id * group_m
        group_size_m = min(num_pid_m - first_pid_m, group_m)
        order.append((first_pid_m + ((pid % num_pid_in_group) % group_size_m),
                      (pid % num_pid_in_group) // group_size_m))
    return order


def test_mapping_is_the_kernels() -> None:
    src = (pristine_tree("0.33.0") / kernel_source.FUSED_MOE_RELPATH).read_text(encoding="utf-8")
    kernel = next(t for t in kernel_source.extract_kernel_functions(src)
                  if "def fused_moe_kernel(" in t)
    for line in ("num_pid_m = tl.cdiv(EM, BLOCK_SIZE_M)",
                 "num_pid_in_group = GROUP_SIZE_M * num_pid_n",
                 "group_id = pid // num_pid_in_group",
                 "first_pid_m = group_id * GROUP_SIZE_M",
                 "group_size_m = min(num_pid_m - first_pid_m, GROUP_SIZE_M)",
                 "pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)",
                 "pid_n = (pid % num_pid_in_group) // group_size_m"):
        assert line in kernel, line
    assert "max_num_tokens_padded = topk_ids.numel() + num_experts * (block_size - 1)" in (
        pristine_tree("0.33.0") / "vllm/model_executor/layers/fused_moe/moe_align_block_size.py"
    ).read_text(encoding="utf-8")


@pytest.mark.parametrize("shape", [EP8, TP8, FP8_SHAPES[7]], ids=lambda s: s.key)
def test_dropped_group_sizes_launch_the_same_schedule(shape: MoEShape) -> None:
    """Exactly the configs whose program order equals a kept one's are dropped."""
    num_pid_n = -(-2 * shape.width // 64)
    for batch, block_m in itertools.product((1, 2, 4, 16, 64, 256), (16, 64)):
        tiles = space.m_tiles(shape, batch, block_m)
        configs = [TileConfig(block_m, 64, 128, g, 4, 3) for g in FULL_AXES.group_m]
        kept = space.drop_group_duplicates(configs, shape, batch, configs[0])
        orders = {cfg.group_m: _program_order(tiles, num_pid_n, cfg.group_m) for cfg in configs}
        for cfg in configs:
            if cfg not in kept:
                assert any(orders[cfg.group_m] == orders[k.group_m] for k in kept), cfg.key
        kept_orders = [orders[k.group_m] for k in kept]
        assert len(kept_orders) == len({tuple(o) for o in kept_orders}), (batch, block_m)


def test_m_tiles_matches_the_alignment_the_tuner_launches() -> None:
    torch = pytest.importorskip("torch")
    from m3patch.tune import inputs

    gen = torch.Generator().manual_seed(0)
    for shape, batch, block_m in ((EP8, 1, 16), (EP8, 64, 64), (TP8, 16, 16), (TP8, 300, 64)):
        ids, _ = inputs.random_routing(batch, shape, gen, "cpu")
        align = inputs.moe_align_block_size(ids, block_m, shape.num_experts)
        assert -(-align.sorted_ids.numel() // block_m) == space.m_tiles(shape, batch, block_m)
    assert space.m_tiles(TP8, 2, 16) == 8  # naive path: one tile per (token, expert)
