"""Check and time one tile config of the fused-MoE kernel on the GPU at hand.

A timed unit is what vLLM runs per MoE layer with one config: GEMM1 (w13) then GEMM2 (w2, routed
weights applied). Both kernels for every rotation set are captured in one CUDA graph, so host
launch overhead stays out; device events bracket each replay and the median is kept. The
rotation sets differ in activations and routing, and together they touch more bytes than the L2
holds, so each replay reads its weights from HBM as a real decode step would.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from m3patch.tune import inputs
from m3patch.tune.launch import GemmArgs, SplitKBuffers, launch, with_splitk_buffers
from m3patch.tune.routing import Routing
from m3patch.tune.shapes import MoEShape
from m3patch.tune.space import TileConfig, uses_naive_assignment

TOLERANCE = 2e-2  # relative Frobenius error; fp8 products accumulate in fp32, output is bf16
L2_ROTATE_FACTOR = 3  # bytes touched across rotation sets >= 3x L2
MAX_ROTATIONS = 16


class ConfigFailed(Exception):
    """A config that does not compile, does not fit, or computes a wrong result."""


@dataclass
class BatchSetup:
    batch: int
    problems: list[inputs.Problem]
    ref1: Any
    ref2: Any
    c1: list[Any]
    c2: list[Any]
    aligned: dict[int, list[inputs.Alignment]] = field(default_factory=dict)
    checked: set[TileConfig] = field(default_factory=set)
    splitk: dict[TileConfig, SplitKBuffers] = field(default_factory=dict)


def l2_bytes() -> int:
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return int(getattr(props, "L2_cache_size", 50 * 2**20))


def bytes_touched(shape: MoEShape, batch: int, routing: Routing | None = None) -> float:
    """Expected weight bytes one GEMM1+GEMM2 pass reads (local experts hit under uniform
    routing over the global experts)."""
    elem = 1 if shape.dtype == "fp8_w8a8" else 2
    per_expert = 3 * shape.width * shape.hidden * elem
    experts = (routing or Routing()).global_experts(shape)
    miss = (1 - shape.top_k / experts) ** batch
    return shape.num_experts * (1 - miss) * per_expert


def rotations_for(shape: MoEShape, batch: int, routing: Routing | None = None) -> int:
    need = L2_ROTATE_FACTOR * l2_bytes() / max(bytes_touched(shape, batch, routing), 1.0)
    return max(2, min(MAX_ROTATIONS, math.ceil(need)))


class MoEBench:
    """Weights for one shape, inputs per batch size, and check/time of configs."""

    def __init__(self, kernel: Any, shape: MoEShape, *, seed: int = 0,
                 routing: Routing | None = None) -> None:
        torch.backends.cuda.matmul.allow_tf32 = False
        self.kernel = kernel
        self.shape = shape
        self.routing = routing or Routing()
        self.cache_key = self.routing.cache_key(shape)
        self.device = "cuda"
        self.capability = torch.cuda.get_device_capability()
        self.weights = inputs.make_weights(shape, self.device, seed)
        self.seed = seed
        self._setup: BatchSetup | None = None

    def setup(self, batch: int, rotations: int | None = None) -> BatchSetup:
        if self._setup is not None and self._setup.batch == batch:
            return self._setup
        self._setup = None
        torch.cuda.empty_cache()
        shape, dev = self.shape, self.device
        gen = torch.Generator(device=dev).manual_seed(self.seed * 1000003 + batch)
        deq13, deq2 = inputs.dequantized(self.weights, shape)
        experts = self.routing.global_experts(shape)
        first, ref1 = inputs.make_problem(shape, batch, deq13, gen, dev, experts)
        ref2 = inputs.reference_gemm2(first, deq2)
        del deq13, deq2
        count = rotations if rotations is not None else rotations_for(shape, batch, self.routing)
        problems = [first] + [inputs.random_problem(shape, batch, gen, dev, experts)
                              for _ in range(count - 1)]
        c1 = [torch.empty((batch, shape.top_k, 2 * shape.width), dtype=torch.bfloat16,
                          device=dev) for _ in problems]
        c2 = [torch.empty((batch, shape.top_k, shape.hidden), dtype=torch.bfloat16,
                          device=dev) for _ in problems]
        self._setup = BatchSetup(batch, problems, ref1, ref2, c1, c2)
        return self._setup

    def _alignments(self, setup: BatchSetup, block_m: int) -> list[inputs.Alignment]:
        if block_m not in setup.aligned:
            naive = uses_naive_assignment(self.shape, setup.batch)
            setup.aligned[block_m] = [
                inputs.naive_alignment(p.topk_ids, block_m) if naive
                else inputs.moe_align_block_size(p.topk_ids, block_m,
                                                 self.routing.global_experts(self.shape),
                                                 self.shape.num_experts)
                for p in setup.problems]
        return setup.aligned[block_m]

    def _gemm_args(self, setup: BatchSetup, cfg: TileConfig, index: int
                   ) -> tuple[GemmArgs, GemmArgs]:
        prob, align = setup.problems[index], self._alignments(setup, cfg.block_m)[index]
        w = self.weights
        gemm1 = GemmArgs(prob.a, w.w13, setup.c1[index], prob.a_scale, w.w13_scale,
                         prob.topk_weights, align, False, self.shape.top_k)
        gemm2 = GemmArgs(prob.inter, w.w2, setup.c2[index], prob.inter_scale, w.w2_scale,
                         prob.topk_weights, align, True, 1)
        return gemm1, gemm2

    def _with_splitk(self, setup: BatchSetup, cfg: TileConfig,
                     gemms: tuple[GemmArgs, GemmArgs]) -> tuple[GemmArgs, ...]:
        """One workspace and counter set per config, shared by every launch of the pass.
        Allocated when the config is first checked, never inside graph capture."""
        if cfg.split_k == 1:
            return gemms
        if cfg not in setup.splitk:
            first = with_splitk_buffers(gemms, cfg, self.shape.block_shape)[0]
            assert first.splitk is not None
            setup.splitk[cfg] = first.splitk
        return tuple(replace(args, splitk=setup.splitk[cfg]) for args in gemms)

    def _launch_set(self, setup: BatchSetup, cfg: TileConfig, index: int,
                    gemm: int | None = None) -> None:
        """Launch GEMM1 then GEMM2 of rotation set `index` (only one of them: `gemm` 0 or 1)."""
        gemms = self._with_splitk(setup, cfg, self._gemm_args(setup, cfg, index))
        for position, args in enumerate(gemms):
            if gemm is None or gemm == position:
                launch(self.kernel, args, cfg, block_shape=self.shape.block_shape,
                       capability=self.capability)

    def check(self, setup: BatchSetup, cfg: TileConfig) -> float:
        """Poison the outputs, run rotation set 0, compare both GEMMs with the reference."""
        setup.c1[0].fill_(float("nan"))
        setup.c2[0].fill_(float("nan"))
        try:
            self._launch_set(setup, cfg, 0)
            torch.cuda.synchronize()
        except Exception as exc:  # compile errors, OutOfResources: the config is unusable
            msg = f"{cfg.key}: {type(exc).__name__}: {str(exc)[:200]}"
            raise ConfigFailed(msg) from exc
        local = setup.problems[0].topk_ids < self.shape.num_experts  # pairs this rank computes
        errors = [relative_error(setup.c1[0][local], setup.ref1[local]),
                  relative_error(setup.c2[0][local], setup.ref2[local])]
        worst = max(errors)
        if not worst <= TOLERANCE:  # also catches NaN: an unwritten or poisoned element
            msg = f"{cfg.key}: relative error {worst:.3g} > {TOLERANCE}"
            raise ConfigFailed(msg)
        setup.checked.add(cfg)
        return worst

    def time(self, setup: BatchSetup, cfg: TileConfig, reps: int, gemm: int | None = None
             ) -> float:
        """Median microseconds of one GEMM1+GEMM2 pass, over `reps` graph replays (`gemm` 0
        or 1: that GEMM alone, to split a pass's time between the two).

        A config not yet checked on these inputs (one whose quick result came from the cache)
        is checked first: that also aligns the routing for its BLOCK_SIZE_M and compiles it,
        neither of which may happen inside graph capture. Raises ConfigFailed like check()."""
        if cfg not in setup.checked:
            self.check(setup, cfg)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for index in range(len(setup.problems)):
                self._launch_set(setup, cfg, index, gemm)
        us = replay_median_us(graph, reps, len(setup.problems))
        del graph
        return us


def replay_median_us(graph: Any, reps: int, passes: int) -> float:
    """Median microseconds per pass over `reps` replays of a captured CUDA graph holding
    `passes` passes (after one warm-up replay, which uploads the graph)."""
    graph.replay()
    cuda: Any = torch.cuda  # torch's Event constructor is untyped
    starts = [cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    return float(statistics.median(s.elapsed_time(e) * 1000 / passes
                                   for s, e in zip(starts, ends, strict=True)))


def experts_hit(setup: BatchSetup, local_experts: int) -> float:
    """Mean number of this rank's experts a rotation set routes to (for the weight-read floor)."""
    return statistics.mean(
        int(torch.unique(p.topk_ids[p.topk_ids < local_experts]).numel()) for p in setup.problems)


def relative_error(out: Any, ref: Any) -> float:
    diff = (out.float() - ref).norm().item()
    return float(diff / max(ref.norm().item(), 1e-30))
