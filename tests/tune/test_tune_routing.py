"""CPU tests for the routing a timing uses: vLLM's benchmark convention vs what one EP rank sees.

The tensor parts run on CPU torch (the alignment and the reference are plain torch ops); the
kernel itself is covered by the GPU tests.
"""

from __future__ import annotations

import pytest

from m3patch.errors import UsageError
from m3patch.tune.routing import ROUTING_DENSE, ROUTING_EP, Routing, routing_for
from m3patch.tune.shapes import MoEShape

EP8 = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", (128, 128), True)
TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
SMALL_EP = MoEShape(4, 64, 128, 2, "bf16", None, True)


def test_options_are_validated_against_the_shapes() -> None:
    assert routing_for("bench", None, (EP8, TP8)) == Routing()
    assert routing_for("ep-rank", 8, (EP8, TP8)) == Routing("ep-rank", 8)
    with pytest.raises(UsageError, match="needs an expert-parallel shape"):
        routing_for("ep-rank", 8, (TP8,))
    with pytest.raises(UsageError, match="--ep-ranks R >= 2"):
        routing_for("ep-rank", None, (EP8,))
    with pytest.raises(UsageError, match="only applies to --routing ep-rank"):
        routing_for("bench", 8, (EP8,))
    with pytest.raises(UsageError, match="not one of"):
        routing_for("global", 8, (EP8,))


def test_ep_rank_routing_applies_to_ep_shapes_and_keeps_its_own_cache_key() -> None:
    route = Routing("ep-rank", 8)
    assert route.for_shape(TP8) == Routing() and route.for_shape(EP8) == route
    assert route.global_experts(EP8) == 128 and Routing().global_experts(EP8) == 16
    assert route.cache_key(EP8) != Routing().cache_key(EP8) == EP8.key
    text = route.describe(EP8)
    assert "all 128" in text and "0..15" in text and "--ep-ranks 8" in text
    assert Routing().describe(EP8) == ROUTING_EP and Routing().describe(TP8) == ROUTING_DENSE


def _align_by_loop(ids: list[list[int]], block_m: int, local: int, global_experts: int
                   ) -> tuple[list[int], list[int], int]:
    """vLLM's moe_align with an expert map (ignore_invalid_experts): local pairs only."""
    flat = [e for row in ids for e in row]
    sorted_ids: list[int] = []
    tiles: list[int] = []
    for expert in range(local):
        idx = [i for i, e in enumerate(flat) if e == expert]
        idx += [len(flat)] * (-len(idx) % block_m)
        sorted_ids += idx
        tiles += [expert] * (len(idx) // block_m)
    return sorted_ids, tiles, len(sorted_ids)


@pytest.mark.parametrize(("batch", "block_m"), [(1, 16), (5, 16), (37, 16), (200, 64)])
def test_ep_rank_alignment_keeps_only_local_pairs_with_global_capacity(batch: int,
                                                                       block_m: int) -> None:
    torch = pytest.importorskip("torch")
    from m3patch.tune import inputs

    gen = torch.Generator().manual_seed(batch)
    ids, _ = inputs.random_routing(batch, SMALL_EP, gen, "cpu", global_experts=32)
    assert int(ids.max()) < 32 and ids.shape == (batch, 2)
    align = inputs.moe_align_block_size(ids, block_m, 32, local_experts=4)
    expected, tiles, total = _align_by_loop(ids.tolist(), block_m, 4, 32)
    assert int(align.num_post_padded.item()) == total
    assert align.sorted_ids[:total].tolist() == expected
    assert align.expert_ids[: total // block_m].tolist() == tiles
    capacity = ids.numel() + 32 * (block_m - 1)
    if ids.numel() < 32:
        capacity = min(ids.numel() * block_m, capacity)
    assert align.sorted_ids.numel() == -(-capacity // block_m) * block_m


def test_bench_alignment_is_unchanged_by_the_local_option() -> None:
    torch = pytest.importorskip("torch")
    from m3patch.tune import inputs

    gen = torch.Generator().manual_seed(5)
    ids, _ = inputs.random_routing(40, SMALL_EP, gen, "cpu")
    plain = inputs.moe_align_block_size(ids, 16, 4)
    local = inputs.moe_align_block_size(ids, 16, 4, local_experts=4)
    assert torch.equal(plain.sorted_ids, local.sorted_ids)
    assert torch.equal(plain.expert_ids, local.expert_ids)


def test_ep_rank_reference_zeroes_remote_pairs_and_the_checked_set_has_a_local_one() -> None:
    torch = pytest.importorskip("torch")
    from m3patch.tune import inputs

    weights = inputs.make_weights(SMALL_EP, "cpu")
    deq13, deq2 = inputs.dequantized(weights, SMALL_EP)
    for seed in range(20):  # M=1 over 32 experts: most draws miss this rank's 4
        gen = torch.Generator().manual_seed(seed)
        problem, ref1 = inputs.make_problem(SMALL_EP, 1, deq13, gen, "cpu", global_experts=32)
        local = problem.topk_ids < SMALL_EP.num_experts
        assert bool(local.any())
        assert bool((ref1[~local] == 0).all()) and bool((ref1[local] != 0).any())
        ref2 = inputs.reference_gemm2(problem, deq2)
        assert bool((ref2[~local] == 0).all())
