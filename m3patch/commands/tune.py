"""`m3patch tune`: tune vLLM's fused-MoE Triton kernel on this GPU and write vLLM tables.

Shapes come from a recipe (`--recipe R.yaml`: its model's config.json and its TP/DP/EP and
shared-expert fusion), a model config (`--model-config config.json --tp 8 [--ep]`) or are
given (`--shape E,N,K,TOPK`, repeatable). `--plan` prints the shapes, table names and search
space and stops. `--check TABLE` judges an existing table on this GPU instead: every entry
head to head with vLLM's default (m3patch/tune/judge.py), a table printed, JSON written, exit
14 (BenchFailed) when an entry loses beyond the measured noise. torch/triton are imported
only once arguments are valid.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from m3patch.errors import UsageError
from m3patch.output import show
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.tune.judge import DEFAULT_ROUNDS, MIN_ROUNDS, format_table
from m3patch.tune.naming import table_file_name
from m3patch.tune.recipe_shapes import read_model_config, shape_for_recipe
from m3patch.tune.routing import KINDS, routing_for
from m3patch.tune.shapes import (
    MoEShape,
    check_dtype,
    parse_batch_sizes,
    parse_block_shape,
    parse_explicit_shape,
    shapes_from_model_config,
)
from m3patch.tune.space import FULL_AXES, REDUCED_BF16_AXES, SpaceAxes, space_for_shape
from m3patch.tune.table_check import fail_on_losses, shape_for_table

AXES = {"full": FULL_AXES, "reduced-bf16": REDUCED_BF16_AXES}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_argument_group("what to tune")
    what.add_argument("--shape", action="append", default=[], metavar="E,N,K,TOPK",
                      help="explicit shape (repeatable), e.g. 16,3072,6144,4")
    what.add_argument("--recipe", type=recipe_path, metavar="RECIPE",
                      help="a recipe YAML or a shipped recipe's name: shape from its model "
                           "config and parallelism")
    what.add_argument("--model-config", type=Path,
                      help="a Hugging Face config.json (with --recipe: instead of the recipe "
                           "model's own)")
    what.add_argument("--tp", type=int, help="MoE ranks, TP x DP (with --model-config; default 1)")
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
    how.add_argument("--plan", action="store_true",
                     help="print shapes, table file names and search-space sizes; no GPU")
    how.add_argument("--routing", choices=KINDS, default="bench",
                     help="bench: vLLM's benchmark convention (the shipped tables'); ep-rank: "
                          "top-k over all E x R experts, only this rank's pairs (EP shapes)")
    how.add_argument("--ep-ranks", type=int, metavar="R",
                     help="expert-parallel ranks for --routing ep-rank (8 for TP8+EP8)")
    how.add_argument("--judge-rounds", type=int, default=DEFAULT_ROUNDS,
                     help="head-to-head rounds against vLLM's default per batch size")
    check = parser.add_argument_group("check an existing table")
    check.add_argument("--check", type=Path, metavar="TABLE",
                       help="judge every entry of TABLE against vLLM's default on this GPU; "
                            "exit 14 if one loses beyond the noise (shape from its "
                            ".provenance.json, or the shape options)")
    check.add_argument("--json-file", "--check-json", dest="check_json", type=Path,
                       metavar="FILE", help="where --check writes its JSON (default "
                       "OUT-DIR/<table>.check.json); --check-json is its older spelling")
    check.add_argument("--judge-reps", type=int, default=30,
                       help="graph replays per timing in --check")


def _block(dtype: str, text: str) -> tuple[int, int] | None:
    block = parse_block_shape(text) if dtype == "fp8_w8a8" else None
    if dtype == "fp8_w8a8" and block is None:
        msg = "--dtype fp8_w8a8 is tuned here for block quantization only"
        raise UsageError(msg, hint="pass --block-shape 128,128")
    return block


def _recipe_shape(args: argparse.Namespace, dtype: str, block: tuple[int, int] | None
                  ) -> MoEShape:
    given = [flag for flag, on in (("--tp", args.tp is not None), ("--ep", args.ep),
                                   ("--fused-shared-experts", args.fused_shared_experts)) if on]
    if given:
        msg = f"{', '.join(given)} cannot be combined with --recipe: the recipe sets parallelism"
        raise UsageError(msg, hint=f"edit parallelism/env in {args.recipe}, or use "
                                   f"--model-config with {' '.join(given)} instead of --recipe")

    return shape_for_recipe(load_recipe(args.recipe), model_config=args.model_config,
                            dtype=dtype, block_shape=block)


def _shapes(args: argparse.Namespace) -> tuple[MoEShape, ...]:
    dtype = check_dtype(args.dtype)
    block = _block(dtype, args.block_shape)
    sources = [flag for flag, on in (("--shape", bool(args.shape)), ("--recipe", bool(args.recipe)),
               ("--model-config", bool(args.model_config) and not args.recipe)) if on]
    if len(sources) != 1:
        msg = ("give exactly one of --shape (one or more), --recipe or --model-config"
               + (f"; got {', '.join(sources)}" if sources else ""))
        raise UsageError(msg, hint="m3patch tune --recipe recipes/h200_tp8.yaml")
    if args.recipe:
        return (_recipe_shape(args, dtype, block),)
    if args.shape:
        return tuple(parse_explicit_shape(text, dtype=dtype, block_shape=block, ep=args.ep)
                     for text in args.shape)

    return (shapes_from_model_config(read_model_config(args.model_config),
                                     tp=1 if args.tp is None else args.tp, ep=args.ep,
                                     fused_shared_experts=args.fused_shared_experts,
                                     dtype=dtype, block_shape=block,
                                     where=str(args.model_config)),)


def _print_plan(shapes: tuple[MoEShape, ...], batches: tuple[int, ...], axes: SpaceAxes,
                device_name: str | None) -> None:

    for shape in shapes:
        plan = space_for_shape(shape, batches, axes)
        name = table_file_name(shape, device_name) if device_name else "(this GPU's name)"
        sizes = ", ".join(f"{batch}:{len(configs)}" for batch, configs in plan.items())
        show(f"shape {shape.key}\n  table {name}\n  configs per batch size {sizes}")


def _check_counts(args: argparse.Namespace) -> None:
    if args.judge_rounds < MIN_ROUNDS:
        msg = f"--judge-rounds must be >= {MIN_ROUNDS}: the noise comes from their spread"
        raise UsageError(msg, hint=f"--judge-rounds {DEFAULT_ROUNDS}")
    for name in ("quick_reps", "refine_reps", "refine_top", "judge_reps"):
        if getattr(args, name) < 1:
            flag = "--" + name.replace("_", "-")
            msg = f"{flag} must be >= 1"
            raise UsageError(msg, hint=f"{flag} 5")
    if args.workers < 0:
        msg = "--workers must be >= 0"
        raise UsageError(msg, hint="--workers 14")


def _check_shape(args: argparse.Namespace) -> MoEShape:
    given = None
    if args.shape or args.recipe or args.model_config:
        shapes = _shapes(args)
        if len(shapes) != 1:
            msg = "--check judges one table: give one --shape"
            raise UsageError(msg, hint="m3patch tune --check TABLE --shape 16,3072,6144,4,ep")
        given = shapes[0]
    return shape_for_table(args.check, given)


def _import_job() -> Any:
    """The GPU side, imported only here (torch/triton: CLI commands stay light); no GPU or no
    torch/triton is a usage error with one message, never a traceback."""
    hint = "run it on the GPU machine the table is for, in the image with torch and triton"
    try:
        # deferred: torch: only the tuner/kernel paths need it
        import torch
    except ImportError as exc:
        msg = f"m3patch tune needs torch and triton on a CUDA machine ({exc})"
        raise UsageError(msg, hint=hint) from None
    if not torch.cuda.is_available():
        msg = "m3patch tune needs a GPU: torch.cuda.is_available() is False on this machine"
        raise UsageError(msg, hint=hint)
    try:
        # deferred: job imports torch/triton at load
        from m3patch.tune import job
    except ImportError as exc:
        msg = f"m3patch tune needs torch and triton on a CUDA machine ({exc})"
        raise UsageError(msg, hint=hint) from None
    return job


def _run_check(args: argparse.Namespace) -> int:

    shape = _check_shape(args)
    batches = None if args.batch_sizes == "default" else parse_batch_sizes(args.batch_sizes)
    _check_counts(args)
    routing = routing_for(args.routing, args.ep_ranks, (shape,))
    json_path = args.check_json or args.out_dir / (args.check.name + ".check.json")
    job = _import_job()
    spec = job.CheckSpec(table=args.check, shape=shape, json_path=json_path,
                         vllm_source=args.vllm_source, workers=args.workers,
                         rounds=args.judge_rounds, reps=args.judge_reps, batches=batches,
                         command=_command_line(), routing=routing)
    judgements = job.run_check(spec)
    show(format_table([(shape.key.split(",K=")[0], j) for j in judgements]))
    show(f"wrote {json_path}")
    fail_on_losses(args.check, judgements, json_path)
    return 0


def _command_line() -> str:
    return "m3patch tune " + shlex.join(sys.argv[2:] if len(sys.argv) > 2 else [])


def run(args: argparse.Namespace) -> int:
    if args.check is not None:
        return _run_check(args)
    shapes = _shapes(args)
    batches = parse_batch_sizes(args.batch_sizes)
    _check_counts(args)
    routing = routing_for(args.routing, args.ep_ranks, shapes)
    axes: SpaceAxes = AXES[args.space]
    if args.plan:
        _print_plan(shapes, batches, axes, args.device_name)
        return 0
    job = _import_job()
    # deferred: tuner imports torch/triton at load
    from m3patch.tune.tuner import TuneOptions

    deadline = time.monotonic() + args.time_budget if args.time_budget else None
    spec = job.TuneSpec(
        shapes=shapes, batches=batches, axes=axes, out_dir=args.out_dir,
        cache_path=args.cache or args.out_dir / "tune-cache.jsonl",
        vllm_source=args.vllm_source, workers=args.workers,
        options=TuneOptions(args.quick_reps, args.refine_reps, args.refine_top, deadline,
                            args.judge_rounds),
        device_name=args.device_name,
        command=_command_line(), routing=routing,
    )
    for path in job.run_tune(spec):
        show(str(path))
    return 0
