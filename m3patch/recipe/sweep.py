"""What a recipe sweeps: rows of isl/osl with their concurrencies, the load per concurrency and
the length spread, checked against the launch's max-model-len.

The spread is stated one of two ways: `inferencex-range-ratio: r` (InferenceX's client: lengths
in [int(L*r), L]; GPU recipes default to 0.8, InferenceX's value, so their figures line up), or
`range-ratio: r` (vLLM's client: [L(1-r), L(1+r)]). m3patch.recipe.lengths translates the first
into vLLM's client flags. `client: chat` sends chat-completions requests (the server applies the
model's chat template), as InferenceX's speculative-decoding runs did.

Turning rows into benchmark cells (and the latency-point rule) is m3patch.bench.cells.sweep_cells.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from m3patch.recipe.agentic import AGENTIC_CODING, AgenticScenario, agentic_scenario, scenario_of
from m3patch.recipe.lengths import INFERENCEX, VLLM, longest
from m3patch.recipe.regions import PER_CELL, Region, regions
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_choice,
    expect_int,
    expect_mapping,
    expect_number,
)

INFERENCEX_KEY = "inferencex-range-ratio"
INFERENCEX_DEFAULT = 0.8  # InferenceX's runs (benchmark_lib.sh --random-range-ratio 0.8)


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
    length_convention: str = VLLM  # INFERENCEX: range_ratio is InferenceX's r ([int(L*r), L])
    chat: bool = False
    regions: tuple[Region, ...] = ()  # server overrides by isl/osl/concurrency (recipe.regions)
    per_cell_max_model_len: bool = False  # each cell's server gets isl + osl + 256
    agentic: AgenticScenario | None = None  # scenario agentic-coding (recipe.agentic); no rows

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


def _spread(data: dict[str, object], gpu: bool) -> tuple[float, str]:
    """(ratio, convention): InferenceX's r in (0, 1], or vLLM's r in [0, 1)."""
    if "range-ratio" in data and INFERENCEX_KEY in data:
        msg = f"give range-ratio (vLLM's client) or {INFERENCEX_KEY} (InferenceX's), not both"
        raise SchemaError(msg)
    if INFERENCEX_KEY in data or ("range-ratio" not in data and gpu):
        with at_key(INFERENCEX_KEY):
            ratio = expect_number(data.get(INFERENCEX_KEY, INFERENCEX_DEFAULT), minimum=0.0)
            if not 0.0 < ratio <= 1.0:
                msg = f"must be in (0, 1] (lengths in [int(L*r), L]; 1 is fixed), got {ratio}"
                raise SchemaError(msg)
        return ratio, INFERENCEX
    with at_key("range-ratio"):
        # vLLM >= 0.9 samples lengths in [L(1-r), L(1+r)] and rejects r >= 1 at bench time;
        # catch it here, with the recipe key, before any server starts.
        ratio = expect_number(data.get("range-ratio", 0.0), minimum=0.0)
        if ratio >= 1.0:
            msg = f"range-ratio must be in [0, 1), got {ratio}"
            raise SchemaError(msg)
    return ratio, VLLM


def sweep(raw: object, *, gpu: bool = False, base: Path = Path()) -> Sweep:
    """The `sweep` section; `gpu` recipes default to InferenceX's spread (r = 0.8). An
    agentic-coding sweep (recipe.agentic) has no isl/osl rows; `base` resolves its trace file."""
    data = expect_mapping(raw)
    if scenario_of(data) == AGENTIC_CODING:
        return Sweep((), 1, 0, 0.0, agentic=agentic_scenario(data, base=base))
    check_keys(data, required=("rows",), optional=(
        "scenario", "prompts-per-concurrency", "warmups-per-concurrency", "range-ratio", INFERENCEX_KEY,
        "client", "regions", "max-model-len"))
    rows = []
    with at_key("rows"):
        if not isinstance(data["rows"], list) or not data["rows"]:
            msg = "expected a non-empty list of rows"
            raise SchemaError(msg)
        for index, row in enumerate(data["rows"]):
            with at_key(index):
                rows.append(_sweep_row(row))
    ratio, convention = _spread(data, gpu)
    with at_key("client"):
        client = expect_choice(data.get("client", "completions"), ("completions", "chat"))
    with at_key("regions"):
        server_regions = regions(data.get("regions", []))
    with at_key("max-model-len"):
        per_cell = expect_choice(data.get("max-model-len", "recipe"), ("recipe", PER_CELL))
        if per_cell == PER_CELL and convention == VLLM and ratio > 0:
            msg = ("per-cell max-model-len is isl + osl + 256, which vLLM's range-ratio > 0 "
                   f"overflows; use {INFERENCEX_KEY} (never above isl + osl)")
            raise SchemaError(msg)
    return Sweep(tuple(rows), expect_int(data.get("prompts-per-concurrency", 10), minimum=1),
                 expect_int(data.get("warmups-per-concurrency", 2), minimum=0), ratio,
                 convention, client == "chat", server_regions, per_cell == PER_CELL)


def check_lengths_fit(sweep: Sweep, vllm_args: object) -> None:
    """Every sampled prompt + output must fit `max-model-len`, or requests fail mid-sweep.

    vLLM's convention reaches ceil(isl(1+r)) + ceil(osl(1+r)); InferenceX's never passes isl + osl.
    """
    limit = vllm_args.get("max-model-len") if isinstance(vllm_args, dict) else None
    if sweep.per_cell_max_model_len:
        return  # each cell's server is sized for it (checked where per-cell is parsed)
    if isinstance(limit, bool) or not isinstance(limit, int):
        return
    for index, row in enumerate(sweep.rows):
        reach = longest(row.isl, row.osl, sweep.range_ratio, sweep.length_convention)
        if reach <= limit:
            continue
        if sweep.length_convention == INFERENCEX:
            # InferenceX draws [int(L*r), L]: the longest request is isl + osl whatever the ratio
            msg = (f"isl {row.isl} + osl {row.osl} = {reach} tokens (InferenceX's lengths never "
                   f"pass isl + osl, whatever {INFERENCEX_KEY}), over vllm-args.max-model-len "
                   f"{limit}; raise vllm-args.max-model-len to at least {reach}, shorten the row, "
                   f"or size each cell's server with sweep.max-model-len: per-cell")
        else:
            msg = (f"isl {row.isl} + osl {row.osl} with range-ratio {sweep.range_ratio} "
                   f"(vLLM's convention: lengths up to L(1+r)) reach {reach} tokens, over "
                   f"vllm-args.max-model-len {limit}; lower sweep.range-ratio or raise "
                   f"vllm-args.max-model-len to at least {reach}")
        with at_key("sweep"), at_key("rows"), at_key(index):
            raise SchemaError(msg)
