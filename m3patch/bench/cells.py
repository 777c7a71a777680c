"""Expand a sweep into benchmark cells: pure, no I/O.

A cell is one (isl/osl, parallelism, concurrency) point. Its load follows InferenceX's fixed-seq
convention (benchmark_lib.sh): prompts = 10 x concurrency, warm-ups = 2 x concurrency.
`sweep_cells` is the one rule set that turns a recipe's sweep rows into cells: `m3patch bench`
(and its `--only` selection) and `m3patch matrix` both call it, so every cell id the matrix
emits is one the bench runs.

GPU count: tp x pp x dp, where dp is vLLM's --data-parallel-size (engine replicas, each with
tp x pp GPUs). Expert parallelism reuses those GPUs and adds none. With dp-attention the recipe
follows InferenceX: `tp` holds the whole GPU count and vLLM runs TP1 x DP<tp>, so the count is
tp x pp. Either way this equals InferenceX's `num_gpus = TP * PP` for the shapes it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from m3patch.errors import UsageError
from m3patch.recipe.agentic import KvOffload
from m3patch.recipe.lengths import INFERENCEX, VLLM

PROMPTS_PER_CONCURRENCY = 10
WARMUPS_PER_CONCURRENCY = 2


@dataclass(frozen=True)
class Parallelism:
    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    dp_attention: bool = False

    @property
    def gpu_count(self) -> int:
        replicas = 1 if self.dp_attention else self.dp
        return self.tp * self.pp * replicas

    @property
    def is_tp_only(self) -> bool:
        return self.ep == 1 and self.dp == 1 and self.pp == 1 and not self.dp_attention

    @property
    def label(self) -> str:
        """Human label in the seed PR's vocabulary: TP8, TP8+EP8, TP1+DP8+EP8."""
        parts = [f"TP{self.tp}"]
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
        if self.dp_attention:
            parts.append("DPA")
        return "+".join(parts)

    @property
    def slug(self) -> str:
        dpa = "-dpa" if self.dp_attention else ""
        return f"tp{self.tp}-pp{self.pp}-ep{self.ep}-dp{self.dp}{dpa}"


@dataclass(frozen=True)
class SeqLen:
    isl: int
    osl: int

    @property
    def label(self) -> str:
        """InferenceX style (1k1k, 8k1k) when both are multiples of 1024, else 32/16."""
        if self.isl % 1024 == 0 and self.osl % 1024 == 0:
            return f"{self.isl // 1024}k{self.osl // 1024}k"
        return f"{self.isl}/{self.osl}"

    @property
    def max_model_len(self) -> int:
        # InferenceX generate_sweep_configs.py: room for the prompt, the output and chat framing.
        return self.isl + self.osl + 256


@dataclass(frozen=True)
class Cell:
    seq: SeqLen
    parallelism: Parallelism
    concurrency: int
    range_ratio: float
    prompts_per_concurrency: int = PROMPTS_PER_CONCURRENCY
    warmups_per_concurrency: int = WARMUPS_PER_CONCURRENCY
    length_convention: str = VLLM  # how range_ratio reads (recipe.lengths): vLLM's or InferenceX's
    chat: bool = False  # the client uses /v1/chat/completions (the server's chat template)

    @property
    def num_prompts(self) -> int:
        return self.prompts_per_concurrency * self.concurrency

    @property
    def num_warmups(self) -> int:
        return self.warmups_per_concurrency * self.concurrency

    @property
    def cell_id(self) -> str:
        """Stable file-name-safe key; also the key compare matches cells on."""
        return f"isl{self.seq.isl}-osl{self.seq.osl}-{self.parallelism.slug}-c{self.concurrency}"


@dataclass(frozen=True)
class AgenticCell:
    """One concurrency of an agentic-coding row: sessions replayed by AIPerf for a duration (or a
    request count) against a server with this row's KV-offload tier."""

    parallelism: Parallelism
    concurrency: int
    kv_offload: KvOffload
    trace: str  # the trace source's label (recipe.agentic.TraceSource.label)
    duration_s: int | None
    request_count: int | None
    warmup_request_count: int

    @property
    def cell_id(self) -> str:
        return f"agentic-{self.kv_offload.label}-{self.parallelism.slug}-c{self.concurrency}"


AnyCell = Cell | AgenticCell


def checked_concurrencies(values: Iterable[int]) -> tuple[int, ...]:
    """A concurrency list: positive, strictly increasing (so cells never repeat)."""
    result = tuple(values)
    if not result:
        msg = "the sweep has no concurrency values"
        raise UsageError(msg, hint="give sweep.concurrency a list, or start and end")
    for before, after in zip((0, *result), result, strict=False):
        if after <= before:
            msg = f"concurrency list {list(result)} must be positive and strictly increasing"
            raise UsageError(msg, hint="sort the list and drop duplicates")
    return result


def expand(
    seq_lens: Sequence[SeqLen],
    concurrencies: Sequence[int],
    parallelism: Parallelism,
    range_ratio: float,
    prompts_per_concurrency: int = PROMPTS_PER_CONCURRENCY,
    warmups_per_concurrency: int = WARMUPS_PER_CONCURRENCY,
    *, convention: str = VLLM,
) -> tuple[Cell, ...]:
    """Every (isl/osl, concurrency) cell, in the order a sweep runs them."""
    if not seq_lens:
        msg = "the sweep has no isl/osl pairs"
        raise UsageError(msg, hint="add sweep.seq-lens entries such as {isl: 1024, osl: 1024}")
    if convention == INFERENCEX and not 0.0 < range_ratio <= 1.0:
        msg = f"InferenceX range ratio {range_ratio} is outside (0, 1]"
        raise UsageError(msg, hint="set sweep.inferencex-range-ratio in (0, 1]: 1 is a fixed length")
    if convention != INFERENCEX and not 0.0 <= range_ratio < 1.0:
        msg = f"random range ratio {range_ratio} is outside [0, 1)"
        # The pre-0.9 client drew [L*r, L] (so 1.0 meant fixed); vLLM 0.33 draws [L(1-r), L(1+r)].
        hint = "set sweep.range-ratio in [0, 1): 0 gives fixed lengths in vLLM's client"
        raise UsageError(msg, hint=hint)
    concs = checked_concurrencies(concurrencies)
    return tuple(
        Cell(seq, parallelism, conc, range_ratio, prompts_per_concurrency, warmups_per_concurrency,
             convention)
        for seq in seq_lens
        for conc in concs
    )


SweepRowValues = tuple[int, int, tuple[int, ...]]  # (isl, osl, concurrencies) of one sweep row


def sweep_cells(
    rows: Sequence[SweepRowValues],
    parallelism: Parallelism,
    range_ratio: float,
    prompts_per_concurrency: int = PROMPTS_PER_CONCURRENCY,
    warmups_per_concurrency: int = WARMUPS_PER_CONCURRENCY,
    *, convention: str = VLLM,
) -> tuple[Cell, ...]:
    """Every cell of a sweep, in run order, each cell id once: exactly the rows' concurrencies.

    Nothing is added: InferenceX's latency point (TP-only rows start at concurrency 1) is
    written in the recipe, where `recipe show` and the bench see it too.
    """
    cells: list[Cell] = []
    for isl, osl, concs in rows:
        cells += expand([SeqLen(isl, osl)], concs, parallelism, range_ratio,
                        prompts_per_concurrency, warmups_per_concurrency, convention=convention)
    seen: set[str] = set()
    for cell in cells:
        if cell.cell_id in seen:
            msg = f"cell {cell.cell_id} appears twice"
            raise UsageError(msg, hint="merge the sweep rows that repeat this isl/osl/concurrency")
        seen.add(cell.cell_id)
    return tuple(cells)
