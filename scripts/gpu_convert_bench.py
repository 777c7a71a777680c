"""GPU benchmark of the block-FP8 conversion (patch 0002) on one MiniMax M3 EP8 MoE layer.

    python scripts/gpu_convert_bench.py [--patch patches/vllm-0.33.0/0002-mxfp8-block-fp8-moe.patch]
                                        [--module PATH] [--out DIR] [--small]

Loads the conversion module from the patch's new-file hunk (or --module), converts random MXFP8
weights (w13 16x6144x6144, w2 16x6144x3072; 1x32 scales varying within each block), checks every
element against the bound |x'-x| <= 2^-4|x| + 2^-10 S (NaN never passes) and reports the relative
Frobenius error against the exact float32 dequantisation, times the conversion with CUDA events
(median), and relates bytes moved / time to the 4.2 TB/s copy ceiling. Prints a table and writes
gpu_convert_bench.json and .txt to --out (default $OUT, else docs/results).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

import torch

NEW_MODULE = "vllm/model_executor/layers/quantization/utils/m3patch_mxfp8_block.py"
DEFAULT_PATCH = Path(__file__).resolve().parent.parent / "patches/vllm-0.33.0/0002-mxfp8-block-fp8-moe.patch"
COPY_CEILING_BPS = 4.2e12
TARGET_FRACTION = 0.25
M3_SHAPES = {"w13": (16, 6144, 6144), "w2": (16, 6144, 3072)}
SMALL_SHAPES = {"w13": (2, 256, 384), "w2": (2, 384, 256)}
M3_MOE_LAYERS_PER_RANK = 57 + 1  # target MoE layers + the MTP layer
SEEDS = {"w13": 13, "w2": 2}


def module_text_from_patch(patch: Path) -> str:
    """Body of the new-file hunk for NEW_MODULE (every line after '@@' starts with '+')."""
    lines = patch.read_text(encoding="utf-8").splitlines(keepends=True)
    start = lines.index(f"+++ b/{NEW_MODULE}\n") + 2  # skip '+++' and '@@'
    body = []
    for line in lines[start:]:
        if not line.startswith("+"):
            break
        body.append(line[1:])
    return "".join(body)


def load_module(patch: Path, module: Path | None) -> ModuleType:
    path = module
    if path is None:
        path = Path(tempfile.mkdtemp()) / "m3patch_mxfp8_block.py"
        path.write_text(module_text_from_patch(patch), encoding="utf-8")
    spec = importlib.util.spec_from_file_location("m3patch_mxfp8_block", path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def random_mxfp8(shape: tuple[int, int, int], device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    e, n, k = shape
    # Gaussian values over most of the e4m3 range; 1x32 scales spread over 2^7 within a block
    values = (torch.randn(shape, generator=gen, device=device) * 64).clamp_(-448, 448)
    scales = torch.randint(120, 128, (e, n, k // 32), generator=gen, device=device, dtype=torch.uint8)
    return values.to(torch.float8_e4m3fn), scales


def check_expert(mod: ModuleType, w: torch.Tensor, s: torch.Tensor, wq: torch.Tensor,
                 sq: torch.Tensor, e: int) -> dict[str, float]:
    ref = mod.dequant_mxfp8(w[e], s[e])
    got = mod.dequant_block_fp8(wq[e], sq[e])
    floor = (2.0**-10) * sq[e].repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = (2.0**-4) * ref.abs() + floor + 1e-6 * ref.abs()
    err = (got - ref).abs()
    ok = bool(torch.isfinite(got).all()) and bool((err <= bound).all())
    rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
    return {"rel_err": rel, "max_err_over_bound": float((err / bound).max()), "bound_ok": float(ok)}


def time_ms(fn: Any, iters: int) -> float:
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        end = torch.cuda.Event(enable_timing=True)  # type: ignore[no-untyped-call]
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(float(start.elapsed_time(end)))
    return float(statistics.median(times))


def bytes_moved(shape: tuple[int, int, int]) -> int:
    e, n, k = shape
    return e * n * k * 2 + e * n * (k // 32) + e * (n // 128) * (k // 128) * 4


def bench_one(mod: ModuleType, name: str, shape: tuple[int, int, int], args: argparse.Namespace) -> dict[str, Any]:
    w, s = random_mxfp8(shape, args.device, seed=SEEDS[name])
    rows: dict[str, Any] = {"tensor": name, "shape": list(shape), "bytes": bytes_moved(shape)}
    by_config = {}
    for warps, tile_rows in args.configs:
        def run(warps: int = warps, tile_rows: int = tile_rows) -> Any:
            return mod.convert_mxfp8_to_block_fp8(w, s, fnuz=args.fnuz, impl=args.impl,
                                                  num_warps=warps, tile_rows=tile_rows)
        run()  # compile
        by_config[f"{warps}x{tile_rows}"] = time_ms(run, args.iters)
    best = min(by_config, key=lambda k: by_config[k])
    warps, tile_rows = (int(v) for v in best.split("x"))
    wq, sq = mod.convert_mxfp8_to_block_fp8(w, s, fnuz=args.fnuz, impl=args.impl, num_warps=warps,
                                            tile_rows=tile_rows)
    torch_q, torch_s = mod.convert_mxfp8_to_block_fp8(w[:1].contiguous(), s[:1].contiguous(), fnuz=args.fnuz, impl="torch")
    checks = [check_expert(mod, w, s, wq, sq, e) for e in sorted({0, shape[0] // 2, shape[0] - 1})]
    rows.update({
        "ms_by_warps_x_tile_rows": by_config, "config": best, "median_ms": by_config[best],
        "rel_err_max": max(c["rel_err"] for c in checks),
        "err_over_bound_max": max(c["max_err_over_bound"] for c in checks),
        "bound_ok": all(c["bound_ok"] == 1.0 for c in checks),
        "experts_checked": len(checks),
        "bytes_differing_from_torch_path_expert0": int((wq[:1].view(torch.uint8) != torch_q.view(torch.uint8)).sum()),
        "scales_equal_torch_path_expert0": bool(torch.equal(sq[:1], torch_s)),
    })
    rows["tb_per_s"] = rows["bytes"] / (rows["median_ms"] * 1e-3) / 1e12
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    total_ms = sum(r["median_ms"] for r in rows)
    total_bytes = sum(r["bytes"] for r in rows)
    frac = total_bytes / (total_ms * 1e-3) / COPY_CEILING_BPS
    return {"layer_ms": total_ms, "layer_bytes": total_bytes, "fraction_of_copy_ceiling": frac,
            "meets_target": frac >= TARGET_FRACTION and all(r["bound_ok"] for r in rows),
            "model_load_s_per_rank_estimate": total_ms * M3_MOE_LAYERS_PER_RANK / 1e3}


def table(rows: list[dict[str, Any]], summary: dict[str, Any]) -> str:
    head = f"{'tensor':<6} {'shape':<16} {'wxrows':>6} {'median ms':>10} {'TB/s':>6} {'rel err':>9} {'err/bound':>9} {'bound':>5}"
    out = [head, "-" * len(head)]
    for r in rows:
        shape = "x".join(str(d) for d in r["shape"])
        out.append(f"{r['tensor']:<6} {shape:<16} {r['config']:>6} {r['median_ms']:>10.3f} "
                   f"{r['tb_per_s']:>6.2f} {r['rel_err_max']:>9.2e} {r['err_over_bound_max']:>9.3f} "
                   f"{'ok' if r['bound_ok'] else 'FAIL':>5}")
    out.append(f"layer: {summary['layer_ms']:.3f} ms, {summary['fraction_of_copy_ceiling']:.1%} of "
               f"{COPY_CEILING_BPS / 1e12:.1f} TB/s (target {TARGET_FRACTION:.0%}: "
               f"{'met' if summary['meets_target'] else 'NOT met'}); "
               f"{M3_MOE_LAYERS_PER_RANK} layers/rank ~ {summary['model_load_s_per_rank_estimate']:.2f} s")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", type=Path, default=DEFAULT_PATCH)
    parser.add_argument("--module", type=Path, help="load the module from this file instead")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "docs/results")))
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU/interpreter smoke run)")
    parser.add_argument("--fnuz", action="store_true", help="produce E4M3FNUZ (the gfx94x path)")
    parser.add_argument("--impl", default="triton", choices=("triton", "torch"))
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--configs", default="4x16,4x32,8x32,8x64,16x128",
                        type=lambda v: [tuple(int(x) for x in c.split("x")) for c in v.split(",")],
                        help="num_warps x tile rows to try; the fastest is reported")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if args.device == "cpu":
        global time_ms  # CUDA events need a GPU; the CPU smoke run still checks numerics
        time_ms = lambda fn, iters: float("nan")  # noqa: E731
    mod = load_module(args.patch, args.module)
    shapes = SMALL_SHAPES if args.small else M3_SHAPES
    rows = [bench_one(mod, name, shape, args) for name, shape in shapes.items()]
    summary = summarize(rows)
    env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": getattr(mod.triton, "__version__", None),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "fnuz": args.fnuz, "impl": args.impl, "iters": args.iters}
    text = table(rows, summary)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = "gpu_convert_bench" + ("_fnuz" if args.fnuz else "")
    (args.out / f"{stem}.json").write_text(json.dumps({"env": env, "rows": rows, "summary": summary}, indent=2) + "\n")
    (args.out / f"{stem}.txt").write_text(f"{env}\n{text}\n")
    return 0 if all(r["bound_ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
