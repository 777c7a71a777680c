"""Launch vLLM's `fused_moe_kernel` the way 0.33.0's `invoke_fused_moe_triton_kernel` does.

Mirrored argument by argument for the two paths the tuner drives (block FP8 w8a8 and BF16),
including the small-batch EM cut, SWAP_AB on sm90 and the BLOCK_SIZE_K clamp, so a config
timed here is the kernel vLLM would run with it. A config with split_k > 1 needs the kernel of
patch 0007 (split-K: K slices per C tile, the last slice to finish reduces through an fp32
workspace) and launches it the way that patch's launcher does (`effective_split`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from m3patch.tune.inputs import Alignment
from m3patch.tune.naming import launch_block_k, swap_ab
from m3patch.tune.space import TileConfig

MIN_K_ITERS_PER_SPLIT = 4  # a K slice shorter than this costs more in reduction than it hides


@dataclass(frozen=True)
class SplitKBuffers:
    """fp32 partial tiles and per-tile arrival counters (zero; the kernel re-zeroes them)."""

    workspace: Any
    counters: Any


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
    splitk: SplitKBuffers | None = None


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


def split_k_proven() -> bool:
    """Whether this torch build's GPUs may split K: CUDA only, as in patch 0007's launcher.
    The slices' handoff relies on a CTA barrier ordering global stores before a device-scope
    atomic, which NVIDIA's bar.sync guarantees and ROCm's barrier (LDS only, a separate L2 per
    MI300 XCD) does not; there a split config is timed unsplit, as vLLM would run it."""
    # deferred: torch: only the tuner/kernel paths need it
    import torch

    return torch.version.hip is None


def effective_split(cfg: TileConfig, k_size: int, block_k: int) -> int:
    """The K slices a launch really uses: the config's split_k, cut so that every slice keeps
    at least MIN_K_ITERS_PER_SPLIT iterations of the K loop (one config serves both GEMMs:
    GEMM1's K is the hidden size, GEMM2's the narrow expert width, which it never splits);
    1 where the split is not proven (`split_k_proven`)."""
    if cfg.split_k == 1 or not split_k_proven():
        return 1
    return max(1, min(cfg.split_k, _cdiv(k_size, block_k) // MIN_K_ITERS_PER_SPLIT))


def splitk_sizes(args: GemmArgs, cfg: TileConfig, block_k: int) -> tuple[int, int]:
    """(workspace floats, counters) one launch needs; (0, 0) when it does not split."""
    split = effective_split(cfg, args.b.size(2), block_k)
    if split == 1:
        return 0, 0
    tiles = grid_size(args, cfg)[1]
    return tiles * split * cfg.block_m * cfg.block_n, tiles


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
    block_k = launch_block_k(cfg, block_shape)
    split = effective_split(cfg, b.size(2), block_k)
    if split > 1:
        optional.update(_splitk_args(args, cfg, block_k, arg_names))
    if "SWAP_AB" in arg_names:
        optional["SWAP_AB"] = swap_ab(cfg, fp8=fp8, capability=capability)
    if "USE_TD" in arg_names:
        optional["USE_TD"] = False  # vLLM uses the tensor-descriptor path only on XPU/opt-in
    kernel[(programs * split,)](
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
        BLOCK_SIZE_K=block_k, BLOCK_SIZE_M=cfg.block_m,
        BLOCK_SIZE_N=cfg.block_n, GROUP_SIZE_M=cfg.group_m, SPLIT_K=split,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, **optional,
    )


def with_splitk_buffers(gemms: tuple[GemmArgs, ...], cfg: TileConfig,
                        block_shape: tuple[int, int] | None) -> tuple[GemmArgs, ...]:
    """The same launches sharing one fresh workspace and zeroed counter set sized for the
    largest of them (they run one after another on a stream; the kernel re-zeroes the
    counters it used). Unchanged when the config does not split."""
    if cfg.split_k == 1:
        return gemms
    # deferred: torch: only the tuner/kernel paths need it
    import torch

    block_k = launch_block_k(cfg, block_shape)
    sizes = [splitk_sizes(args, cfg, block_k) for args in gemms]
    device = gemms[0].c.device
    buffers = SplitKBuffers(
        torch.zeros(max(1, *(s[0] for s in sizes)), dtype=torch.float32, device=device),
        torch.zeros(max(1, *(s[1] for s in sizes)), dtype=torch.int32, device=device))
    return tuple(replace(args, splitk=buffers) for args in gemms)


def _splitk_args(args: GemmArgs, cfg: TileConfig, block_k: int, arg_names: set[str]
                 ) -> dict[str, Any]:
    if "splitk_ws_ptr" not in arg_names:
        msg = (f"{cfg.key}: split_k needs the split-K fused_moe_kernel (patch 0007); this "
               "kernel has no splitk_ws_ptr")
        raise ValueError(msg)
    floats, tiles = splitk_sizes(args, cfg, block_k)
    buffers = args.splitk
    if buffers is None or buffers.workspace.numel() < floats or buffers.counters.numel() < tiles:
        msg = f"{cfg.key}: split-K buffers missing or smaller than {floats} floats, {tiles} tiles"
        raise ValueError(msg)
    return {"splitk_ws_ptr": buffers.workspace, "splitk_lock_ptr": buffers.counters}
