"""Which routing a timing uses: vLLM's benchmark convention, or what one EP rank really sees. Pure.

- `bench` (vLLM's `benchmarks/kernels/benchmark_moe.py` convention, what the shipped H200
  tables were tuned and judged with): every token picks top-k of the shape's E experts; with
  expert parallelism one rank is tuned as a standalone MoE of its E local experts, so it does
  M*top_k (token, expert) pairs at batch M, evenly spread.
- `ep-rank`: the router picks top-k of all E*R experts (R expert-parallel ranks); this rank
  holds global experts 0..E-1 (vLLM's linear placement for rank 0; under uniform routing every
  rank is alike) and computes only the pairs that land there: about M*top_k/R of them, uneven
  per expert and per step, aligned the way vLLM aligns with an expert map (counts over the
  local experts, capacity sized for the global expert count, never the naive path).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from m3patch.errors import UsageError
from m3patch.tune.shapes import MoEShape

RoutingKind = Literal["bench", "ep-rank"]
KINDS: tuple[RoutingKind, ...] = ("bench", "ep-rank")

ROUTING_DENSE = (
    "each of the M tokens picks top_k distinct experts of the E uniformly at random; below "
    "M*top_k*4 <= E the kernel runs vLLM 0.33.0's naive one-token-per-tile path, as vLLM does")
ROUTING_EP = (
    "vLLM's benchmark convention for expert parallelism (benchmarks/kernels/benchmark_moe.py "
    "--enable-expert-parallel): one rank is tuned as a standalone MoE of its E local experts; "
    "each of the M tokens picks top_k distinct experts among those E uniformly at random, "
    "aligned over the E local experts with no expert map, so the rank does M*top_k (token, "
    "expert) pairs. In a real deployment with EP over R ranks every rank sees all M tokens but "
    "only about M*top_k/R of the pairs are local (the expert map masks the rest, aligned over "
    "the global expert count), so the row for batch M was picked for about R times the "
    "per-expert work the rank does at batch M (R=8 for M3 TP8+EP8)")
ROUTING_EP_RANK = (
    "the routing one expert-parallel rank sees (m3patch tune --routing ep-rank --ep-ranks {R}): "
    "each of the M tokens picks top_k distinct experts of all {G} (E local x {R} ranks) "
    "uniformly at random; the rank holds global experts 0..{last} and computes only the "
    "(token, expert) pairs that land there (about M*top_k/{R}, uneven per expert), aligned "
    "like vLLM with an expert map (counts over local experts, capacity for {G} experts)")


@dataclass(frozen=True)
class Routing:
    kind: RoutingKind = "bench"
    ep_ranks: int = 1

    def for_shape(self, shape: MoEShape) -> Routing:
        """EP-rank routing applies to expert-parallel shapes; without EP every rank holds
        every expert and the benchmark convention is already what a rank sees."""
        return self if shape.expert_parallel else Routing()

    def global_experts(self, shape: MoEShape) -> int:
        return shape.num_experts * self.ep_ranks if self.kind == "ep-rank" else shape.num_experts

    def cache_key(self, shape: MoEShape) -> str:
        """Results cache key: timings under different routings never mix."""
        return shape.key if self.kind == "bench" else f"{shape.key},route=ep-rank/{self.ep_ranks}"

    def describe(self, shape: MoEShape) -> str:
        if self.kind == "ep-rank":
            return ROUTING_EP_RANK.format(R=self.ep_ranks, G=self.global_experts(shape),
                                          last=shape.num_experts - 1)
        return ROUTING_EP if shape.expert_parallel else ROUTING_DENSE


def routing_for(kind: str, ep_ranks: int | None, shapes: tuple[MoEShape, ...]) -> Routing:
    """Validate the routing options against the shapes (ep-rank needs an EP one among them)."""
    if kind not in KINDS:
        msg = f"--routing {kind!r} is not one of {', '.join(KINDS)}"
        raise UsageError(msg, hint="--routing bench (vLLM's convention) or --routing ep-rank")
    if kind == "bench":
        if ep_ranks is not None:
            msg = "--ep-ranks only applies to --routing ep-rank"
            raise UsageError(msg, hint="add --routing ep-rank, or drop --ep-ranks")
        return Routing()
    if not any(shape.expert_parallel for shape in shapes):
        msg = ("--routing ep-rank needs an expert-parallel shape; "
               f"{', '.join(shape.key for shape in shapes)} has none")
        raise UsageError(msg, hint="mark the shape ,ep (e.g. --shape 16,3072,6144,4,ep) or --ep")
    if ep_ranks is None or ep_ranks < 2:
        msg = "--routing ep-rank needs --ep-ranks R >= 2 (the expert-parallel size)"
        raise UsageError(msg, hint="--ep-ranks 8 for TP8+EP8")
    return Routing("ep-rank", ep_ranks)
