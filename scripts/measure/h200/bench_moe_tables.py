"""Measure what the tuned tables buy on this GPU; prints a table, writes JSON.

Per shape and batch size: tuned config vs vLLM 0.33.0's default config, judged by the same
measurement as the tuner's final choice and `m3patch tune --check` (m3patch/tune/judge.py:
same inputs, CUDA-graph replays, rounds alternating the order, noise from their spread); block-FP8 tuned vs BF16 with its own best config from a reduced search (batch <= 256);
and the block-FP8 time against the fp8 weight-read floor (bytes of the experts actually hit,
averaged over the rotation sets, over 4.2 TB/s). Every config is checked against the float32
reference before it is timed. No number here is typed in: all come from this run.

    python3 scripts/measure/h200/bench_moe_tables.py --tables DIR --vllm-source .devcarry --out bench.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

from m3patch.tune import compile_pool, naming
from m3patch.tune.cache import ResultCache
from m3patch.tune.judge import DEFAULT_ROUNDS, measure
from m3patch.tune.kernel_source import load_kernel
from m3patch.tune.kernel_timer import MoEBench, experts_hit
from m3patch.tune.routing import KINDS, routing_for
from m3patch.tune.shapes import DEFAULT_BATCH_SIZES, MoEShape
from m3patch.tune.space import REDUCED_BF16_AXES, space_for_shape
from m3patch.tune.tuner import Progress, TuneOptions, tune_batch
from m3patch.tune.writer import nearest_config, read_table

FLOOR_BW = 4.2e12  # bytes/s: shared/design/anchors.md part 3 (measured copy bandwidth)
SHAPES = (MoEShape(16, 3072, 6144, 4, "fp8_w8a8", (128, 128), True),
          MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False))
BF16_MAX_BATCH = 256


def expert_bytes(shape: MoEShape) -> float:
    weights = 3 * shape.width * shape.hidden  # fp8: one byte each
    bn, bk = shape.block_shape or (128, 128)
    scales = 4 * (-(-2 * shape.width // bn) * -(-shape.hidden // bk)
                  + -(-shape.hidden // bn) * -(-shape.width // bk))
    return float(weights + scales)


def floor_us(bench: MoEBench, batch: int) -> float:
    hit = experts_hit(bench.setup(batch), bench.shape.num_experts)
    return hit * expert_bytes(bench.shape) / FLOOR_BW * 1e6


def bf16_best(kernel: object, shape: MoEShape, batches: list[int], cache: ResultCache
              ) -> dict[int, tuple[str, float]]:
    bf16 = dataclasses.replace(shape, dtype="bf16", block_shape=None)
    plan = space_for_shape(bf16, batches, REDUCED_BF16_AXES)
    bench = MoEBench(kernel, bf16)
    progress = Progress(sum(len(c) for c in plan.values()), f"bf16 {bf16.key}")
    out = {}
    with progress.running():
        for batch in batches:
            best = tune_batch(bench, batch, plan[batch], cache, TuneOptions(5, 25, 3), progress,
                              naming.default_config(bf16, batch))
            if best is not None:
                out[batch] = (best.config.key, best.us)
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tables", type=Path, required=True)
    parser.add_argument("--vllm-source", type=Path)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--reps", type=int, default=30, help="graph replays per timing")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS,
                        help="judge rounds per batch (alternating order)")
    parser.add_argument("--skip-bf16", action="store_true", help="no BF16 comparison")
    parser.add_argument("--routing", choices=KINDS, default="bench",
                        help="ep-rank: the EP8 shape timed with the routing one rank sees")
    parser.add_argument("--ep-ranks", type=int)
    parser.add_argument("--workers", type=int, default=14)
    args = parser.parse_args()
    routing = routing_for(args.routing, args.ep_ranks, SHAPES)
    source = load_kernel(args.vllm_source)
    device = torch.cuda.get_device_name()
    small = [b for b in DEFAULT_BATCH_SIZES if b <= BF16_MAX_BATCH]
    bf16_shapes = [dataclasses.replace(s, dtype="bf16", block_shape=None) for s in SHAPES]
    jobs = [job for s in bf16_shapes for job in compile_pool.make_jobs(
        s, space_for_shape(s, small, REDUCED_BF16_AXES), chunk=8)]
    if not args.skip_bf16:
        compile_pool.precompile(jobs, workers=args.workers, vllm_source=args.vllm_source,
                                on_done=lambda _n: None)
    cache = ResultCache(args.out.with_name("bench-cache.jsonl"))
    rows = []
    for shape in SHAPES:
        table = read_table(args.tables / naming.table_file_name(shape, device))
        bench = MoEBench(source.kernel, shape, routing=routing.for_shape(shape))
        for batch in DEFAULT_BATCH_SIZES:
            tuned, default = nearest_config(table, batch), naming.default_config(shape, batch)
            verdict = measure(bench, batch, tuned, default, rounds=args.rounds,
                              reps=args.reps)
            rows.append({"shape": shape.key, "batch": batch, **verdict.to_dict(),
                         "tuned_us": verdict.tuned_us, "default_us": verdict.default_us,
                         "tuned_over_default": verdict.ratio,
                         "fp8_floor_us": floor_us(bench, batch)})
            print(f"{shape.key} M={batch}: tuned {verdict.tuned_us:.1f} default "
                  f"{verdict.default_us:.1f} noise {100 * verdict.noise:.1f}% "
                  f"{verdict.verdict}", file=sys.stderr, flush=True)
        del bench
        torch.cuda.empty_cache()
        if args.skip_bf16:
            continue
        for batch, (key, us) in bf16_best(source.kernel, shape, small, cache).items():
            row = next(r for r in rows if r["shape"] == shape.key and r["batch"] == batch)
            row.update(bf16_config=key, bf16_us=us, bf16_over_fp8=us / row["tuned_us"])
        torch.cuda.empty_cache()
    for row in rows:
        row["floor_fraction"] = row["fp8_floor_us"] / row["tuned_us"]
    args.out.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                    "command": " ".join(sys.argv), "rounds": args.rounds,
                                    "routing": {s.key: routing.for_shape(s).describe(s)
                                                for s in SHAPES},
                                    "reps": args.reps, "floor_bandwidth_Bps": FLOOR_BW,
                                    "rows": rows}, indent=1))
    print(f"{'shape':<10} {'M':>5} {'tuned us':>9} {'default us':>10} {'t/d':>5} "
          f"{'noise':>6} {'verdict':>7} "
          f"{'bf16 us':>8} {'bf16/fp8':>8} {'floor us':>8} {'%floor':>6}")
    for r in rows:
        label = "EP8 E16" if r["shape"].startswith("E=16,") else "TP8 E128"
        bf = f"{r['bf16_us']:8.1f} {r['bf16_over_fp8']:8.2f}" if "bf16_us" in r else " " * 17
        print(f"{label:<10} {r['batch']:>5} {r['tuned_us']:9.1f} {r['default_us']:10.1f} "
              f"{r['tuned_over_default']:5.2f} {100 * r['noise']:5.1f}% {r['verdict']:>7} {bf} "
              f"{r['fp8_floor_us']:8.1f} "
              f"{100 * r['floor_fraction']:5.0f}%")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
