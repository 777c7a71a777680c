"""Compare two aggregates cell by cell (pure): the seed PR's Previous / Patched / Change table.

Only cells of the same shape are compared: the same ISL/OSL and length range ratio, TP, PP, EP,
DP, dp-attention, GPU count and concurrency. A cell present on one side only, or at a concurrency both sides ran but
with a different shape, is listed and never given a change figure: a TP4 number against a TP8
number is a deployment change, not a speedup (the seed's own caveat). A cell whose metric is
n/a on either side (decode figures of a burst: m3patch.bench.aggregate) is listed with the
reason and never given a change figure either.

A change within CHANGE_TOLERANCE_PCT of zero counts as neither higher nor lower ("same"): the
table shows changes to 0.1 %, and a difference far below what a run can repeat (1e-9, say) is
no speedup. A change too large for a float (a base near zero) has no figure either.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from m3patch.bench.aggregate import ALL_STATS, INTVTY_STATS
from m3patch.bench.cell_shape import shape
from m3patch.bench.results import METRICS
from m3patch.errors import ResultsInvalid
from m3patch.recipe.lengths import INFERENCEX
from m3patch.schema import finite_number, short_repr

AGENTIC_STATS = ("mean", "p50", "p75", "p90", "p95")
DEFAULT_METRIC = "tput_per_gpu"
CHANGE_TOLERANCE_PCT = 0.05  # |change| at most this: "same" (half the table's 0.1 % step)
METRIC_LABELS = {
    "tput_per_gpu": "total tok/s/GPU",
    "output_tput_per_gpu": "output tok/s/GPU",
    "input_tput_per_gpu": "input tok/s/GPU",
    **{f"{stat}_intvty": f"{stat} tok/s/user" for stat in INTVTY_STATS},
    # Latencies: a positive change is slower, so the label says which way is better.
    **{f"{stat}_{metric}": f"{stat} {metric.upper()} s (lower is better)"
       for metric in METRICS for stat in ALL_STATS},
    # The agentic scenario (InferenceX's names): the North-Star axis first.
    **{f"{stat}_e2e_norm_intvty": f"{stat} E2E-normalised tok/s/user" for stat in AGENTIC_STATS},
    **{f"{stat}_{metric}": f"{stat} {metric.upper()} s (lower is better)"
       for metric in ("ttft", "e2el", "itl") for stat in ("p75", "p95")},
    "server_gpu_cache_hit_rate": "prefix-cache hit rate",
}


@dataclass(frozen=True)
class Compared:
    seq: str
    parallelism: str
    concurrency: int
    base: float | None  # None: not measured on that side, see base_na / new_na
    new: float | None
    base_na: str = ""
    new_na: str = ""

    @property
    def change_pct(self) -> float | None:
        """None when either side is n/a, the base is 0, or the ratio overflows a float."""
        if self.base is None or self.new is None or self.base == 0:
            return None
        change = (self.new / self.base - 1.0) * 100.0
        return change if math.isfinite(change) else None


@dataclass(frozen=True)
class Unmatched:
    side: str  # 'base only' | 'new only' | 'shape differs'
    concurrency: int
    detail: str


@dataclass(frozen=True)
class Comparison:
    metric: str
    compared: tuple[Compared, ...]
    unmatched: tuple[Unmatched, ...]


def seq_label(row: dict[str, Any]) -> str:
    """ISL/OSL of a fixed-length row; `agentic <tier>` of an agentic-coding one."""
    if row.get("scenario_type") == "agentic-coding":
        return f"agentic {row.get('kv_offload_label')}"
    isl, osl = row["isl"], row["osl"]
    if isl % 1024 == 0 and osl % 1024 == 0:
        return f"{isl // 1024}K/{osl // 1024}K"
    return f"{isl}/{osl}"


def describe(row: dict[str, Any]) -> str:
    ratio = f" r{row['range_ratio']:g}" if row.get("range_ratio") else ""
    if row.get("length_convention") == INFERENCEX:
        ratio += " InferenceX lengths"
    if row.get("isl_convention") == "chat-template":
        ratio += " ISL with chat template"
    return f"{seq_label(row)}{ratio} {row['parallelism']} ({row['gpu_count']} GPU)"


def compare_rows(
    base_rows: list[dict[str, Any]], new_rows: list[dict[str, Any]], metric: str = DEFAULT_METRIC
) -> Comparison:
    new_by_key = {(shape(r), r["concurrency"]): r for r in new_rows}
    compared, base_left = [], []
    for row in base_rows:
        other = new_by_key.pop((shape(row), row["concurrency"]), None)
        if other is None:
            base_left.append(row)
            continue
        (base, base_na), (new, new_na) = _value(row, metric), _value(other, metric)
        compared.append(Compared(seq_label(row), row["parallelism"], row["concurrency"],
                                 base, new, base_na, new_na))
    return Comparison(metric, tuple(compared), tuple(_unmatched(base_left, list(new_by_key.values()))))


def _value(row: dict[str, Any], metric: str) -> tuple[float | None, str]:
    """The metric, or None and why (the aggregate's decode_na, e.g. 'burst')."""
    value = row.get(metric)
    if value is None:
        return None, str(row.get("decode_na") or "not measured")
    return float(value), ""


def check_metric(rows: list[dict[str, Any]], metric: str, where: str) -> None:
    """Every row's `metric` is null (n/a) or a finite number >= 0: a string, a negative or a
    non-finite figure in an aggregate is a malformed result (ResultsInvalid), never compared."""
    for index, row in enumerate(rows):
        value = row.get(metric)
        if value is None:
            continue
        number = finite_number(value)
        if number is None or number < 0:
            msg = f"{where}: rows[{index}].{metric} is {short_repr(value)}, not a finite number >= 0"
            raise ResultsInvalid(msg, hint="re-aggregate the run: m3patch bench RECIPE --resume "
                                 "--run-dir RUN")


def _unmatched(base_left: list[dict[str, Any]], new_left: list[dict[str, Any]]) -> list[Unmatched]:
    out = []
    for row in base_left:
        peers = [r for r in new_left if r["concurrency"] == row["concurrency"]]
        for peer in peers:
            new_left.remove(peer)
            detail = f"base {describe(row)} vs new {describe(peer)}"
            out.append(Unmatched("shape differs", row["concurrency"], detail))
        if not peers:
            out.append(Unmatched("base only", row["concurrency"], describe(row)))
    out += [Unmatched("new only", r["concurrency"], describe(r)) for r in new_left]
    return sorted(out, key=lambda u: (u.concurrency, u.side))


def summary(result: Comparison) -> str:
    label = METRIC_LABELS.get(result.metric, result.metric)
    changes = [c.change_pct for c in result.compared if c.change_pct is not None]
    if not changes:
        if result.compared:
            return (f"{len(result.compared)} cell(s) of the same shape, none with {label} "
                    f"measured on both sides; nothing compared")
        return f"no cell of the same shape on both sides; nothing compared ({label})"
    faster = sum(1 for value in changes if value > CHANGE_TOLERANCE_PCT)
    slower = sum(1 for value in changes if value < -CHANGE_TOLERANCE_PCT)
    same = len(changes) - faster - slower
    ratios = [1.0 + value / 100.0 for value in changes]
    mean = "n/a (a cell fell to 0)" if min(ratios) <= 0 else \
        f"{(math.exp(sum(math.log(r) for r in ratios) / len(ratios)) - 1.0) * 100.0:+.1f}%"
    skipped = f"; {len(result.unmatched)} cell(s) not compared" if result.unmatched else ""
    return (f"{len(changes)} cell(s) compared on {label}: {faster} higher, {slower} lower, "
            f"{same} same (within {CHANGE_TOLERANCE_PCT:g}%); change {min(changes):+.1f}% .. "
            f"{max(changes):+.1f}%, geometric mean {mean}{skipped}")


def changed(result: Comparison) -> int:
    """How many cells got a change figure: 0 means the comparison checked nothing."""
    return sum(1 for c in result.compared if c.change_pct is not None)


def _shown(value: float | None, na: str) -> str:
    return f"n/a ({na})" if value is None else f"{value:.2f}"


def table_rows(result: Comparison) -> list[list[str]]:
    return [
        [c.seq, c.parallelism, str(c.concurrency), _shown(c.base, c.base_na),
         _shown(c.new, c.new_na), "n/a" if c.change_pct is None else f"{c.change_pct:+.1f}%"]
        for c in result.compared
    ]


def to_json(result: Comparison) -> dict[str, Any]:
    return {
        "metric": result.metric,
        "compared": [
            {"seq": c.seq, "parallelism": c.parallelism, "concurrency": c.concurrency,
             "base": c.base, "new": c.new, "change_pct": c.change_pct,
             **({"base_na": c.base_na} if c.base_na else {}),
             **({"new_na": c.new_na} if c.new_na else {})}
            for c in result.compared
        ],
        "not_compared": [
            {"reason": u.side, "concurrency": u.concurrency, "detail": u.detail}
            for u in result.unmatched
        ],
        "summary": summary(result),
    }
