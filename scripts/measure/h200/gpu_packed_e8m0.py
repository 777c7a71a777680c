"""Validate and time patch 0006 (packed E8M0 weight scales) against vLLM 0.33.0's unpacked kernel.

Needs only torch, triton and the standard library (no vLLM):
  * the packed kernel module is taken from the patch text (the new file it adds);
  * the baseline is vLLM's own `_select_cfg`, `_mxfp8_grouped_gemm_kernel` and `_grouped_gemm_mxfp8`,
    cut out of a carried copy of mxfp8_native_moe.py (`--baseline`, default
    .devcarry/vllm_mxfp8_native_moe_baseline.py: gitignored, never committed).

Device:    python scripts/measure/h200/gpu_packed_e8m0.py --out "$OUT"
CPU debug: python scripts/measure/h200/gpu_packed_e8m0.py --interpret --out /tmp/pe8
  (TRITON_INTERPRET=1 with tiny shapes; the interpreter has no dot_scaled, so this mode substitutes
  an fp32 emulation of it for BOTH kernels: it checks indexing and unpacking, not dot_scaled.)
Writes packed_e8m0.json and prints a table; exits 1 if any packed output differs from unpacked.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.util
import json
import os
import platform
import shlex
import statistics
import sys
import tempfile
from pathlib import Path
from types import ModuleType
from typing import Any

from patch_payload import new_file_from_patch

REPO = Path(__file__).resolve().parents[3]
PATCH = REPO / "patches/vllm-0.33.0/0006-packed-e8m0-scales.patch"
NEW_MODULE = "vllm/model_executor/layers/fused_moe/experts/m3patch_packed_e8m0.py"
BASELINE = REPO / ".devcarry/vllm_mxfp8_native_moe_baseline.py"
BASELINE_DEFS = ("_select_cfg", "_mxfp8_grouped_gemm_kernel", "_grouped_gemm_mxfp8")
HIDDEN, INTER, TOP_K, EXPERTS, BLOCK_M = 6144, 3072, 4, 128, 64
# (label, moe tp, ep): E_local = 128/ep, I_tp = 3072/tp (shared/design/vllm-0.33.md section 4.3)
DEPLOYMENTS = (("TP8", 8, 1), ("TP4", 4, 1), ("TP8+EP8", 1, 8))
DECODE, PREFILL = (1, 16, 64), (2048, 8192)
# Appended to the kernel module so it calls the module's own unpack helper, compiled for real.
PROBE = """

@triton.jit
def _unpack_probe_kernel(words_ptr, out_ptr, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_w = tl.arange(0, BLOCK_K // 128)
    words = tl.load(words_ptr + offs_w[None, :] * N + offs_n[:, None])
    tile = _unpack_scale_tile(words, BLOCK_N, BLOCK_K)
    offs_g = tl.arange(0, BLOCK_K // 32)
    tl.store(out_ptr + offs_n[:, None] * (BLOCK_K // 32) + offs_g[None, :], tile)
"""


def baseline_source(vllm_file: Path) -> str:
    text = vllm_file.read_text()
    tree = ast.parse(text)
    lines = text.split("\n")
    parts = ["import torch", "import triton", "import triton.language as tl", ""]
    for node in tree.body:
        if isinstance(node, ast.FunctionDef) and node.name in BASELINE_DEFS:
            first = min([d.lineno for d in node.decorator_list] + [node.lineno])
            parts.append("\n".join(lines[first - 1 : node.end_lineno]) + "\n")
    if len(parts) != 4 + len(BASELINE_DEFS):
        raise SystemExit(f"{vllm_file}: could not find all of {BASELINE_DEFS}")
    return "\n\n".join(parts)


def load_module(name: str, source: str, workdir: Path) -> ModuleType:
    # triton.jit reads kernel source with inspect, so the module must live in a real file.
    path = workdir / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def patch_interpreter() -> None:
    """CPU debug only: give Triton 3.6's interpreter a dot_scaled and numpy-2 scalar indexing."""
    import triton.language as tl
    from triton.runtime import interpreter

    original = interpreter._patch_lang_tensor

    def lang_tensor(tensor, scope):  # type: ignore[no-untyped-def]
        original(tensor, scope)
        # numpy >= 2.4 refuses int() of a 1-element array, which the interpreter relies on.
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = lang_tensor

    def emulated(lhs, lhs_scale, lhs_format, rhs, rhs_scale, rhs_format, **_kw):  # type: ignore[no-untyped-def]
        m, k = lhs.shape
        n = rhs.shape[1]
        sa = tl.exp2(lhs_scale.to(tl.float32) - 127.0)
        sb = tl.exp2(rhs_scale.to(tl.float32) - 127.0)
        a = tl.reshape(tl.reshape(lhs.to(tl.float32), (m, k // 32, 32)) * sa[:, :, None], (m, k))
        bt = tl.reshape(tl.trans(rhs).to(tl.float32), (n, k // 32, 32)) * sb[:, :, None]
        return tl.dot(a, tl.trans(tl.reshape(bt, (n, k))), input_precision="ieee")

    tl.dot_scaled = emulated


def align(topk_ids: Any, e_local: int, torch: Any) -> tuple[Any, Any, Any]:
    """Sort routed rows by local expert, pad each to BLOCK_M (as moe_align_block_size does)."""
    flat = topk_ids.flatten()
    m = flat.numel()
    chunks, experts = [], []
    for e in range(e_local):
        rows = (flat == e).nonzero().flatten().to(torch.int32)
        if rows.numel():
            pad = -rows.numel() % BLOCK_M
            chunks += [rows, torch.full((pad,), m, dtype=torch.int32, device=flat.device)]
            experts += [e] * ((rows.numel() + pad) // BLOCK_M)
    used = sum(c.numel() for c in chunks)
    cap = m + e_local * (BLOCK_M - 1)  # vLLM's buffer size: programs past num_post exit early
    cap += -cap % BLOCK_M
    chunks.append(torch.full((cap - used,), m, dtype=torch.int32, device=flat.device))
    experts += [0] * ((cap - used) // BLOCK_M)
    dev = flat.device
    return (
        torch.cat(chunks),
        torch.tensor(experts, dtype=torch.int32, device=dev),
        torch.tensor([used], dtype=torch.int32, device=dev),
    )


def make_case(
    e_local: int,
    e_global: int,
    n: int,
    k: int,
    rows_a: int,
    t: int,
    scale_bytes: tuple[int, int],
    dev: str,
    seed: int,
) -> dict[str, Any]:
    import torch

    g = torch.Generator(device=dev).manual_seed(seed)
    fp8 = torch.float8_e4m3fn
    bytes_lo, bytes_hi = scale_bytes
    # Route over all global experts; under EP this rank owns experts [0, e_local).
    topk = torch.rand(t, e_global, generator=g, device=dev).topk(TOP_K).indices
    sorted_ids, expert_ids, num_post = align(topk, e_local, torch)
    return {
        "a": torch.randn(rows_a, k, generator=g, device=dev).to(fp8),
        "a_s": torch.randint(
            bytes_lo, bytes_hi + 1, (rows_a, k // 32), generator=g, device=dev, dtype=torch.uint8
        ),
        "w": torch.randn(e_local, n, k, generator=g, device=dev).to(fp8),
        "w_s": torch.randint(
            bytes_lo,
            bytes_hi + 1,
            (e_local, n, k // 32),
            generator=g,
            device=dev,
            dtype=torch.uint8,
        ),
        "topk": topk,
        "sorted": sorted_ids,
        "experts": expert_ids,
        "num_post": num_post,
        "weights": torch.rand(t * TOP_K, generator=g, device=dev),
        "ep": e_local != e_global,
    }


def launchers(case: dict[str, Any], gemm: int, base: ModuleType, pk: ModuleType) -> tuple[Any, Any]:
    import torch

    m = case["topk"].numel()
    a_div, out_dtype = (TOP_K, torch.bfloat16) if gemm == 1 else (1, torch.float32)
    mul = case["weights"] if gemm == 2 else None
    emap = case["topk"] if case["ep"] else None  # only its presence matters to both launchers
    w_packed = pk.pack_e8m0_scales(case["w_s"])
    _, n, k = case["w"].shape
    cfg = base._select_cfg(m, n, k, BLOCK_M)
    common = (case["sorted"], case["experts"], case["num_post"], m)

    def unpacked() -> Any:
        return base._grouped_gemm_mxfp8(
            case["a"],
            case["a_s"],
            case["w"],
            case["w_s"],
            *common,
            TOP_K,
            BLOCK_M,
            out_dtype,
            a_div,
            mul,
            emap,
        )

    def packed() -> Any:
        return pk.grouped_gemm_mxfp8_packed(
            case["a"],
            case["a_s"],
            case["w"],
            w_packed,
            *common,
            BLOCK_M,
            out_dtype,
            a_div,
            cfg,
            mul,
            emap,
        )

    return unpacked, packed


def reference(case: dict[str, Any], gemm: int) -> Any:
    """fp32 dequant-then-matmul, rows of local experts only."""
    import torch

    def deq(x: Any, s: Any) -> Any:
        shape = x.shape
        groups = x.float().reshape(*shape[:-1], shape[-1] // 32, 32)
        return (groups * torch.exp2(s.float() - 127.0)[..., None]).reshape(shape)

    flat = case["topk"].flatten()
    a_div = TOP_K if gemm == 1 else 1
    a = deq(case["a"], case["a_s"])
    out = torch.zeros(flat.numel(), case["w"].shape[1], device=a.device)
    for e in range(case["w"].shape[0]):
        rows = (flat == e).nonzero().flatten()
        if rows.numel():
            out[rows] = a[rows // a_div] @ deq(case["w"][e], case["w_s"][e]).T
    if gemm == 2:
        out *= case["weights"][:, None]
    return out


def unpack_probe(pk: ModuleType, dev: str) -> dict[str, Any]:
    """Every byte value 0..255 at every position of a word survives pack -> kernel unpack."""
    import torch

    n, groups = 256, 8
    grid = torch.arange(n)[:, None] + 37 * torch.arange(groups)[None, :]
    scale = (grid % 256).to(torch.uint8)[None].to(dev)
    out = torch.empty(n, groups, dtype=torch.uint8, device=dev)
    pk._unpack_probe_kernel[(n // 128,)](
        pk.pack_e8m0_scales(scale), out, n, BLOCK_N=128, BLOCK_K=32 * groups
    )
    result = {"equal": bool(torch.equal(out, scale[0])), "bytes_covered": 256}
    print(json.dumps({"unpack_probe": result}), flush=True)
    return result


def bitwise_equal(x: Any, y: Any) -> bool:
    import torch

    as_int = torch.int16 if x.element_size() == 2 else torch.int32
    return bool(torch.equal(x.view(as_int), y.view(as_int)))


def check_and_time(args: argparse.Namespace, base: ModuleType, pk: ModuleType) -> dict[str, Any]:
    deployments = (("tiny", 1, 1),) if args.interpret else DEPLOYMENTS
    checks: list[dict[str, Any]] = []
    timings: list[dict[str, Any]] = []
    for label, tp, ep in deployments:
        e_global = 4 if args.interpret else EXPERTS
        i_tp = 128 if args.interpret else INTER // tp
        hidden = 256 if args.interpret else HIDDEN
        for gemm, n, k in ((1, 2 * i_tp, hidden), (2, hidden, i_tp)):
            shape = {"deployment": label, "gemm": gemm, "E": e_global // ep, "N": n, "K": k}
            try:
                run_shape(args, base, pk, shape, e_global, checks, timings)
            except Exception as exc:  # record and go on: one device call must report every shape
                checks.append({**shape, "error": repr(exc)[:2000], "bitwise_equal": False})
                print(json.dumps(checks[-1]), flush=True)
    return {"checks": checks, "timings": timings}


def run_shape(
    args: argparse.Namespace,
    base: ModuleType,
    pk: ModuleType,
    shape: dict[str, Any],
    e_global: int,
    checks: list[dict[str, Any]],
    timings: list[dict[str, Any]],
) -> None:
    import triton

    dev = "cpu" if args.interpret else "cuda"
    batches = (3, 40) if args.interpret else DECODE + PREFILL
    all_bytes_t, ref_ts = (40, (3, 40)) if args.interpret else (64, (1, 64, 2048))
    gemm, e_local, n, k = shape["gemm"], shape["E"], shape["N"], shape["K"]
    for t in batches:
        row = {**shape, "T": t}
        rows_a = t if gemm == 1 else t * TOP_K
        for kind, lo, hi in (("realistic", 112, 140), ("all-bytes", 0, 255)):
            if kind == "all-bytes" and t != all_bytes_t:
                continue
            case = make_case(e_local, e_global, n, k, rows_a, t, (lo, hi), dev, seed=t + 7 * gemm)
            unpacked, packed = launchers(case, gemm, base, pk)
            ref_out, out = unpacked(), packed()
            check = {**row, "scales": kind, "bitwise_equal": bitwise_equal(ref_out, out)}
            if kind == "realistic" and t in ref_ts:
                ref = reference(case, gemm)
                err = (out.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)
                check["max_rel_err_vs_fp32_ref"] = float(err)
            checks.append(check)
            print(json.dumps(check), flush=True)
            if kind == "realistic" and not args.interpret:
                timings.append({**row, **time_pair(unpacked, packed, triton)})
            del case


def time_pair(unpacked: Any, packed: Any, triton: Any) -> dict[str, float]:
    # Alternate the two a few rounds so clock/thermal drift hits both alike; median of medians.
    tu, tp = [], []
    for _ in range(3):
        tu.append(triton.testing.do_bench(unpacked, warmup=10, rep=40, return_mode="median"))
        tp.append(triton.testing.do_bench(packed, warmup=10, rep=40, return_mode="median"))
    u, p = statistics.median(tu), statistics.median(tp)
    return {
        "unpacked_us": round(u * 1e3, 2),
        "packed_us": round(p * 1e3, 2),
        "speedup": round(u / p, 4),
    }


def print_table(timings: list[dict[str, Any]]) -> None:
    print(
        f"{'deploy':8} {'gemm':>4} {'E':>4} {'N':>5} {'K':>5} {'T':>5} "
        f"{'unpacked us':>12} {'packed us':>10} {'speedup':>8}"
    )
    for r in timings:
        print(
            f"{r['deployment']:8} {r['gemm']:>4} {r['E']:>4} {r['N']:>5} {r['K']:>5} {r['T']:>5} "
            f"{r['unpacked_us']:>12} {r['packed_us']:>10} {r['speedup']:>8}"
        )


def meta(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    import triton

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (TRITON_INTERPRET)"
    return {
        "command": shlex.join([sys.executable, *sys.argv]),
        "device": gpu,
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "interpret": args.interpret,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "patch": str(PATCH.relative_to(REPO)),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--baseline", type=Path, default=BASELINE)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    if args.interpret:
        os.environ["TRITON_INTERPRET"] = "1"
    with tempfile.TemporaryDirectory() as tmp:
        source = new_file_from_patch(PATCH.read_text(), NEW_MODULE) + PROBE
        pk = load_module("m3patch_packed_e8m0", source, Path(tmp))
        base = load_module("vllm_unpacked_baseline", baseline_source(args.baseline), Path(tmp))
        if args.interpret:
            patch_interpreter()
        probe = unpack_probe(pk, "cpu" if args.interpret else "cuda")
        result = {"meta": meta(args), "unpack_probe": probe, **check_and_time(args, base, pk)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "packed_e8m0.json").write_text(json.dumps(result, indent=1) + "\n")
    print_table(result["timings"])
    bad = [c for c in result["checks"] if not c["bitwise_equal"]]
    bad += [probe] if not probe["equal"] else []
    print(f"checks: {len(result['checks'])}, bitwise mismatches: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
