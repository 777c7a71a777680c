"""Launch vLLM's `fused_moe_kernel` the way 0.33.0's `invoke_fused_moe_triton_kernel` does.

Mirrored argument by argument for the two paths the tuner drives (block FP8 w8a8 and BF16),
including the small-batch EM cut, SWAP_AB on sm90 and the BLOCK_SIZE_K clamp, so a config
timed here is the kernel vLLM would run with it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.tune.inputs import Alignment
from m3patch.tune.naming import launch_block_k, swap_ab
from m3patch.tune.space import TileConfig


@dataclass(frozen=True)
class GemmArgs:
    a: Any
    b: Any
    c: Any
    a_scale: Any | None
    b_scale: Any | None
    topk_weights: Any
    align: Alignment
    mul_routed_weight: bool
    top_k: int


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def grid_size(args: GemmArgs, cfg: TileConfig) -> tuple[int, int]:
    """(EM, number of programs) exactly as the launcher computes them."""
    rows = args.a.size(0)
    num_tokens = rows * args.top_k
    if args.align.sorted_ids is not None:
        em = args.align.sorted_ids.size(0)
        if rows < cfg.block_m:
            em = min(em, rows * args.top_k * cfg.block_m)
    else:
        em = num_tokens * cfg.block_m
    return em, _cdiv(em, cfg.block_m) * _cdiv(args.b.size(1), cfg.block_n)


def _scale_strides(a_scale: Any, b_scale: Any) -> tuple[int, ...]:
    a2d = a_scale is not None and a_scale.ndim == 2
    return (
        a_scale.stride(0) if a2d else 0,
        a_scale.stride(1) if a2d else 0,
        b_scale.stride(0) if b_scale is not None else 0,
        b_scale.stride(2) if b_scale is not None and b_scale.ndim == 3 else 0,
        b_scale.stride(1) if b_scale is not None and b_scale.ndim >= 2 and b_scale.size(1) > 1
        else 0,
    )


def launch(kernel: Any, args: GemmArgs, cfg: TileConfig, *, block_shape: tuple[int, int] | None,
           capability: tuple[int, int]) -> None:
    # deferred: triton: only the tuner/kernel paths need it
    import triton.language as tl

    fp8 = args.b_scale is not None
    em, programs = grid_size(args, cfg)
    a, b, c = args.a, args.b, args.c
    optional: dict[str, Any] = {}
    arg_names = set(getattr(kernel, "arg_names", ()))
    if "SWAP_AB" in arg_names:
        optional["SWAP_AB"] = swap_ab(cfg, fp8=fp8, capability=capability)
    if "USE_TD" in arg_names:
        optional["USE_TD"] = False  # vLLM uses the tensor-descriptor path only on XPU/opt-in
    kernel[(programs,)](
        a, b, c, None, args.a_scale, args.b_scale, args.topk_weights,
        args.align.sorted_ids, args.align.expert_ids, args.align.num_post_padded,
        b.size(1), b.size(2), em, a.size(0) * args.top_k,
        a.stride(0), a.stride(1), b.stride(0), b.stride(2), b.stride(1),
        c.stride(1), c.stride(2),
        *_scale_strides(args.a_scale, args.b_scale),
        0, 0,
        block_shape[0] if block_shape else 0,
        block_shape[1] if block_shape else 0,
        MUL_ROUTED_WEIGHT=args.mul_routed_weight, top_k=args.top_k, compute_type=tl.bfloat16,
        use_fp8_w8a8=fp8, use_int8_w8a8=False, use_int8_w8a16=False, per_channel_quant=False,
        naive_block_assignment=args.align.sorted_ids is None, HAS_BIAS=False,
        BLOCK_SIZE_K=launch_block_k(cfg, block_shape), BLOCK_SIZE_M=cfg.block_m,
        BLOCK_SIZE_N=cfg.block_n, GROUP_SIZE_M=cfg.group_m, SPLIT_K=1,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **optional,
    )
