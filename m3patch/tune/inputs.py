"""Tensors for one fused-MoE problem, built with torch alone (no vLLM ops).

The wheel's `moe_align_block_size` and `per_token_group_quant_fp8` are compiled ops, so the
tuner carries its own: same layouts and padding rules as vLLM 0.33.0. The reference is the
same math in float32 on dequantized values, computed expert by expert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from m3patch.tune.shapes import MoEShape

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
QUANT_GROUP = 128


@dataclass(frozen=True)
class Weights:
    w13: Any  # [E, 2N, K]
    w2: Any  # [E, K, N]
    w13_scale: Any | None  # [E, 2N/bn, K/bk] float32 (block FP8 only)
    w2_scale: Any | None  # [E, K/bn, N/bk]


@dataclass(frozen=True)
class Alignment:
    sorted_ids: Any | None  # None: naive one-token-per-tile path
    expert_ids: Any
    num_post_padded: Any


@dataclass(frozen=True)
class Problem:
    """One rotation set: activations and routing; the weights are shared."""

    a: Any  # GEMM1 input [M, K]
    a_scale: Any | None  # [M, K/128]
    inter: Any  # GEMM2 input [M*topk, N]
    inter_scale: Any | None
    topk_ids: Any  # [M, topk] int32
    topk_weights: Any  # [M, topk] float32


def _block_dequant(w: Any, scale: Any, block: tuple[int, int]) -> Any:
    rows, cols = w.shape[-2], w.shape[-1]
    full = scale.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return w.float() * full[..., :rows, :cols]


def _random_block_fp8(shape: tuple[int, int, int], block: tuple[int, int], gen: Any,
                      device: str) -> tuple[Any, Any]:
    values = torch.randn(shape, generator=gen, device=device).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    grid = (shape[0], -(-shape[1] // block[0]), -(-shape[2] // block[1]))
    scale = torch.rand(grid, generator=gen, device=device) * 0.01 + 0.005
    return values, scale


def make_weights(shape: MoEShape, device: str, seed: int = 0) -> Weights:
    gen = torch.Generator(device=device).manual_seed(seed)
    e, n, k = shape.num_experts, shape.width, shape.hidden
    if shape.dtype == "fp8_w8a8":
        block = shape.block_shape or (QUANT_GROUP, QUANT_GROUP)
        w13, s13 = _random_block_fp8((e, 2 * n, k), block, gen, device)
        w2, s2 = _random_block_fp8((e, k, n), block, gen, device)
        return Weights(w13, w2, s13, s2)
    w13 = (torch.randn((e, 2 * n, k), generator=gen, device=device) * 0.02).to(torch.bfloat16)
    w2 = (torch.randn((e, k, n), generator=gen, device=device) * 0.02).to(torch.bfloat16)
    return Weights(w13, w2, None, None)


def dequantized(weights: Weights, shape: MoEShape) -> tuple[Any, Any]:
    if weights.w13_scale is None or weights.w2_scale is None:
        return weights.w13.float(), weights.w2.float()
    block = shape.block_shape or (QUANT_GROUP, QUANT_GROUP)
    return (_block_dequant(weights.w13, weights.w13_scale, block),
            _block_dequant(weights.w2, weights.w2_scale, block))


def per_token_group_quant_fp8(x: Any, group: int = QUANT_GROUP) -> tuple[Any, Any]:
    """Dynamic per-(token, 128 columns) FP8 quantization, scale = amax / 448 (row-major)."""
    tokens, cols = x.shape
    grouped = x.float().reshape(tokens, cols // group, group)
    scale = grouped.abs().amax(dim=-1).clamp_(min=1e-10) / FP8_MAX
    quant = (grouped / scale[..., None]).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
    return quant.reshape(tokens, cols), scale.contiguous()


def dequant_tokens(q: Any, scale: Any | None, group: int = QUANT_GROUP) -> Any:
    if scale is None:
        return q.float()
    return q.float() * scale.repeat_interleave(group, dim=-1)[:, : q.shape[1]]


def random_routing(batch: int, shape: MoEShape, gen: Any, device: str,
                   global_experts: int | None = None) -> tuple[Any, Any]:
    """Top-k distinct experts per token, uniformly: every expert about equally loaded. With
    `global_experts` (EP-rank routing) the ids are global; this rank holds 0..E-1."""
    experts = global_experts or shape.num_experts
    scores = torch.rand((batch, experts), generator=gen, device=device)
    weights, ids = scores.topk(shape.top_k, dim=-1)
    return ids.to(torch.int32), (weights / weights.sum(-1, keepdim=True)).float()


def moe_align_block_size(topk_ids: Any, block_m: int, num_experts: int,
                         local_experts: int | None = None) -> Alignment:
    """vLLM's sort-and-pad: each expert's (token, slot) indices padded to block_m with the
    pad id `topk_ids.numel()`, one expert id per M tile, and the padded total.

    With `local_experts` (an expert map, `ignore_invalid_experts=True` as fused_experts passes
    it) only pairs routed to global experts 0..local_experts-1 are counted and placed, while
    the capacity stays sized for all `num_experts` global experts, as vLLM sizes it."""
    flat = topk_ids.reshape(-1).long()
    numel = flat.numel()
    local = num_experts if local_experts is None else local_experts
    counts = torch.bincount(flat[flat < local], minlength=local)
    padded = (counts + block_m - 1) // block_m * block_m
    starts = torch.cumsum(padded, 0) - padded
    capacity = numel + num_experts * (block_m - 1)
    if numel < num_experts:
        capacity = min(numel * block_m, capacity)
    capacity = -(-capacity // block_m) * block_m
    sorted_ids = torch.full((capacity,), numel, dtype=torch.int32, device=flat.device)
    order = torch.argsort(flat, stable=True)
    ranked = flat[order]
    keep = ranked < local  # sorted by id: the local pairs come first
    order, ranked = order[keep], ranked[keep]
    first = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=flat.device) - first[ranked]
    sorted_ids[starts[ranked] + rank] = order.to(torch.int32)
    expert_ids = torch.zeros(capacity // block_m, dtype=torch.int32, device=flat.device)
    tiles = torch.repeat_interleave(torch.arange(local, device=flat.device),
                                    padded // block_m)
    expert_ids[: tiles.numel()] = tiles.to(torch.int32)
    total = padded.sum().reshape(1).to(torch.int32)
    return Alignment(sorted_ids, expert_ids, total)


def naive_alignment(topk_ids: Any, block_m: int) -> Alignment:
    total = torch.full((1,), topk_ids.numel() * block_m, dtype=torch.int32,
                       device=topk_ids.device)
    return Alignment(None, topk_ids.reshape(-1).contiguous(), total)


def silu_and_mul(x: Any) -> Any:
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


def expert_matmul(x: Any, weights: Any, topk_ids: Any, *, row_per_slot: bool) -> Any:
    """out[t, s] = x[t*topk+s if row_per_slot else t] @ weights[topk_ids[t, s]].T, float32;
    pairs routed to an expert this rank does not hold (id >= E) stay zero."""
    batch, top_k = topk_ids.shape
    out = torch.zeros((batch, top_k, weights.shape[1]), dtype=torch.float32, device=x.device)
    for expert in torch.unique(topk_ids).tolist():
        if expert >= weights.shape[0]:
            continue
        tok, slot = torch.nonzero(topk_ids == expert, as_tuple=True)
        rows = tok * top_k + slot if row_per_slot else tok
        out[tok, slot] = x[rows] @ weights[expert].T
    return out


MAX_REDRAWS = 1000


def _checkable_routing(batch: int, shape: MoEShape, gen: Any, device: str,
                       global_experts: int | None) -> tuple[Any, Any]:
    """Routing for the checked rotation set: with EP-rank routing at least one pair must land
    on this rank, else the reference check would compare nothing."""
    for _ in range(MAX_REDRAWS):
        ids, weights = random_routing(batch, shape, gen, device, global_experts)
        if bool((ids < shape.num_experts).any()):
            return ids, weights
    msg = f"no routing with a local pair in {MAX_REDRAWS} draws at M={batch}"
    raise RuntimeError(msg)


def make_problem(shape: MoEShape, batch: int, deq_w13: Any, gen: Any, device: str,
                 global_experts: int | None = None) -> tuple[Problem, Any]:
    """Inputs for one rotation set, and GEMM1's float32 reference (GEMM2's input derives
    from it so that every config's GEMM2 sees the same input)."""
    fp8 = shape.dtype == "fp8_w8a8"
    hidden = torch.randn((batch, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
    a, a_scale = per_token_group_quant_fp8(hidden) if fp8 else (hidden, None)
    topk_ids, topk_weights = _checkable_routing(batch, shape, gen, device, global_experts)
    ref1 = expert_matmul(dequant_tokens(a, a_scale), deq_w13, topk_ids, row_per_slot=False)
    act = silu_and_mul(ref1.to(torch.bfloat16).float()).reshape(batch * shape.top_k, -1)
    inter, inter_scale = per_token_group_quant_fp8(act) if fp8 else (act.to(torch.bfloat16), None)
    return Problem(a, a_scale, inter, inter_scale, topk_ids, topk_weights), ref1


def reference_gemm2(problem: Problem, deq_w2: Any) -> Any:
    x = dequant_tokens(problem.inter, problem.inter_scale)
    out = expert_matmul(x, deq_w2, problem.topk_ids, row_per_slot=True)
    return out * problem.topk_weights[..., None]


def random_problem(shape: MoEShape, batch: int, gen: Any, device: str,
                   global_experts: int | None = None) -> Problem:
    """Inputs with no reference: enough to compile and time a config."""
    fp8 = shape.dtype == "fp8_w8a8"
    hidden = torch.randn((batch, shape.hidden), generator=gen, device=device).to(torch.bfloat16)
    act = torch.randn((batch * shape.top_k, shape.width), generator=gen, device=device)
    a, a_scale = per_token_group_quant_fp8(hidden) if fp8 else (hidden, None)
    inter, inter_scale = per_token_group_quant_fp8(act) if fp8 else (act.to(torch.bfloat16), None)
    topk_ids, topk_weights = random_routing(batch, shape, gen, device, global_experts)
    return Problem(a, a_scale, inter, inter_scale, topk_ids, topk_weights)
