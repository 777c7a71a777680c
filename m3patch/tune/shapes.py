"""MoE GEMM shapes to tune: from a model config plus TP/EP, or given explicitly. Pure.

vLLM names a table by `E = w2.shape[0]` (local experts, +1 when the shared expert is fused
into the routed ones) and `N = w2.shape[2]` (the expert width per MoE tensor-parallel rank);
K is the hidden size and does not appear in the file name (docs: shared/design/vllm-0.33.md §4.3).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from m3patch.errors import UsageError

DTYPES = ("fp8_w8a8", "bf16")
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 256, 512, 1024, 1536, 2048,
                       3072, 4096, 8192)

# Keys different model families use for the same quantity, most specific first.
_EXPERT_KEYS = ("num_local_experts", "n_routed_experts", "num_experts")
_WIDTH_KEYS = ("moe_intermediate_size", "intermediate_size")


@dataclass(frozen=True)
class MoEShape:
    """One fused-MoE problem: w13 is [E, 2N, K], w2 is [E, K, N]."""

    num_experts: int
    width: int  # N: expert width per rank
    hidden: int  # K
    top_k: int
    dtype: str  # "fp8_w8a8" or "bf16" (bf16 has no dtype selector in the file name)
    block_shape: tuple[int, int] | None
    expert_parallel: bool = False  # with EP vLLM passes an expert map: never the naive path

    @property
    def key(self) -> str:
        block = "x".join(map(str, self.block_shape)) if self.block_shape else "none"
        ep = ",ep" if self.expert_parallel else ""
        return (f"E={self.num_experts},N={self.width},K={self.hidden},topk={self.top_k},"
                f"dtype={self.dtype},block={block}{ep}")

    @property
    def vllm_dtype(self) -> str | None:
        """The dtype string vLLM's lookup uses (`None` for unquantized BF16)."""
        return None if self.dtype == "bf16" else self.dtype


def _first_int(config: Mapping[str, Any], keys: tuple[str, ...], what: str, where: str) -> int:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    msg = f"{where}: no positive integer {what} (looked for {', '.join(keys)})"
    raise UsageError(msg, hint="pass --shape E,N,K,TOPK instead of --model-config")


def shapes_from_model_config(
    config: Mapping[str, Any], *, tp: int, ep: bool, fused_shared_experts: bool,
    dtype: str, block_shape: tuple[int, int] | None, where: str = "model config",
) -> MoEShape:
    """vLLM's mapping: with EP the experts split over `tp` ranks and the width stays whole;
    without EP every rank holds every expert at width/tp (fused_moe/config.py make())."""
    text_config = config.get("text_config")
    if isinstance(text_config, Mapping) and "hidden_size" in text_config:
        config = text_config
    experts = _first_int(config, _EXPERT_KEYS, "expert count", where)
    width = _first_int(config, _WIDTH_KEYS, "expert width", where)
    hidden = _first_int(config, ("hidden_size",), "hidden size", where)
    top_k = _first_int(config, ("num_experts_per_tok",), "top-k", where)
    if tp < 1:
        msg = f"--tp must be >= 1, got {tp}"
        raise UsageError(msg, hint="pass --tp 8 (the tensor-parallel size of the deployment)")
    if ep and fused_shared_experts:
        msg = "fused shared experts need expert parallelism off (vLLM disables the fusion with EP)"
        raise UsageError(msg, hint="drop --fused-shared-experts or --ep")
    split_experts, split_width = (tp, 1) if ep else (1, tp)
    for total, parts, what in ((experts, split_experts, "experts"), (width, split_width, "width")):
        if total % parts:
            msg = f"{where}: {what} {total} does not divide by {parts} ranks"
            raise UsageError(msg, hint="choose a --tp that divides the model's expert count/width")
    local = experts // split_experts
    if fused_shared_experts:  # vLLM's num_fused_shared_experts = n_shared_experts
        local += _first_int(config, ("n_shared_experts",), "shared-expert count", where)
    return MoEShape(local, width // split_width, hidden, top_k, dtype, block_shape, ep)


def parse_block_shape(text: str) -> tuple[int, int] | None:
    if text.lower() in ("", "none"):
        return None
    match = re.fullmatch(r"\s*(\d+)\s*[,x]\s*(\d+)\s*", text)
    if not match or 0 in (int(match[1]), int(match[2])):
        msg = f"--block-shape {text!r} is not two positive integers"
        raise UsageError(msg, hint="use --block-shape 128,128 (or none)")
    return int(match[1]), int(match[2])


def parse_explicit_shape(text: str, *, dtype: str, block_shape: tuple[int, int] | None,
                         ep: bool = False) -> MoEShape:
    """`E,N,K,TOPK[,ep]`, e.g. `16,3072,6144,4,ep` (the suffix marks expert parallelism)."""
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 5 and parts[4].lower() == "ep":
        ep, parts = True, parts[:4]
    if len(parts) != 4 or not all(p.isdigit() and int(p) > 0 for p in parts):
        msg = f"--shape {text!r} is not four positive integers E,N,K,TOPK (optionally ,ep)"
        raise UsageError(msg, hint="use --shape 16,3072,6144,4,ep or --shape 128,384,6144,4")
    experts, width, hidden, top_k = (int(p) for p in parts)
    if top_k > experts:
        msg = f"--shape {text!r}: top-k {top_k} exceeds the expert count {experts}"
        raise UsageError(msg, hint="check the order: E,N,K,TOPK")
    return MoEShape(experts, width, hidden, top_k, check_dtype(dtype), block_shape, ep)


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        msg = f"--dtype {dtype!r} is not one of {', '.join(DTYPES)}"
        raise UsageError(msg, hint="use --dtype fp8_w8a8 (block FP8) or --dtype bf16")
    return dtype


def parse_batch_sizes(text: str) -> tuple[int, ...]:
    if text == "default":
        return DEFAULT_BATCH_SIZES
    try:
        sizes = sorted({int(p) for p in text.split(",") if p.strip()})
    except ValueError:
        sizes = []
    if not sizes or sizes[0] < 1:
        msg = f"--batch-sizes {text!r} is not a list of positive integers"
        raise UsageError(msg, hint="use --batch-sizes 1,16,256 or --batch-sizes default")
    return tuple(sizes)


_SHAPE_KEY = re.compile(r"E=(\d+),N=(\d+),K=(\d+),topk=(\d+),dtype=(\w+),block=(none|\d+x\d+)(,ep)?")


def shape_from_key(key: str, where: str) -> MoEShape:
    """Inverse of `MoEShape.key` (the `shape` a table's provenance sidecar records)."""
    match = _SHAPE_KEY.fullmatch(key) if isinstance(key, str) else None
    if match is None or match[5] not in DTYPES:
        msg = (f"{where}: shape {key!r} is not a tuner shape key like "
               "E=16,N=3072,K=6144,topk=4,dtype=fp8_w8a8,block=128x128,ep")
        raise UsageError(msg, hint="pass the shape yourself: --shape E,N,K,TOPK[,ep]")
    block = None if match[6] == "none" else tuple(int(v) for v in match[6].split("x"))
    experts, width, hidden, top_k = (int(match[i]) for i in range(1, 5))
    if min(experts, width, hidden, top_k) < 1 or top_k > experts:
        msg = f"{where}: shape {key!r} has a zero size or top-k above the expert count"
        raise UsageError(msg, hint="pass the shape yourself: --shape E,N,K,TOPK[,ep]")
    return MoEShape(experts, width, hidden, top_k, match[5], block,  # type: ignore[arg-type]
                    match[7] is not None)
