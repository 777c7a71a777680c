"""What a recipe sweeps: rows of isl/osl with their concurrencies, the load per concurrency and
the length spread (range-ratio), checked against the launch's max-model-len.

Turning rows into benchmark cells (and the latency-point rule) is m3patch.bench.cells.sweep_cells.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_int,
    expect_mapping,
    expect_number,
)


@dataclass(frozen=True)
class SweepRow:
    isl: int
    osl: int
    concurrencies: tuple[int, ...]


@dataclass(frozen=True)
class Sweep:
    rows: tuple[SweepRow, ...]
    prompts_per_concurrency: int
    warmups_per_concurrency: int
    range_ratio: float

    def num_prompts(self, concurrency: int) -> int:
        return self.prompts_per_concurrency * concurrency

    def num_warmups(self, concurrency: int) -> int:
        return self.warmups_per_concurrency * concurrency


def doubling(start: int, end: int) -> tuple[int, ...]:
    """1..6 -> 1, 2, 4, 6: double from start, clamp the last step to end."""
    out, conc = [], start
    while conc < end:
        out.append(conc)
        conc *= 2
    return (*out, end)


def _sweep_row(raw: object) -> SweepRow:
    data = expect_mapping(raw)
    check_keys(data, required=("isl", "osl"), optional=("concurrency", "conc-start", "conc-end"))
    isl, osl = expect_int(data["isl"], minimum=1), expect_int(data["osl"], minimum=1)
    if ("concurrency" in data) == ("conc-start" in data or "conc-end" in data):
        msg = "give either concurrency: [..] or conc-start and conc-end"
        raise SchemaError(msg)
    if "concurrency" in data:
        with at_key("concurrency"):
            values = data["concurrency"]
            if not isinstance(values, list) or not values:
                msg = "expected a non-empty list of concurrencies"
                raise SchemaError(msg)
            concs = tuple(expect_int(v, minimum=1) for v in values)
        return SweepRow(isl, osl, concs)
    check_keys(data, required=("isl", "osl", "conc-start", "conc-end"))
    start, end = expect_int(data["conc-start"], minimum=1), expect_int(data["conc-end"], minimum=1)
    if start > end:
        msg = f"conc-start {start} is above conc-end {end}"
        raise SchemaError(msg)
    return SweepRow(isl, osl, doubling(start, end))


def sweep(raw: object) -> Sweep:
    data = expect_mapping(raw)
    check_keys(data, required=("rows",), optional=(
        "prompts-per-concurrency", "warmups-per-concurrency", "range-ratio"))
    rows = []
    with at_key("rows"):
        if not isinstance(data["rows"], list) or not data["rows"]:
            msg = "expected a non-empty list of rows"
            raise SchemaError(msg)
        for index, row in enumerate(data["rows"]):
            with at_key(index):
                rows.append(_sweep_row(row))
    with at_key("range-ratio"):
        # vLLM >= 0.9 samples lengths in [L(1-r), L(1+r)] and rejects r >= 1 at bench time;
        # catch it here, with the recipe key, before any server starts.
        ratio = expect_number(data.get("range-ratio", 0.0), minimum=0.0)
        if ratio >= 1.0:
            msg = f"range-ratio must be in [0, 1), got {ratio}"
            raise SchemaError(msg)
    return Sweep(tuple(rows), expect_int(data.get("prompts-per-concurrency", 10), minimum=1),
                 expect_int(data.get("warmups-per-concurrency", 2), minimum=0), ratio)


def check_lengths_fit(sweep: Sweep, vllm_args: object) -> None:
    """Every sampled prompt + output must fit `max-model-len`, or requests fail mid-sweep.

    vLLM's random dataset samples lengths in [L(1-r), L(1+r)] (InferenceX's old vendored
    client used [rL, L]), so the longest request is ceil(isl(1+r)) + ceil(osl(1+r)).
    """
    limit = vllm_args.get("max-model-len") if isinstance(vllm_args, dict) else None
    if isinstance(limit, bool) or not isinstance(limit, int):
        return
    for index, row in enumerate(sweep.rows):
        longest = math.ceil(row.isl * (1 + sweep.range_ratio)) + math.ceil(
            row.osl * (1 + sweep.range_ratio))
        if longest > limit:
            msg = (f"isl {row.isl} + osl {row.osl} with range-ratio {sweep.range_ratio} reach "
                   f"{longest} tokens, over vllm-args.max-model-len {limit}; lower range-ratio "
                   f"or raise max-model-len")
            with at_key("sweep"), at_key("rows"), at_key(index):
                raise SchemaError(msg)
