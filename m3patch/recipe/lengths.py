"""Request lengths the InferenceX way, drawn by vLLM's client (pure).

InferenceX's client draws each length uniformly from the integers [int(L*r), L] (r = 0.8 in its
runs; r = 1 is a fixed length). vLLM's `vllm bench serve` random dataset draws from
[floor(c(1-q)), ceil(c(1+q))] around an integer centre c (after subtracting the tokenizer's
special tokens from c; 0 for the Qwen3 and MiniMax-M3 tokenizers), so it can only give an
interval of even width [c-k, c+k]. The translation:

    lo, hi = int(L*r), L; an odd width loses its lowest value (lo + 1: half a token of mean)
    c = (lo + hi) / 2,  k = (hi - lo) / 2,  q = (k - 1/2) / c

q sits half a token inside both rounding edges, so floating point cannot move either bound:
vLLM then draws exactly [c-k, c+k]. Input and output get their own q (vLLM's JSON form
`{"input": q_in, "output": q_out}`), because c differs. E.g. 1024 at r = 0.8: InferenceX
[819, 1024], vLLM `--random-input-len 922 --random-range-ratio q = 101.5/922` draws [820, 1024].
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass

VLLM = "vllm"  # range-ratio as vLLM's client reads it: [L(1-r), L(1+r)]
INFERENCEX = "inferencex"  # [int(L*r), L], InferenceX's client
CONVENTIONS = (VLLM, INFERENCEX)


@dataclass(frozen=True)
class ClientLength:
    """One side (input or output) as vLLM's client is told it, and what it will draw."""

    centre: int
    ratio: float
    low: int
    high: int


def inferencex_bounds(length: int, ratio: float) -> tuple[int, int]:
    """InferenceX's interval for L and r: [int(L*r), L]."""
    return int(length * ratio), length


def vllm_bounds(centre: int, ratio: float) -> tuple[int, int]:
    """What vLLM's get_sampling_params draws for a centre and ratio (no special tokens)."""
    return math.floor(centre * (1 - ratio)), math.ceil(centre * (1 + ratio))


def translate(length: int, ratio: float) -> ClientLength:
    """vLLM client centre and ratio that draw InferenceX's [int(L*r), L] (its odd-width
    intervals one value narrower at the bottom)."""
    low, high = inferencex_bounds(length, ratio)
    if (high - low) % 2:
        low += 1
    centre, half = (low + high) // 2, (high - low) // 2
    q = 0.0 if half == 0 else (half - 0.5) / centre
    drawn = vllm_bounds(centre, q)
    assert drawn == (low, high), (length, ratio, drawn)  # the half-token margin guarantees it
    return ClientLength(centre, q, low, high)


@dataclass(frozen=True)
class ClientLengths:
    input: ClientLength
    output: ClientLength

    def argv(self) -> list[str]:
        ratios = {"input": self.input.ratio, "output": self.output.ratio}
        same = self.input.ratio == self.output.ratio
        return ["--random-input-len", str(self.input.centre),
                "--random-output-len", str(self.output.centre),
                "--random-range-ratio", repr(self.input.ratio) if same else json.dumps(ratios)]


def client_lengths(isl: int, osl: int, ratio: float, convention: str) -> ClientLengths:
    """The lengths vLLM's client is given for a cell, in the recipe's convention."""
    if convention == INFERENCEX:
        return ClientLengths(translate(isl, ratio), translate(osl, ratio))
    return ClientLengths(ClientLength(isl, ratio, *vllm_bounds(isl, ratio)),
                         ClientLength(osl, ratio, *vllm_bounds(osl, ratio)))


def longest(isl: int, osl: int, ratio: float, convention: str) -> int:
    """The longest prompt + output the client can draw (for max-model-len)."""
    lengths = client_lengths(isl, osl, ratio, convention)
    return lengths.input.high + lengths.output.high
