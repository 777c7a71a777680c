"""GPU benchmark of the block-FP8 conversion (patch 0002) on one MiniMax M3 EP8 MoE layer.

    python scripts/measure/h200/gpu_convert_bench.py [--patch patches/vllm-0.33.0/0002-mxfp8-block-fp8-moe.patch]
        [--module PATH] [--baseline-module PATH] [--variants fn:8x128,bits:8x128,copy:8x128,...]
        [--out DIR] [--small]

One run evaluates several variants on the same random MXFP8 weights (w13 16x6144x6144,
w2 16x6144x3072; 1x32 scales varying within each block):
  <codec>:<warps>x<rows>  the patch's kernel with codec fn (hardware e4m3 converts) or bits
                          (portable bit-level path), num_warps, rows per tile (128 = one pass)
  copy:<warps>x<rows>     a kernel with the same grid and loads/stores but no arithmetic: the
                          ceiling for this access pattern
  torchcopy               torch's copy of the fp8 bytes: the device's plain copy bandwidth
  baseline                --baseline-module's kernel at its own defaults (the previous version)
  default                 the module's own defaults (codec auto, as the patched vLLM calls it)
Conversions are checked element by element against |x'-x| <= 2^-4|x| + 2^-10 S (NaN never
passes) on 3 experts, and their bytes compared with the torch path on expert 0. Times are CUDA
event medians of whole calls (including the host-side finiteness check of the scales). Prints
a table and writes <stem>.json and .txt to --out (default $OUT, else docs/results).
--edge-cases also compares each codec with the torch path, byte for byte, on blocks holding
every e4m3 byte under several E8M0 bytes and a zero group under E8M0 254 (S clamped).
Under TRITON_INTERPRET=1 (CPU smoke run) only the bits codec is meaningful: the interpreter's
fp32->fp8 cast (triton 3.6 interpreter.py _convert_float) does not round to nearest even.
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
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
from patch_payload import new_file_from_patch

try:  # the copy-ceiling kernel; the conversion kernels come from the module under test
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the environment
    triton = None

NEW_MODULE = "vllm/model_executor/layers/quantization/utils/m3patch_mxfp8_block.py"
DEFAULT_PATCH = Path(__file__).resolve().parents[3] / "patches/vllm-0.33.0/0002-mxfp8-block-fp8-moe.patch"
DEFAULT_VARIANTS = ("fn:8x128,fn:4x128,fn:16x128,fn:8x64,fn:8x32,fn:4x32,bits:8x128,bits:4x128,"
                    "bits:8x64,bits:8x32,copy:8x128,copy:4x128,torchcopy")
COPY_CEILING_BPS = 4.2e12
TARGET_FRACTION = 0.25
M3_SHAPES = {"w13": (16, 6144, 6144), "w2": (16, 6144, 3072)}
SMALL_SHAPES = {"w13": (2, 256, 384), "w2": (2, 384, 256)}
M3_MOE_LAYERS_PER_RANK = 57 + 1  # target MoE layers + the MTP layer
SEEDS = {"w13": 13, "w2": 2}

if triton is not None:

    @triton.jit  # type: ignore[untyped-decorator]
    def _copy_kernel(w_ptr, s_ptr, out_ptr, os_ptr, N, K, NBN, NBK, BLOCK_SIZE: tl.constexpr,  # type: ignore[no-untyped-def]
                     GROUP: tl.constexpr, ROWS: tl.constexpr):
        # The conversion kernel's grid, addressing and tile shapes, minus the arithmetic
        pid = tl.program_id(0)
        e64 = (pid // (NBN * NBK)).to(tl.int64)
        row0 = ((pid // NBK) % NBN).to(tl.int64) * BLOCK_SIZE
        bk = pid % NBK
        base = e64 * N * K + row0 * K + bk * BLOCK_SIZE
        s_blk = s_ptr + (e64 * N + row0) * (K // GROUP) + bk * (BLOCK_SIZE // GROUP)
        r = tl.arange(0, ROWS)
        g = tl.arange(0, BLOCK_SIZE // GROUP)
        woffs = r[:, None, None] * K + g[None, :, None] * GROUP + tl.arange(0, GROUP)[None, None, :]
        soffs = r[:, None] * (K // GROUP) + g[None, :]
        acc = 0
        for t in tl.static_range(0, BLOCK_SIZE, ROWS):
            tl.store(out_ptr + base + t * K + woffs, tl.load(w_ptr + base + t * K + woffs))
            acc += tl.sum(tl.sum(tl.load(s_blk + t * (K // GROUP) + soffs).to(tl.int32), 1), 0)
        tl.store(os_ptr + pid, tl.cast(acc, tl.float32))


def module_text_from_patch(patch: Path) -> str:
    return new_file_from_patch(patch.read_text(encoding="utf-8"), NEW_MODULE)


def load_module(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def module_from_patch(patch: Path) -> ModuleType:
    path = Path(tempfile.mkdtemp()) / "m3patch_mxfp8_block.py"
    path.write_text(module_text_from_patch(patch), encoding="utf-8")
    return load_module(path, "m3patch_mxfp8_block")


def random_mxfp8(shape: tuple[int, int, int], device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device=device).manual_seed(seed)
    e, n, k = shape
    # Gaussian values over most of the e4m3 range; 1x32 scales spread over 2^7 within a block
    values = (torch.randn(shape, generator=gen, device=device) * 64).clamp_(-448, 448)
    scales = torch.randint(120, 128, (e, n, k // 32), generator=gen, device=device, dtype=torch.uint8)
    return values.to(torch.float8_e4m3fn), scales


def check_expert(mod: ModuleType, w: torch.Tensor, s: torch.Tensor, wq: torch.Tensor,
                 sq: torch.Tensor, e: int, fnuz: bool) -> dict[str, float]:
    ref = mod.dequant_mxfp8(w[e], s[e])
    got = mod.dequant_block_fp8(wq[e], sq[e])
    fn_scale = sq[e] / 2 if fnuz else sq[e]
    floor = (2.0**-10) * fn_scale.repeat_interleave(128, 0).repeat_interleave(128, 1)
    bound = (2.0**-4 + 2.0**-22) * ref.abs() + floor
    err = (got - ref).abs()
    ok = bool(torch.isfinite(got).all()) and bool((err <= bound).all())
    rel = float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))
    return {"rel_err": rel, "max_err_over_bound": float((err / bound).max()), "bound_ok": float(ok)}


def cuda_time_ms(fn: Callable[[], Any], iters: int) -> float:
    fn()  # compile / warm up
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


def parse_variant(spec: str) -> tuple[str, int, int]:
    kind, _, cfg = spec.partition(":")
    warps, rows = (int(v) for v in cfg.split("x")) if cfg else (0, 0)
    return kind, warps, rows


def variant_call(spec: str, mod: ModuleType, base: ModuleType | None, w: torch.Tensor,
                 s: torch.Tensor, fnuz: bool) -> Callable[[], Any]:
    kind, warps, rows = parse_variant(spec)
    if kind == "torchcopy":
        dst = torch.empty_like(w.view(torch.uint8))
        return lambda: dst.copy_(w.view(torch.uint8))
    if kind == "copy":
        e, n, k = w.shape
        out = torch.empty_like(w.view(torch.uint8))
        sums = torch.empty((e, n // 128, k // 128), dtype=torch.float32, device=w.device)
        grid = (e * (n // 128) * (k // 128),)
        return lambda: _copy_kernel[grid](w.view(torch.uint8), s, out, sums, n, k, n // 128,
                                          k // 128, BLOCK_SIZE=128, GROUP=32, ROWS=rows,
                                          num_warps=warps)
    if kind == "default":
        return lambda: mod.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz)
    if kind == "baseline":
        assert base is not None, "baseline needs --baseline-module"
        return lambda: base.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz, impl="triton")
    return lambda: mod.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz, impl="triton", codec=kind,
                                                  num_warps=warps, tile_rows=rows)


def check_variant(mod: ModuleType, out: tuple[torch.Tensor, torch.Tensor], w: torch.Tensor,
                  s: torch.Tensor, fnuz: bool) -> dict[str, Any]:
    wq, sq = out
    checks = [check_expert(mod, w, s, wq, sq, e, fnuz) for e in sorted({0, w.shape[0] // 2, w.shape[0] - 1})]
    tq, ts = mod.convert_mxfp8_to_block_fp8(w[:1].contiguous(), s[:1].contiguous(), fnuz=fnuz, impl="torch")
    return {"rel_err_max": max(c["rel_err"] for c in checks),
            "err_over_bound_max": max(c["max_err_over_bound"] for c in checks),
            "bound_ok": all(c["bound_ok"] == 1.0 for c in checks), "experts_checked": len(checks),
            "bytes_differing_from_torch_path_expert0": int((wq[:1].view(torch.uint8) != tq.view(torch.uint8)).sum()),
            "scales_equal_torch_path_expert0": bool(torch.equal(sq[:1], ts))}


def bench_tensor(name: str, shape: tuple[int, int, int], variants: list[str], mod: ModuleType,
                 base: ModuleType | None, args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    w, s = random_mxfp8(shape, args.device, seed=SEEDS[name])
    results: dict[str, dict[str, Any]] = {}
    for spec in variants:
        for fnuz in (False, True) if spec in args.fnuz_too else (False,):
            call = variant_call(spec, mod, base, w, s, fnuz)
            row: dict[str, Any] = {"median_ms": args.time_ms(call, args.iters)}
            if parse_variant(spec)[0] not in ("copy", "torchcopy"):
                row.update(check_variant(mod, call(), w, s, fnuz))
            results[spec + (" fnuz" if fnuz else "")] = row
            print(f"{name} {spec}{' fnuz' if fnuz else ''}: {row}", flush=True)
    return results


def edge_blocks(device: str) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    raw = torch.arange(256, dtype=torch.int32).repeat(64).to(torch.uint8).view(1, 128, 128)
    raw = torch.where((raw & 0x7F) == 0x7F, 0, raw)  # every byte but NaN, 64 times
    cases = {f"all bytes, E8M0 {sb}": (raw, torch.full((1, 128, 4), sb, dtype=torch.uint8))
             for sb in (0, 1, 100, 126, 127, 140)}
    mixed = torch.randint(0, 256, (1, 128, 4), generator=torch.Generator().manual_seed(3)) % 9 + 122
    cases["all bytes, E8M0 122..130 per group"] = (raw, mixed.to(torch.uint8))
    zero = torch.zeros((1, 128, 128), dtype=torch.uint8)
    zero[0, :, 32:64] = 0x38
    scales = torch.zeros((1, 128, 4), dtype=torch.uint8)
    scales[0, :, 0] = 254
    cases["zero group under E8M0 254"] = (zero, scales)
    return {k: (w.to(device).view(torch.float8_e4m3fn), s.to(device)) for k, (w, s) in cases.items()}


def edge_checks(mod: ModuleType, codecs: list[str], device: str) -> dict[str, dict[str, int]]:
    """Bytes and scales differing from the torch path on the same device, per codec and case."""
    out: dict[str, dict[str, int]] = {}
    for codec in codecs:
        for fnuz in (False, True):
            for name, (w, s) in edge_blocks(device).items():
                tq, ts = mod.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz, impl="triton", codec=codec)
                rq, rs = mod.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz, impl="torch")
                out.setdefault(f"{codec}{' fnuz' if fnuz else ''}", {})[name] = int(
                    (tq.view(torch.uint8) != rq.view(torch.uint8)).sum()) + int((ts != rs).sum())
    print(f"edge cases (bytes + scales differing from the torch path): {out}", flush=True)
    return out


def summarize(per_tensor: dict[str, dict[str, dict[str, Any]]], shapes: dict[str, Any]) -> list[dict[str, Any]]:
    layer_bytes = sum(bytes_moved(shape) for shape in shapes.values())
    rows = []
    for label in next(iter(per_tensor.values())):
        parts = [per_tensor[name][label] for name in shapes]
        ms = sum(p["median_ms"] for p in parts)
        row: dict[str, Any] = {"variant": label, "layer_ms": ms, "w13_ms": parts[0]["median_ms"],
                               "w2_ms": parts[1]["median_ms"], "layer_bytes": layer_bytes,
                               "gb_per_s": layer_bytes / (ms * 1e-3) / 1e9}
        row["fraction_of_copy_ceiling"] = row["gb_per_s"] * 1e9 / COPY_CEILING_BPS
        if "bound_ok" in parts[0]:
            row.update({"rel_err_max": max(p["rel_err_max"] for p in parts),
                        "err_over_bound_max": max(p["err_over_bound_max"] for p in parts),
                        "bound_ok": all(p["bound_ok"] for p in parts),
                        "bytes_differing_from_torch_path": sum(p["bytes_differing_from_torch_path_expert0"] for p in parts),
                        "scales_equal_torch_path": all(p["scales_equal_torch_path_expert0"] for p in parts),
                        "model_load_s_per_rank_estimate": ms * M3_MOE_LAYERS_PER_RANK / 1e3})
            row["meets_target"] = row["fraction_of_copy_ceiling"] >= TARGET_FRACTION and row["bound_ok"]
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'variant':<16} {'layer ms':>9} {'w13 ms':>7} {'w2 ms':>7} {'GB/s':>7} {'%4.2TB/s':>8} "
            f"{'rel err':>9} {'err/bnd':>7} {'bound':>5} {'!=torch':>7}")
    out = [head, "-" * len(head)]
    for r in rows:
        line = (f"{r['variant']:<16} {r['layer_ms']:>9.3f} {r['w13_ms']:>7.3f} {r['w2_ms']:>7.3f} "
                f"{r['gb_per_s']:>7.0f} {r['fraction_of_copy_ceiling']:>8.1%}")
        if "bound_ok" in r:
            line += (f" {r['rel_err_max']:>9.2e} {r['err_over_bound_max']:>7.3f} "
                     f"{'ok' if r['bound_ok'] else 'FAIL':>5} {r['bytes_differing_from_torch_path']:>7}")
        out.append(line)
    out.append(f"bytes per layer {rows[0]['layer_bytes'] / 1e9:.3f} GB; target {TARGET_FRACTION:.0%} of "
               f"{COPY_CEILING_BPS / 1e12:.1f} TB/s = {rows[0]['layer_bytes'] / COPY_CEILING_BPS / TARGET_FRACTION * 1e3:.2f} ms; "
               f"!=torch: bytes of expert 0 (w13 + w2) differing from the torch path")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--patch", type=Path, default=DEFAULT_PATCH)
    parser.add_argument("--module", type=Path, help="load the module from this file instead")
    parser.add_argument("--baseline-module", type=Path, help="previous module, as variant 'baseline'")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--fnuz-too", default="fn:8x128,bits:8x128",
                        help="variants also run with fnuz=True (the gfx94x output convention)")
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "docs/results")))
    parser.add_argument("--stem", default="gpu_convert_variants")
    parser.add_argument("--small", action="store_true", help="tiny shapes (CPU/interpreter smoke run)")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--edge-cases", default="", help="codecs to compare on edge blocks, e.g. fn,bits")
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    # CUDA events need a GPU; the CPU smoke run (TRITON_INTERPRET=1) still checks numerics
    args.time_ms = cuda_time_ms if args.device == "cuda" else lambda fn, iters: (fn(), float("nan"))[1]
    args.fnuz_too = set(args.fnuz_too.split(",")) if args.fnuz_too else set()
    mod = load_module(args.module, "m3patch_mxfp8_block") if args.module else module_from_patch(args.patch)
    base = load_module(args.baseline_module, "baseline_block") if args.baseline_module else None
    variants = (["baseline"] if base else []) + args.variants.split(",")
    shapes = SMALL_SHAPES if args.small else M3_SHAPES
    edges = edge_checks(mod, args.edge_cases.split(","), args.device) if args.edge_cases else {}
    per_tensor = {name: bench_tensor(name, shape, variants, mod, base, args) for name, shape in shapes.items()}
    rows = summarize(per_tensor, shapes)
    env = {"device": torch.cuda.get_device_name() if args.device == "cuda" else platform.processor() or "cpu",
           "torch": torch.__version__, "triton": getattr(triton, "__version__", None),
           "native_codec": mod.native_codec(torch.device(args.device)),
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "command": " ".join([Path(sys.argv[0]).name, *(argv if argv is not None else sys.argv[1:])]),
           "iters": args.iters}
    text = table(rows)
    print(text)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.stem}.json").write_text(json.dumps({"env": env, "variants": rows, "per_tensor": per_tensor, "edge_cases": edges}, indent=2) + "\n")
    (args.out / f"{args.stem}.txt").write_text(f"{env}\n{text}\n")
    edges_ok = all(n == 0 for per_case in edges.values() for n in per_case.values())
    return 0 if edges_ok and all(r.get("bound_ok", True) for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
