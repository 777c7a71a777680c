"""`m3patch tune`: tune vLLM's fused-MoE Triton kernel on this GPU and write vLLM tables.

Shapes come from a model config (`--model-config config.json --tp 8 [--ep]`) or are given
(`--shape E,N,K,TOPK`, repeatable). torch/triton are imported only once arguments are valid.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path

from m3patch.errors import UsageError
from m3patch.tune.shapes import (
    MoEShape,
    check_dtype,
    parse_batch_sizes,
    parse_block_shape,
    parse_explicit_shape,
    shapes_from_model_config,
)
from m3patch.tune.space import FULL_AXES, REDUCED_BF16_AXES, SpaceAxes

AXES = {"full": FULL_AXES, "reduced-bf16": REDUCED_BF16_AXES}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to tune")
    what.add_argument("--shape", action="append", default=[], metavar="E,N,K,TOPK",
                      help="explicit shape (repeatable), e.g. 16,3072,6144,4")
    what.add_argument("--model-config", type=Path, help="a Hugging Face config.json")
    what.add_argument("--tp", type=int, default=1, help="tensor-parallel size (with --model-config)")
    what.add_argument("--ep", action="store_true", help="expert parallelism over the TP ranks")
    what.add_argument("--fused-shared-experts", action="store_true",
                      help="shared expert fused into the routed ones (E+1; no EP)")
    what.add_argument("--dtype", default="fp8_w8a8", help="fp8_w8a8 (default) or bf16")
    what.add_argument("--block-shape", default="128,128", help="quant block N,K or 'none'")
    what.add_argument("--batch-sizes", default="default", help="comma list or 'default' (1..8192)")
    how = parser.add_argument_group("how")
    how.add_argument("--vllm-source", type=Path,
                     help="vLLM tree (dir containing vllm/) to take the kernel from without "
                          "importing vLLM; default: the importable vllm")
    how.add_argument("--out-dir", type=Path, default=Path("tuned-moe-tables"))
    how.add_argument("--cache", type=Path, help="resumable results (default OUT/tune-cache.jsonl)")
    how.add_argument("--space", choices=sorted(AXES), default="full")
    how.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 2),
                     help="compile processes (0: compile inline)")
    how.add_argument("--quick-reps", type=int, default=5)
    how.add_argument("--refine-reps", type=int, default=25)
    how.add_argument("--refine-top", type=int, default=4)
    how.add_argument("--time-budget", type=float, help="seconds; stop cleanly (resumable) after")
    how.add_argument("--device-name", help="device name for the file name (default: this GPU's)")


def _shapes(args: argparse.Namespace) -> tuple[MoEShape, ...]:
    dtype = check_dtype(args.dtype)
    block = parse_block_shape(args.block_shape) if dtype == "fp8_w8a8" else None
    if dtype == "fp8_w8a8" and block is None:
        msg = "--dtype fp8_w8a8 is tuned here for block quantization only"
        raise UsageError(msg, hint="pass --block-shape 128,128")
    if bool(args.shape) == bool(args.model_config):
        msg = "give either --shape (one or more) or --model-config, not both or neither"
        raise UsageError(msg, hint="m3patch tune --shape 16,3072,6144,4 --ep")
    if args.shape:
        return tuple(parse_explicit_shape(text, dtype=dtype, block_shape=block, ep=args.ep)
                     for text in args.shape)
    try:
        config = json.loads(args.model_config.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        msg = f"{args.model_config}: cannot read a JSON model config ({exc})"
        raise UsageError(msg, hint="pass the model's config.json") from exc
    return (shapes_from_model_config(config, tp=args.tp, ep=args.ep,
                                     fused_shared_experts=args.fused_shared_experts,
                                     dtype=dtype, block_shape=block,
                                     where=str(args.model_config)),)


def _check_counts(args: argparse.Namespace) -> None:
    for name in ("quick_reps", "refine_reps", "refine_top"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            msg = f"{flag} must be >= 1"
            raise UsageError(msg, hint=f"{flag} 5")
    if args.workers < 0:
        msg = "--workers must be >= 0"
        raise UsageError(msg, hint="--workers 14")


def run(args: argparse.Namespace) -> int:
    shapes = _shapes(args)
    batches = parse_batch_sizes(args.batch_sizes)
    _check_counts(args)
    axes: SpaceAxes = AXES[args.space]
    try:
        from m3patch.tune.session import TuneSpec, run_tune
        from m3patch.tune.tuner import TuneOptions
    except ImportError as exc:
        msg = f"m3patch tune needs torch and triton on a CUDA machine ({exc})"
        raise UsageError(msg, hint="run it in the image that has torch+triton and the GPU") from exc

    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    spec = TuneSpec(
        shapes=shapes, batches=batches, axes=axes, out_dir=args.out_dir,
        cache_path=args.cache or args.out_dir / "tune-cache.jsonl",
        vllm_source=args.vllm_source, workers=args.workers,
        options=TuneOptions(args.quick_reps, args.refine_reps, args.refine_top, deadline),
        device_name=args.device_name,
        command="m3patch tune " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else []),
    )
    for path in run_tune(spec):
        print(path)
    return 0
