"""vLLM 0.33.0's own MiniMax-M3 MoE layer, with the m3patch series applied, on one GPU.

    python3 scripts/measure/h200/gpu_moe_layer_h200.py --out DIR [--batches 1,2,4,...] [--small]

Runs with a patched vLLM 0.33.0 tree of `.py`/`.json` files first on PYTHONPATH (no compiled
extensions) and `M3PATCH_MXFP8_MOE=block_fp8` (the conversion is opt-in on CUDA). The five
compiled ops the layer calls are torch stand-ins, each checked against its definition first
(scripts/measure/h200/gpu_vllm_standins.py); vLLM's Python, the patch and the Triton kernels are the real
ones. The layer is built the way vLLM's loader builds it:
  - `get_quantization_config("mxfp8").from_config(...)`: the ModelOpt MXFP8 config a MiniMax
    checkpoint (`quant_method: mxfp8`) gets;
  - `FusedMoEFactory` with M3's arguments (sigmoid routing with a score-correction bias, top-4,
    routed scale 2, swigluoai_uninterleave alpha 1.702 beta 1 limit 7, fp32 router logits,
    bf16 params) under `set_current_vllm_config`, at world size 1;
  - MXFP8 weights and E8M0 scales (`weight_scale_inv`, renamed as the model's loader does)
    through the layer's weight loaders, expert by expert, via `fused_moe_make_expert_params_mapping`;
  - vLLM's `process_weights_after_loading` (patch 0002's conversion to block FP8);
  - the layer's forward inside `set_forward_context`.
Shapes: one TP8 rank (E=128, I/tp=384) and the per-rank shape of EP8 (E=16, I=3072); with one
GPU the EP8-shaped layer routes top-4 over its 16 experts (no expert map). H=6144.
Checks (exit 1 on any failure): each stand-in against its definition; the block-FP8 marker per
layer, the self-check line, the m3patch table folder for both shapes, split-K (`m3patch[split-k]`
and splits at M<=4, where the TP8 table asks), no forbidden line (emulation, default config,
split-K fallback); the quant config is block [128, 128] fp8_w8a8 on TritonExperts; the split-K
workspace allocated by the table read in a profiling forward (M=256, no split), on vLLM's
stream; at every M the eager output vs float64 of the layer's own converted operands within
OWN_BOUND (catches a misread layout or quant config), no NaN; per layer, the error vs the
float64 reference of the MXFP8 layer (exact dequantized MXFP8 weights, no activation rounding)
pooled over all M within ENVELOPE (per M it is reported: over one or two tokens it scatters
around the pooled value); a CUDA graph holding three TP8 layers (one split-K workspace) replayed
bitwise equal to eager; counters back to zero. Times: CUDA-event medians, eager forward and
graph replay per layer. Writes layer.json / layer.txt / vllm.log.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import logging
import os
import shutil
import socket
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_vllm_standins as standins

H, TOP_K, I_FULL = 6144, 4, 3072
ALPHA, BETA, LIMIT, ROUTED_SCALE = 1.702, 1.0, 7.0, 2.0
# the kernel-level run of the same weight statistics measured 0.0558-0.0560 (EP8 shape,
# docs/results/block-fp8-e2e): block-FP8 weight requant plus 1x128 activation quant
ENVELOPE = 0.057
# vs the layer's own operands only roundings remain: fp32 accumulation against float64, and
# where that moves a bf16 intermediate across a step of the 1x128 fp8 requantization, one fp8
# step. The first H200 run measured 4.0e-3 to 7.9e-3 at M = 1..256 (docs/results/moe-layer-h200);
# the threshold is twice that, and the negative control (block scales read per tensor) has
# to land above four times it, so the check can tell a wrong quant config from rounding
OWN_BOUND = 2.0**-6
E8M0_BASE, BLOCK_SPREAD, GROUP_SPREAD = 108, 4, 8  # as scripts/measure/h200/gpu_block_fp8_moe_e2e.py
GRAPH_LAYERS = 3
REPS = 20
REQUIRED = ("m3patch[mxfp8->block_fp8]: ", "m3patch[mxfp8->block_fp8 self-check]: ",
            "m3patch[split-k]: ")
FORBIDDEN = ("Using 'EMULATION' MxFp8 MoE backend", "Mxfp8EmulationTritonExperts",
             "MXFP8->BF16 load-time dequant complete", "Using default MoE config",
             "m3patch[split-k fallback]: ")


# the three ModelConfig fields vLLM's process_weights_after_loading reads (no HF model here)
LOADER_MODEL_CONFIG = types.SimpleNamespace(word_embeddings_untied_by_checkpoint=False,
                                            quantization="mxfp8", dtype=torch.bfloat16)


class Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.name}: {record.getMessage()}")


def random_mxfp8(e: int, n: int, k: int, gen: torch.Generator, dev: str
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    values = (torch.randn((e, n, k), generator=gen, device=dev) * 64).clamp_(-448, 448)
    blocks = torch.randint(0, BLOCK_SPREAD, (e, -(-n // 128), k // 128), generator=gen,
                           device=dev)
    groups = torch.randint(0, GROUP_SPREAD, (e, n, k // 32), generator=gen, device=dev)
    e8m0 = E8M0_BASE + blocks.repeat_interleave(128, 1)[:, :n].repeat_interleave(4, 2) + groups
    return values.to(torch.float8_e4m3fn), e8m0.to(torch.uint8)


def dequant32(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """Exact MXFP8 dequant (e4m3 value times 2^(byte-127)) in float32."""
    return w.float() * torch.exp2(s.float() - 127).repeat_interleave(32, -1)


class Layer(torch.nn.Module):
    """`model.layers.i.block_sparse_moe`: the gate bias and the experts (a MoERunner)."""

    def __init__(self, prefix: str, experts: int, width: int, quant_config: Any) -> None:
        super().__init__()
        from vllm.model_executor.layers.fused_moe import FusedMoEFactory
        self.e_score_correction_bias = torch.nn.Parameter(
            torch.empty(experts, dtype=torch.float32), requires_grad=False)
        self.experts = FusedMoEFactory(
            num_experts=experts, top_k=TOP_K, hidden_size=H, intermediate_size=width,
            scoring_func="sigmoid", e_score_correction_bias=self.e_score_correction_bias,
            renormalize=True, activation="swigluoai_uninterleave", swiglu_limit=LIMIT,
            swiglu_alpha=ALPHA, swiglu_beta=BETA, routed_scaling_factor=ROUTED_SCALE,
            router_logits_dtype=torch.float32, quant_config=quant_config,
            params_dtype=torch.bfloat16, prefix=f"{prefix}.experts")


class Decoder(torch.nn.Module):
    """`model.layers.i`: only its MoE block."""

    def __init__(self, block: Layer) -> None:
        super().__init__()
        self.block_sparse_moe = block


class Model(torch.nn.Module):
    def __init__(self, layers: list[Layer], first: int) -> None:
        super().__init__()
        # vLLM names layers by index: pad with empty modules so names match the prefixes
        self.layers = torch.nn.ModuleList([torch.nn.Module() for _ in range(first)] +
                                          [Decoder(layer) for layer in layers])


def load_experts(root: torch.nn.Module, index: int, experts: int, w13: Any, s13: Any,
                 w2: Any, s2: Any) -> int:
    """The MiniMax M3 loader's expert branch (models/minimax_m3/nvidia/model.py load_weights):
    checkpoint names experts.{e}.w1/w2/w3.weight and .weight_scale_inv (renamed to
    weight_scale), each through its parameter's weight_loader with shard and expert id."""
    from vllm.model_executor.layers.fused_moe import fused_moe_make_expert_params_mapping
    mapping = fused_moe_make_expert_params_mapping(
        root, ckpt_gate_proj_name="w1", ckpt_down_proj_name="w2", ckpt_up_proj_name="w3",
        num_experts=experts)
    params = dict(root.named_parameters())
    width = w2.shape[2]
    loaded = 0
    for e in range(experts):
        for shard, weight, scale in (("w1", w13[e, :width], s13[e, :width]),
                                     ("w3", w13[e, width:], s13[e, width:]),
                                     ("w2", w2[e], s2[e])):
            for suffix, tensor in (("weight", weight), ("weight_scale_inv", scale)):
                name = f"model.layers.{index}.block_sparse_moe.experts.{e}.{shard}.{suffix}"
                name = name.replace("weight_scale_inv", "weight_scale")
                for param_name, weight_name, expert_id, shard_id in mapping:
                    if weight_name not in name:
                        continue
                    name = name.replace(weight_name, param_name)
                    param = params[name]
                    param.weight_loader(param, tensor, name, shard_id=shard_id,
                                        expert_id=expert_id)
                    loaded += 1
                    break
                else:
                    raise KeyError(f"no expert mapping for {name}")
    return loaded


def reference(x: torch.Tensor, logits: torch.Tensor, bias: torch.Tensor, w13: torch.Tensor,
              w2: torch.Tensor) -> tuple[torch.Tensor, float]:
    """float64 MXFP8 layer: routing from the logits, exact weights, no activation rounding.
    Returns the output and the smallest top-4 selection margin (a tie would make routing
    ambiguous)."""
    scores = torch.sigmoid(logits.double())
    choose = scores + bias.double()
    top = choose.topk(TOP_K + 1, dim=1)
    margin = float((top.values[:, TOP_K - 1] - top.values[:, TOP_K]).min())
    ids = top.indices[:, :TOP_K]
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(1, keepdim=True) * ROUTED_SCALE
    xd = x.double()
    out = torch.zeros_like(xd)
    width = w2.shape[2]
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        h = xd[tok] @ w13[e].double().T
        gate, up = h[:, :width].clamp(max=LIMIT), h[:, width:].clamp(-LIMIT, LIMIT)
        act = gate * torch.sigmoid(ALPHA * gate) * (up + BETA)
        out.index_add_(0, tok, (act @ w2[e].double().T) * weights[tok, slot, None])
    return out, margin


def quant_act64(x: torch.Tensor) -> torch.Tensor:
    """Dynamic 1x128 FP8 activation quant (e4m3 max 448), dequantized in float64."""
    groups = x.float().reshape(x.shape[0], -1, 128)
    amax = groups.abs().amax(-1, keepdim=True).clamp_min(1e-10)
    scale = amax / torch.full_like(amax, 448.0)
    q = (groups / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
    return (q.double() * scale.double()).reshape(x.shape)


def block_deq64(wq: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    full = scale.double().repeat_interleave(128, -2)[..., :wq.shape[-2], :]
    return wq.double() * full.repeat_interleave(128, -1)  # exact: 4 x 24 significant bits


def own_operands(layer: Layer, x: torch.Tensor, logits: torch.Tensor,
                 bias: torch.Tensor, per_tensor: bool = False) -> torch.Tensor:
    """float64 of what TritonExperts computes on the layer's own converted operands: the
    block-FP8 weights and fp32 block scales read back from the layer after loading, routing
    in fp32 as the router computes it, 1x128 activation quant, the bf16 roundings of the
    GEMM outputs and of SwiGLU. A misread layout or a wrong quant config shows here at far
    above the rounding level; `per_tensor` is that wrong reading (each expert's block scales
    replaced by their mean), the negative control."""
    routed = layer.experts.routed_experts
    scores = torch.sigmoid(logits.float())
    ids = (scores + bias).topk(TOP_K, dim=1).indices
    weights = scores.gather(1, ids)
    weights = weights / weights.sum(1, keepdim=True) * ROUTED_SCALE
    a = quant_act64(x)
    out = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    width = routed.w2_weight.shape[2]
    for e in torch.unique(ids).tolist():
        tok, slot = torch.nonzero(ids == e, as_tuple=True)
        s13, s2 = routed.w13_weight_scale[e], routed.w2_weight_scale[e]
        if per_tensor:
            s13, s2 = torch.full_like(s13, float(s13.mean())), torch.full_like(s2, float(s2.mean()))
        w13 = block_deq64(routed.w13_weight[e], s13)
        h = (a[tok] @ w13.T).to(torch.bfloat16).double()
        gate, up = h[:, :width].clamp(max=LIMIT), h[:, width:].clamp(-LIMIT, LIMIT)
        act = (gate * torch.sigmoid(ALPHA * gate) * (up + BETA)).to(torch.bfloat16)
        w2 = block_deq64(routed.w2_weight[e], s2)
        y = (quant_act64(act) @ w2.T) * weights[tok, slot, None].double()
        out.index_add_(0, tok, y.to(torch.bfloat16).double())
    return out


def rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    if not torch.isfinite(got).all():
        return float("nan")
    return float(torch.linalg.vector_norm(got.double() - ref) / torch.linalg.vector_norm(ref))


def median_ms(fn: Any, reps: int) -> float:
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def env_record(args: argparse.Namespace) -> dict[str, Any]:
    import triton
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,clocks.sm,clocks.mem",
                          "--format=csv,noheader"], capture_output=True, text=True,
                         check=False) if shutil.which("nvidia-smi") else None
    return {"command": "scripts/measure/h200/gpu_moe_layer_h200.py " + " ".join(sys.argv[1:]),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "torch": torch.__version__, "triton": triton.__version__,
            "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
            "nvidia_smi": smi.stdout.strip() if smi else None, "M3PATCH_MXFP8_MOE": os.environ.get(
                "M3PATCH_MXFP8_MOE")}


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.dev = "cuda" if torch.cuda.is_available() else "cpu"
        self.failures: list[str] = []
        self.record: dict[str, Any] = {"env": env_record(args)}
        self.capture = Capture()
        self.splits: list[tuple[int, int]] = []
        self.pooled: dict[str, list[float]] = {}

    def check(self, ok: bool, what: str) -> None:
        if not ok:
            self.failures.append(what)
            print("FAIL", what, flush=True)

    def setup(self) -> None:
        t0 = time.perf_counter()
        self.record["standins"] = standins.install()
        self.record["standin_checks"] = standins.check_all(torch.device(self.dev))
        for op, verdict in self.record["standin_checks"].items():
            self.check(verdict["ok"], f"stand-in {op}: {verdict.get('error')}")
        import vllm
        from vllm.config.logging import LoggingConfig
        from vllm.logger import configure_logging
        configure_logging(LoggingConfig())  # as `vllm serve` does at start: INFO to stdout
        logging.getLogger("vllm").addHandler(self.capture)
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.distributed import init_distributed_environment, initialize_model_parallel
        from vllm.model_executor.layers.fused_moe import fused_moe as fm
        from vllm.model_executor.layers.quantization import get_quantization_config
        from vllm.platforms import current_platform
        from vllm.v1.worker.workspace import init_workspace_manager
        self.record["vllm"] = {"file": vllm.__file__, "version": vllm.__version__,
                               "platform": type(current_platform).__name__}
        original = fm._m3patch_split_k

        def spy(requested: int, *rest: Any) -> Any:  # observes, changes nothing
            split, buffers = original(requested, *rest)
            self.splits.append((int(requested), split))
            return split, buffers
        fm._m3patch_split_k = spy
        self.fm = fm
        self.config = VllmConfig()
        self.set_config = set_current_vllm_config
        with set_current_vllm_config(self.config):
            init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{free_port()}",
                                         backend="nccl" if self.dev == "cuda" else "gloo")
            initialize_model_parallel(1, 1)
        init_workspace_manager(torch.device(self.dev))
        if self.dev == "cuda":
            from vllm.utils.torch_utils import current_stream
            self.stream = current_stream()  # vLLM's dedicated stream: eager and capture
        self.quant_config = get_quantization_config("mxfp8").from_config(
            {"quant_method": "mxfp8", "ignored_layers": []})
        self.record["quant_config"] = type(self.quant_config).__name__
        self.record["import_s"] = round(time.perf_counter() - t0, 1)

    def build(self, name: str, experts: int, width: int, count: int, first: int) -> Any:
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        gen = torch.Generator(device=self.dev).manual_seed(1000 + first)
        layers, refs = [], []
        with self.set_config(self.config), torch.device(self.dev):
            for i in range(first, first + count):
                layers.append(Layer(f"model.layers.{i}.block_sparse_moe", experts, width,
                                    self.quant_config))
        model = Model(layers, first)
        root = torch.nn.Module()
        root.model = model
        t0 = time.perf_counter()
        loaded = 0
        for offset, layer in enumerate(layers):
            w13, s13 = random_mxfp8(experts, 2 * width, H, gen, self.dev)
            w2, s2 = random_mxfp8(experts, H, width, gen, self.dev)
            bias = (torch.randn(experts, generator=gen, device=self.dev) * 0.1)
            layer.e_score_correction_bias.data.copy_(bias)
            loaded += load_experts(root, first + offset, experts, w13, s13, w2, s2)
            refs.append({"w13": dequant32(w13, s13), "w2": dequant32(w2, s2), "bias": bias})
        load_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        with self.set_config(self.config):
            process_weights_after_loading(
                root, LOADER_MODEL_CONFIG, torch.device(self.dev))
        if self.dev == "cuda":
            torch.cuda.synchronize()
        info = self.describe(layers[0])
        info.update({"layers": count, "experts": experts, "width": width,
                     "tensors_loaded": loaded, "load_s": round(load_s, 2),
                     "process_weights_s": round(time.perf_counter() - t0, 2)})
        self.record.setdefault("layers", {})[name] = info
        print(name, info, flush=True)
        return layers, refs

    def describe(self, layer: Layer) -> dict[str, Any]:
        routed = layer.experts.routed_experts
        method = routed.quant_method
        qc = method.moe_quant_config
        kernel = getattr(method, "moe_kernel", None)
        experts_obj = getattr(kernel, "fused_experts", None) or getattr(kernel, "experts", None)
        info = {"quant_method": type(method).__name__,
                "backend": str(getattr(method, "mxfp8_backend", None)),
                "experts_cls": type(experts_obj).__name__ if experts_obj is not None else
                getattr(getattr(method, "experts_cls", None), "__name__", None),
                "block_shape": list(qc.block_shape) if qc.block_shape else None,
                "quant_dtype": str(qc.quant_dtype), "config_name": qc.config_name(torch.bfloat16),
                "w13": [str(routed.w13_weight.dtype), list(routed.w13_weight.shape)],
                "w13_scale": [str(routed.w13_weight_scale.dtype),
                              list(routed.w13_weight_scale.shape)]}
        self.check(info["block_shape"] == [128, 128], f"block shape {info['block_shape']}")
        self.check(info["config_name"] == "fp8_w8a8", f"config name {info['config_name']}")
        self.check(info["w13_scale"][0] == "torch.float32", f"scale dtype {info['w13_scale']}")
        return info

    def forward(self, layer: Layer, x: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        from vllm.forward_context import set_forward_context
        with set_forward_context(None, self.config, num_tokens=x.shape[0]):
            out: torch.Tensor = layer.experts(hidden_states=x, router_logits=logits)
        return out

    def sweep(self, name: str, layers: list[Layer], refs: list[dict[str, Any]],
              batches: list[int], graph: bool) -> None:
        gen = torch.Generator(device=self.dev).manual_seed(7)
        rows = self.record.setdefault("sweep", {}).setdefault(name, [])
        if graph:
            self.profile_forward(name, layers[0], refs[0], max(batches), gen)
        for m in batches:
            xs = [torch.randn(m, H, generator=gen, device=self.dev).to(torch.bfloat16)
                  for _ in layers]
            logits = [torch.randn(m, r["bias"].numel(), generator=gen, device=self.dev)
                      for r in refs]
            self.splits.clear()
            eager = [self.forward(layer, x, lg) for layer, x, lg in zip(layers, xs, logits,
                                                                         strict=True)]
            splits = sorted(set(self.splits))
            errs, own, margins = [], [], []
            for layer, out, x, lg, ref in zip(layers, eager, xs, logits, refs, strict=True):
                want, margin = reference(x, lg, ref["bias"], ref["w13"], ref["w2"])
                errs.append(rel_err(out, want))
                margins.append(margin)
                self.pool(name, layer, out, want)
                own.append(rel_err(out, own_operands(layer, x, lg, ref["bias"])))
            row: dict[str, Any] = {"M": m, "rel_err": [round(e, 5) for e in errs],
                                   "own_operands_err": [round(e, 6) for e in own],
                                   "min_route_margin": min(margins), "splits": splits}
            self.check(all(e <= OWN_BOUND for e in own), f"{name} M={m} own-operand err {own}")
            if m == 16:  # negative control: a per-tensor reading of the block scales
                wrong = rel_err(eager[0], own_operands(layers[0], xs[0], logits[0],
                                                       refs[0]["bias"], per_tensor=True))
                row["per_tensor_control_err"] = round(wrong, 4)
                self.check(wrong > 4 * OWN_BOUND, f"{name} negative control only {wrong}")
            self.check(all(e == e for e in errs), f"{name} M={m} NaN in the output")
            if self.dev == "cuda":
                once = functools.partial(self.forward, layers[0], xs[0], logits[0])
                row["eager_ms"] = round(median_ms(once, REPS), 4)
                if graph:
                    row.update(self.graph_run(layers, xs, logits, eager, name, m))
            rows.append(row)
            print(name, row, flush=True)

    def pool(self, name: str, layer: Layer, got: torch.Tensor, want: torch.Tensor) -> None:
        """Squared error and reference norms per layer over every batch size."""
        sums = self.pooled.setdefault(f"{name}/{layer.experts.layer_name}", [0.0, 0.0])
        sums[0] += float(torch.linalg.vector_norm(got.double() - want) ** 2)
        sums[1] += float(torch.linalg.vector_norm(want) ** 2)

    def pooled_errors(self) -> None:
        pooled = {key: round((err / ref) ** 0.5, 5) for key, (err, ref) in self.pooled.items()}
        self.record["pooled_rel_err"] = pooled
        print("pooled rel err vs the MXFP8 layer", pooled, flush=True)
        self.check(all(e <= ENVELOPE for e in pooled.values()), f"pooled rel err {pooled}")

    def profile_forward(self, name: str, layer: Layer, ref: dict[str, Any], m: int,
                        gen: torch.Generator) -> None:
        """vLLM's profiling forward (the largest batch, no split): reading the table that
        asks for SPLIT_K must allocate the split-K workspace here, before a KV cache would
        be sized from the memory left."""
        before = torch.cuda.memory_allocated() if self.dev == "cuda" else 0
        self.splits.clear()
        x = torch.randn(m, H, generator=gen, device=self.dev).to(torch.bfloat16)
        self.forward(layer, x, torch.randn(m, ref["bias"].numel(), generator=gen,
                                           device=self.dev))
        keys = [str(k) for k in self.fm._m3patch_splitk_buffers]
        info = {"M": m, "splits": sorted(set(self.splits)), "workspaces": keys,
                "allocated_MiB": round(((torch.cuda.memory_allocated() if self.dev == "cuda"
                                         else 0) - before) / 2**20, 2)}
        self.record.setdefault("profile_forward", {})[name] = info
        print("profile forward", info, flush=True)
        if self.dev == "cuda":
            self.check(len(keys) == 1 and all(b == 1 for _, b in self.splits),
                       f"workspace not allocated by the table read: {info}")

    def graph_run(self, layers: list[Layer], xs: list[torch.Tensor],
                  logits: list[torch.Tensor], eager: list[torch.Tensor], name: str,
                  m: int) -> dict[str, Any]:
        outs: list[torch.Tensor] = []

        def body() -> None:
            outs.clear()
            outs.extend(self.forward(layer, x, lg) for layer, x, lg in zip(layers, xs, logits,
                                                                            strict=True))
        body()  # warm-up, as vLLM runs each captured size eagerly first
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=self.stream):  # vLLM captures on its stream
            body()
        for out in outs:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        same = all(torch.equal(a.view(torch.int16), b.view(torch.int16))
                   for a, b in zip(outs, eager, strict=True))
        self.check(same, f"{name} M={m}: graph replay differs from eager")
        counters = sum(int(b[1].abs().sum()) for b in self.fm._m3patch_splitk_buffers.values())
        self.check(counters == 0, f"{name} M={m}: split-K counters {counters} after replay")
        replay = median_ms(graph.replay, REPS) / len(layers)
        del graph
        return {"graph_equal_eager": same, "graph_ms_per_layer": round(replay, 4),
                "counters_after": counters}

    def markers(self) -> None:
        lines = self.capture.lines
        found = {text: sum(text in line for line in lines) for text in REQUIRED}
        forbidden = {text: [line for line in lines if text in line] for text in FORBIDDEN}
        tables = [line for line in lines if "Using configuration from" in line]
        self.record["markers"] = {"required": found, "forbidden": forbidden, "tables": tables}
        layers = sum(info["layers"] for info in self.record["layers"].values())
        self.check(found[REQUIRED[0]] == layers, f"block-FP8 lines {found[REQUIRED[0]]} != {layers}")
        self.check(found[REQUIRED[1]] >= 1, "no self-check line")
        self.check(found[REQUIRED[2]] >= 1, "no split-K line")
        self.check(not any(forbidden.values()), f"forbidden lines {forbidden}")
        for e, n in ((128, 384), (16, 3072)):
            want = f"configs/m3patch/E={e},N={n},device_name=NVIDIA_H200"
            self.check(any(want in line for line in tables), f"no m3patch table {want}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--batches", default="1,2,4,8,16,32,64,128,256")
    parser.add_argument("--small", action="store_true", help="dry run: tiny shapes, no timing")
    args = parser.parse_args()
    os.environ.setdefault("M3PATCH_MXFP8_MOE", "block_fp8")
    args.out.mkdir(parents=True, exist_ok=True)
    run = Run(args)
    batches = [int(b) for b in args.batches.split(",")]
    try:
        run.setup()
        global H
        if args.small:
            H = 256
            shapes = {"tp8": (8, 128, 1), "ep8-shape": (8, 256, 1)}
        else:
            shapes = {"tp8": (128, 384, GRAPH_LAYERS), "ep8-shape": (16, I_FULL, 1)}
        first = 0
        for name, (experts, width, count) in shapes.items():
            layers, refs = run.build(name, experts, width, count, first)
            first += count
            run.sweep(name, layers, refs, batches, graph=name == "tp8")
            del layers, refs
        run.pooled_errors()
        if not args.small:
            run.markers()
    except Exception as exc:  # the record says where it failed, then the traceback
        import traceback
        run.record["error"] = traceback.format_exc()
        run.failures.append(f"{type(exc).__name__}: {exc}")
        traceback.print_exc()
    run.record["failures"] = run.failures
    run.record["ok"] = not run.failures
    (args.out / "layer.json").write_text(json.dumps(run.record, indent=1, default=str))
    (args.out / "vllm.log").write_text("\n".join(run.capture.lines) + "\n")
    (args.out / "layer.txt").write_text(table(run.record))
    print(table(run.record))
    return 0 if not run.failures else 1


def table(record: dict[str, Any]) -> str:
    lines = [json.dumps(record.get("env", {}))]
    for name, rows in record.get("sweep", {}).items():
        lines.append(f"{name}: {record['layers'][name]}")
        lines.append(f"{'M':>5} {'rel err vs MXFP8 (per layer)':>30} {'own operands':>12} "
                     f"{'splits':>12} {'eager ms':>9} {'graph ms/layer':>14} "
                     f"{'graph==eager':>12}")
        for r in rows:
            splits = ",".join(f"{a}->{b}" for a, b in r["splits"]) or "-"
            lines.append(f"{r['M']:>5} {r['rel_err']!s:>30} "
                         f"{max(r['own_operands_err']):>12.2e} {splits:>12} "
                         f"{r.get('eager_ms', '-')!s:>9} {r.get('graph_ms_per_layer', '-')!s:>14} "
                         f"{r.get('graph_equal_eager', '-')!s:>12}")
    lines.append(f"pooled rel err vs MXFP8 (envelope {ENVELOPE}): {record.get('pooled_rel_err')}")
    lines.append(f"own operands: max over layers, bound {OWN_BOUND}; ok={record.get('ok')} "
                 f"failures={record.get('failures')}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
