"""End-to-end check of patch 0002's block-FP8 MoE path with vLLM 0.33.0's own fused_moe_kernel.

    python3 scripts/measure/h200/gpu_block_fp8_moe_e2e.py --vllm-source .devcarry [--batches 1,16,256,2048]
        [--out DIR] [--small] [--experts E] [--torch-paths bf16] [--reps 50]

One M3 TP8+EP8 rank (E=16 local experts, H=6144, I=3072, top-4 of the 16): random MXFP8 weights
(Gaussian e4m3 values; E8M0 bytes = base + a per-128x128-block offset in [0, 4) + a per-1x32-group
offset in [0, 8), so 1x32 scales vary inside every block and block scales differ between blocks,
which a misplaced block scale would show), converted by the module in the 0002 patch's new-file
hunk, then the whole layer as TritonExperts runs it:
  fp8   per-token-group (1x128) fp8 input -> GEMM1 (block-FP8 w13) -> SwiGLU-OAI uninterleave
        (gate = first half, up = second half; alpha 1.702, beta 1, limit 7) on bf16 -> 1x128 fp8
        -> GEMM2 (block-FP8 w2, routed weights) -> sum over top-k
  bf16  the path 0.33.0 runs on gfx942: MXFP8 dequantized to BF16, the same kernel in BF16 mode
Both with vLLM's default config for the batch (no tuned table for these shapes in 0.33.0).
Reference: float64, exact MXFP8 weights, bf16 input, no activation rounding.
Checks (exit 1 on any failure): no NaN/inf anywhere (outputs are NaN-poisoned first); fp8 layer
rel. error (Frobenius) <= ENVELOPE; each GEMM of each path vs float64 on its own operands <=
GEMM_BOUND (catches a misread layout at any size of error). Times: CUDA graphs of the two
kernels, and of the whole layer as scripted (torch glue: quant, SwiGLU, sum), interleaved, CUDA
event medians; alignment (a CUDA op in vLLM) is outside both. Writes e2e.json/e2e.txt to --out.
On a CPU: TRITON_INTERPRET=1 runs the fp8 kernel; `--torch-paths bf16` computes the BF16 GEMMs
in torch (the interpreter's BF16 dot is wrong), and with both paths in torch the run predicts
the errors at full size without a GPU.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from gpu_convert_bench import DEFAULT_PATCH, module_from_patch

from m3patch.tune import inputs
from m3patch.tune.kernel_source import load_kernel
from m3patch.tune.launch import GemmArgs, launch
from m3patch.tune.naming import default_config
from m3patch.tune.shapes import MoEShape

ALPHA, BETA, LIMIT = 1.702, 1.0, 7.0  # MiniMax M3 swiglu_alpha / beta / limit
# tests/payloads/test_payload_moe_layer.py measured 0.0554-0.0565 (weights + activation quant, CPU)
ENVELOPE = 0.057
# rounding the output to bf16 (8-bit significand) moves each element by <= 2^-8 of itself, so
# <= 2^-8 in Frobenius norm; fp32 accumulation adds far less than the gap between that worst
# case and typical rounding (1.7e-3 on the H200, docs/results/block-fp8-e2e)
GEMM_BOUND = 2.0**-8
M3 = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", (128, 128), True)
SMALL = MoEShape(4, 256, 256, 2, "fp8_w8a8", (128, 128), True)
# E8M0 base byte per hidden size: the CPU test's [112, 120) at K=512, two binades lower at
# K=6144 with the block offsets, so pre-activations clamp about as often (reported per batch)
BASE_E8M0 = {256: 110, 6144: 108}
BLOCK_SPREAD, GROUP_SPREAD = 4, 8


def random_mxfp8(e: int, n: int, k: int, base: int, gen: Any, dev: str) -> tuple[Any, Any]:
    values = (torch.randn((e, n, k), generator=gen, device=dev) * 64).clamp_(-448, 448)
    blocks = torch.randint(0, BLOCK_SPREAD, (e, n // 128, k // 128), generator=gen, device=dev)
    groups = torch.randint(0, GROUP_SPREAD, (e, n, k // 32), generator=gen, device=dev)
    e8m0 = base + blocks.repeat_interleave(128, 1).repeat_interleave(4, 2) + groups
    return values.to(torch.float8_e4m3fn), e8m0.to(torch.uint8)


@dataclasses.dataclass(frozen=True)
class MoEPath:
    """One way to run the layer: its weights as the kernel reads them and in float64."""

    name: str
    shape: MoEShape
    w13: Any
    s13: Any | None
    w2: Any
    s2: Any | None
    w13_64: Callable[[int], Any]
    w2_64: Callable[[int], Any]
    on_triton: bool

    @property
    def fp8(self) -> bool:
        return self.s13 is not None


def block_deq64(wq: Any, scale: Any) -> Any:
    full = scale.double().repeat_interleave(128, -2).repeat_interleave(128, -1)
    return wq.double() * full  # exact in float64: 4 x 24 significant bits


def make_paths(shape: MoEShape, mod: Any, gen: Any, dev: str, torch_paths: set[str]
               ) -> tuple[list[MoEPath], Callable[[int], Any], Callable[[int], Any], dict[str, Any]]:
    e, i, h = shape.num_experts, shape.width, shape.hidden
    m13 = random_mxfp8(e, 2 * i, h, BASE_E8M0[h], gen, dev)
    m2 = random_mxfp8(e, h, i, BASE_E8M0[h], gen, dev)
    q13, b13 = mod.convert_mxfp8_to_block_fp8(*m13, fnuz=False, what="w13")
    q2, b2 = mod.convert_mxfp8_to_block_fp8(*m2, fnuz=False, what="w2")
    exact13 = mod.dequant_mxfp8(*m13)  # float32 and exact (e4m3 x 2^k)
    exact2 = mod.dequant_mxfp8(*m2)
    conv = {name: rel_err(mod.dequant_block_fp8(q, b), x) for name, q, b, x in
            (("w13", q13, b13, exact13), ("w2", q2, b2, exact2))}
    bf13, bf2 = exact13.to(torch.bfloat16), exact2.to(torch.bfloat16)
    f64 = functools.partial(per_expert64, experts=e, keep=dev == "cuda")
    fp8 = MoEPath("fp8", shape, q13, b13, q2, b2, f64(lambda x: block_deq64(q13[x], b13[x])),
                  f64(lambda x: block_deq64(q2[x], b2[x])), "fp8" not in torch_paths)
    bf16 = MoEPath("bf16", dataclasses.replace(shape, dtype="bf16", block_shape=None), bf13,
                   None, bf2, None, f64(lambda x: bf13[x].double()),
                   f64(lambda x: bf2[x].double()), "bf16" not in torch_paths)
    return ([fp8, bf16], f64(lambda x: exact13[x].double()), f64(lambda x: exact2[x].double()),
            {"conversion_rel_err": conv})


def per_expert64(make: Callable[[int], Any], experts: int, keep: bool) -> Callable[[int], Any]:
    """Float64 weights of one expert: built once and kept (GPU), or per call (CPU memory)."""
    if not keep:
        return make
    kept = [make(x) for x in range(experts)]
    return kept.__getitem__


def expert_gemm64(x: Any, weight: Callable[[int], Any], ids: Any, *, row_per_slot: bool) -> Any:
    """out[t, s] = x[t*topk+s or t] @ weight(ids[t, s]).T in float64."""
    batch, top_k = ids.shape
    out: Any = None
    for expert in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == expert, as_tuple=True)
        part = x[tok * top_k + slot if row_per_slot else tok] @ weight(expert).T
        if out is None:
            out = torch.zeros((batch, top_k, part.shape[1]), dtype=torch.float64, device=x.device)
        out[tok, slot] = part
    return out


def swiglu_oai(h: Any) -> Any:
    """vLLM 0.33.0 SiluAndMulWithClamp (swigluoai_uninterleave): gate first, up second."""
    d = h.shape[-1] // 2
    gate, up = h[..., :d].clamp(max=LIMIT), h[..., d:].clamp(-LIMIT, LIMIT)
    return gate * torch.sigmoid(ALPHA * gate) * (up + BETA)


def quantize(path: MoEPath, x: Any) -> tuple[Any, Any]:
    return inputs.per_token_group_quant_fp8(x) if path.fp8 else (x, None)


def deq64(q: Any, scale: Any | None) -> Any:
    return q.double() if scale is None else q.double() * scale.double().repeat_interleave(128, -1)


class LayerRun:
    """Buffers, alignment and both GEMM launches of one path at one batch size."""

    def __init__(self, path: MoEPath, kernel: Any, hidden: Any, ids: Any, weights: Any) -> None:
        self.path, self.kernel, self.hidden, self.ids, self.weights = path, kernel, hidden, ids, weights
        batch, top_k = ids.shape
        self.config = default_config(path.shape, batch)
        self.align = inputs.moe_align_block_size(ids, self.config.block_m, path.shape.num_experts)
        dev, i, h = hidden.device, path.shape.width, path.shape.hidden
        self.c1 = torch.full((batch, top_k, 2 * i), float("nan"), dtype=torch.bfloat16, device=dev)
        self.c2 = torch.full((batch, top_k, h), float("nan"), dtype=torch.bfloat16, device=dev)
        self.cap = torch.cuda.get_device_capability() if dev.type == "cuda" else (0, 0)
        self.a, self.a_s = quantize(path, hidden)
        self.q2, self.q2_s = self.a, self.a_s  # replaced by the first full run

    def gemm(self, which: int) -> None:
        p, top_k = self.path, self.ids.shape[1]
        a, a_s, w, s, c = ((self.a, self.a_s, p.w13, p.s13, self.c1) if which == 1 else
                           (self.q2, self.q2_s, p.w2, p.s2, self.c2))
        if p.on_triton:
            args = GemmArgs(a, w, c, a_s, s, self.weights, self.align, which == 2,
                            top_k if which == 1 else 1)
            launch(self.kernel, args, self.config, block_shape=p.shape.block_shape,
                   capability=self.cap)
        else:  # CPU stand-in: the kernel's math in float64, rounded to its bf16 output
            c.copy_(self.emulate(which).to(torch.bfloat16))

    def emulate(self, which: int) -> Any:
        """float64 of the GEMM on exactly the operands the kernel gets."""
        if which == 1:
            return expert_gemm64(deq64(self.a, self.a_s), self.path.w13_64, self.ids,
                                 row_per_slot=False)
        out = expert_gemm64(deq64(self.q2, self.q2_s), self.path.w2_64, self.ids, row_per_slot=True)
        return out * self.weights.double()[..., None]

    def run(self) -> Any:
        self.a, self.a_s = quantize(self.path, self.hidden)
        self.gemm(1)
        act = swiglu_oai(self.c1.float()).to(torch.bfloat16).view(-1, self.path.shape.width)
        self.q2, self.q2_s = quantize(self.path, act)
        self.gemm(2)
        return self.c2.float().sum(1)

    def gemms(self) -> None:
        self.gemm(1)
        self.gemm(2)


def rel_err(got: Any, ref: Any) -> float:
    got, ref = got.double(), ref.double()
    return float(torch.linalg.vector_norm(got - ref) / torch.linalg.vector_norm(ref))


def reference(hidden: Any, ids: Any, weights: Any, w13: Callable[[int], Any],
              w2: Callable[[int], Any]) -> tuple[Any, float]:
    pre = expert_gemm64(hidden.double(), w13, ids, row_per_slot=False)
    d = pre.shape[-1] // 2
    clamped = float(((pre[..., :d] > LIMIT) | (pre[..., d:].abs() > LIMIT)).double().mean())
    act = swiglu_oai(pre).reshape(-1, d)
    out = expert_gemm64(act, w2, ids, row_per_slot=True) * weights.double()[..., None]
    return out.sum(1), clamped


def graph_of(fn: Callable[[], Any]) -> Any:
    fn()  # compile and allocate outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    return graph


def time_graphs(graphs: dict[str, Any], reps: int) -> dict[str, float]:
    """Median microseconds per replay; the graphs alternate so drift hits all alike."""
    cuda: Any = torch.cuda  # torch's Event constructor is untyped
    samples: dict[str, list[tuple[Any, Any]]] = {name: [] for name in graphs}
    for _ in range(reps):
        for name, graph in graphs.items():
            start, end = cuda.Event(enable_timing=True), cuda.Event(enable_timing=True)
            start.record()
            graph.replay()
            end.record()
            samples[name].append((start, end))
    torch.cuda.synchronize()
    return {name: statistics.median(s.elapsed_time(e) * 1e3 for s, e in pairs)
            for name, pairs in samples.items()}


def finite(*tensors: Any) -> bool:
    return all(bool(torch.isfinite(t.float()).all()) for t in tensors)


class ErrorSum:
    """Frobenius relative error over several draws: sum of squares, then one ratio."""

    def __init__(self) -> None:
        self.diff2, self.ref2, self.worst = 0.0, 0.0, 0.0

    def add(self, got: Any, ref: Any) -> None:
        d2 = float(torch.sum((got.double() - ref.double()) ** 2))
        r2 = float(torch.sum(ref.double() ** 2))
        self.diff2, self.ref2 = self.diff2 + d2, self.ref2 + r2
        self.worst = max(self.worst, (d2 / r2) ** 0.5) if r2 > 0 else float("inf")

    @property
    def rel(self) -> float:
        return (self.diff2 / self.ref2) ** 0.5 if self.ref2 > 0 else float("inf")


def accuracy(paths: list[MoEPath], refs: tuple[Callable[[int], Any], Callable[[int], Any]],
             kernel: Any, batch: int, gen: Any, args: argparse.Namespace
             ) -> tuple[dict[str, Any], dict[str, LayerRun]]:
    """Errors of each path over draws of `batch` tokens holding >= args.min_pairs (token,
    expert) pairs in all (a 4-pair draw alone is a noisy estimate); the last draw's runs."""
    shape, dev = paths[0].shape, args.device
    draws = max(1, -(-args.min_pairs // (batch * shape.top_k)))
    sums = {(p.name, what): ErrorSum() for p in paths for what in ("layer", "gemm1", "gemm2")}
    finite_all, clamped, runs = dict.fromkeys([p.name for p in paths], True), 0.0, {}
    for _ in range(draws):
        hidden = torch.randn((batch, shape.hidden), generator=gen, device=dev).to(torch.bfloat16)
        ids, weights = inputs.random_routing(batch, shape, gen, dev)
        ref, frac = reference(hidden, ids, weights, *refs)
        clamped += frac / draws
        for path in paths:
            run = runs[path.name] = LayerRun(path, kernel, hidden, ids, weights)
            out = run.run()
            finite_all[path.name] &= finite(run.c1, run.c2, out)
            sums[path.name, "layer"].add(out, ref)
            sums[path.name, "gemm1"].add(run.c1, run.emulate(1))
            sums[path.name, "gemm2"].add(run.c2, run.emulate(2))
    row: dict[str, Any] = {"batch": batch, "draws": draws, "clamped_preactivations": clamped}
    for path in paths:
        row[path.name] = {"config": runs[path.name].config.key, "on_triton": path.on_triton,
                          "finite": finite_all[path.name],
                          "layer_rel_err": sums[path.name, "layer"].rel,
                          "layer_rel_err_worst_draw": sums[path.name, "layer"].worst,
                          "gemm1_vs_own_operands": sums[path.name, "gemm1"].rel,
                          "gemm2_vs_own_operands": sums[path.name, "gemm2"].rel}
    return row, runs


def check_batch(paths: list[MoEPath], refs: tuple[Callable[[int], Any], Callable[[int], Any]],
                kernel: Any, batch: int, gen: Any, args: argparse.Namespace) -> dict[str, Any]:
    row, runs = accuracy(paths, refs, kernel, batch, gen, args)
    graphs: dict[str, Any] = {}
    for name, run in runs.items():
        if args.device == "cuda" and run.path.on_triton:
            # the layer graph first: it re-allocates the GEMM inputs, which the gemms graph reads
            graphs[f"{name}_layer_us"] = graph_of(run.run)
            graphs[f"{name}_gemms_us"] = graph_of(run.gemms)
    if graphs:
        row.update(time_graphs(graphs, args.reps))
        if "fp8_gemms_us" in row and "bf16_gemms_us" in row:
            row["bf16_over_fp8_gemms"] = row["bf16_gemms_us"] / row["fp8_gemms_us"]
            row["bf16_over_fp8_layer"] = row["bf16_layer_us"] / row["fp8_layer_us"]
    row["pass"] = verdict(row, paths)
    return row


def verdict(row: dict[str, Any], paths: list[MoEPath]) -> bool:
    ok = all(row[p.name]["finite"] for p in paths)  # NaN compares False below too
    ok = ok and row["fp8"]["layer_rel_err"] <= ENVELOPE
    return ok and all(row[p.name][g] <= GEMM_BOUND for p in paths
                      for g in ("gemm1_vs_own_operands", "gemm2_vs_own_operands"))


def table(rows: list[dict[str, Any]]) -> str:
    head = (f"{'M':>5} {'fp8 cfg':<22} {'fp8 err':>8} {'bf16 err':>8} {'fp8 g1/g2 own':>15} "
            f"{'bf16 g1/g2 own':>15} {'fp8 us':>8} {'bf16 us':>8} {'bf16/fp8':>8} "
            f"{'layer fp8':>9} {'layer bf16':>10} {'clamp':>6} {'ok':>4}")
    out = [head, "-" * len(head)]
    for r in rows:
        f, b = r["fp8"], r["bf16"]

        def us(key: str, row: dict[str, Any] = r) -> float:
            return float(row.get(key, float("nan")))

        out.append(
            f"{r['batch']:>5} {f['config']:<22} {f['layer_rel_err']:>8.4f} {b['layer_rel_err']:>8.4f} "
            f"{f['gemm1_vs_own_operands']:>7.1e}/{f['gemm2_vs_own_operands']:<7.1e} "
            f"{b['gemm1_vs_own_operands']:>7.1e}/{b['gemm2_vs_own_operands']:<7.1e} "
            f"{us('fp8_gemms_us'):>8.1f} {us('bf16_gemms_us'):>8.1f} {us('bf16_over_fp8_gemms'):>8.2f} "
            f"{us('fp8_layer_us'):>9.1f} {us('bf16_layer_us'):>10.1f} "
            f"{r['clamped_preactivations']:>6.2%} {'ok' if r['pass'] else 'FAIL':>4}")
    out.append(f"fp8/bf16 err: layer vs float64 MXFP8 reference (fp8 bound {ENVELOPE}); g1/g2 own: "
               f"each GEMM vs float64 on its own operands (bound 2^-8); us: CUDA-graph medians of "
               f"GEMM1+GEMM2 (layer: + torch glue); any non-finite value fails")
    return "\n".join(out)


def environment(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    env: dict[str, Any] = {
        "torch": torch.__version__, "triton": getattr(sys.modules.get("triton"), "__version__", None),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["scripts/measure/h200/gpu_block_fp8_moe_e2e.py", *argv]),
        "triton_interpret": os.environ.get("TRITON_INTERPRET", "0")}
    if args.device == "cuda":
        env["device"] = torch.cuda.get_device_name()
        env["capability"] = list(torch.cuda.get_device_capability())
        query = ["nvidia-smi", "--query-gpu=driver_version,clocks.max.sm,clocks.max.mem",
                 "--format=csv,noheader"]
        try:
            env["driver_clocks"] = subprocess.run(query, capture_output=True, text=True,
                                                  check=False, timeout=30).stdout.strip()
        except OSError:
            env["driver_clocks"] = None
    return env


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vllm-source", type=Path, help="dir with vllm/.../fused_moe.py")
    parser.add_argument("--patch", type=Path, default=DEFAULT_PATCH)
    parser.add_argument("--batches", default="1,16,256,2048")
    parser.add_argument("--small", action="store_true", help="E=4, H=I=256, top-2 (CPU)")
    parser.add_argument("--experts", type=int, help="override E (top-k stays)")
    parser.add_argument("--torch-paths", default="", help="paths computed in torch: fp8,bf16")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--min-pairs", type=int, default=1024, help="per error estimate")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "e2e-out")))
    argv = sys.argv[1:] if argv is None else argv
    args = parser.parse_args(argv)
    args.device = "cuda" if torch.cuda.is_available() else "cpu"
    torch_paths = {p for p in args.torch_paths.split(",") if p}
    shape = SMALL if args.small else M3
    if args.experts:
        shape = dataclasses.replace(shape, num_experts=args.experts)
    kernel = load_kernel(args.vllm_source).kernel if torch_paths != {"fp8", "bf16"} else None
    gen = torch.Generator(device=args.device).manual_seed(args.seed)
    paths, ref13, ref2, extra = make_paths(shape, module_from_patch(args.patch), gen,
                                           args.device, torch_paths)
    refs = (ref13, ref2)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        rows.append(check_batch(paths, refs, kernel, batch, gen, args))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    text = table(rows)
    print(text)
    result = {"env": environment(args, argv), "shape": dataclasses.asdict(shape),
              "weights": {"e8m0_base": BASE_E8M0[shape.hidden], "block_offset_range": BLOCK_SPREAD,
                          "group_offset_range": GROUP_SPREAD, **extra},
              "bounds": {"fp8_layer_rel_err": ENVELOPE, "gemm_vs_own_operands": GEMM_BOUND},
              "rows": rows, "pass": all(r["pass"] for r in rows)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "e2e.json").write_text(json.dumps(result, indent=1) + "\n")
    (args.out / "e2e.txt").write_text(f"{result['env']}\n{text}\n")
    return 0 if result["pass"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
