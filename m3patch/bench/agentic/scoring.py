"""AIPerf's per-request records -> InferenceX's agentic fields (pure).

InferenceX's rules (utils/agentic/aggregation/request_metrics.py and aggregation_common.py at
main 843c6254f), followed here so a number means what it means there:
- only records of the profiling phase without an error count (warm-up and failed ones are
  counted apart, in request_accounting);
- statistics are mean, p50, p75, p90, p95 (linear interpolation between order statistics) and
  the population std, of TTFT, E2EL and ITL in seconds; TPOT is ITL;
- interactivity is 1 / the statistic of ITL, so p90_intvty is the slow tail (1 / P90 ITL);
- E2E-normalised interactivity, the North-Star Pareto axis: per request E2EL / OSL (seconds per
  output token over the whole request, prefill and waits included), and p90_e2e_norm_intvty =
  1 / P90(E2EL_i / OSL_i);
- throughput: input, output and total tokens over the span from the first request's start to
  the last one's end; per GPU divided by the server's GPU count.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from m3patch.bench.results import BURST_FLOOR_MS
from m3patch.schema import finite_number

STATS = ("mean", "p50", "p75", "p90", "p95")
PERCENTILES = {"p50": 50, "p75": 75, "p90": 90, "p95": 95}
PROFILING = "profiling"
MS_PER_S = 1000.0
NS_PER_S = 1e9


def percentile(values: Sequence[float], pct: float) -> float:
    """InferenceX's percentile: linear between the order statistics at (n - 1) p / 100."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * pct / 100.0
    low = int(rank)
    if low + 1 >= len(ordered):
        return ordered[low]
    return ordered[low] + (rank - low) * (ordered[low + 1] - ordered[low])


def stats_for(prefix: str, values: Sequence[float]) -> dict[str, float]:
    if not values:
        return {}
    out = {f"mean_{prefix}": statistics.mean(values)}
    out.update({f"{name}_{prefix}": percentile(values, pct) for name, pct in PERCENTILES.items()})
    out[f"std_{prefix}"] = statistics.pstdev(values) if len(values) > 1 else 0.0
    return out


def inverse_stats(latency: dict[str, float], values: Sequence[float], prefix: str,
                  out_prefix: str) -> dict[str, float]:
    """1 / each statistic of a per-token latency (tokens/s); std over the per-request rates."""
    out = {f"{stat}_{out_prefix}": 1.0 / latency[f"{stat}_{prefix}"]
           for stat in STATS if latency.get(f"{stat}_{prefix}", 0.0) > 0}
    rates = [1.0 / v for v in values if v > 0]
    if rates:
        out[f"std_{out_prefix}"] = statistics.pstdev(rates) if len(rates) > 1 else 0.0
    return out


def metric(record: dict[str, Any], key: str) -> float | None:
    """A record's metric value, or None when missing or not a finite number."""
    metrics = record.get("metrics")
    item = metrics.get(key) if isinstance(metrics, dict) else None
    value = item.get("value") if isinstance(item, dict) else item
    return finite_number(value)


def split_records(records: Iterable[dict[str, Any]]) -> tuple[list[dict[str, Any]], dict[str, int]]:
    """(profiled records without error, accounting): InferenceX's load_records_with_accounting."""
    kept: list[dict[str, Any]] = []
    counts = {"records_total": 0, "records_warmup_dropped": 0, "records_error_dropped": 0}
    for record in records:
        counts["records_total"] += 1
        meta = record.get("metadata")
        phase = meta.get("benchmark_phase") if isinstance(meta, dict) else None
        if phase is not None and phase != PROFILING:
            counts["records_warmup_dropped"] += 1
        elif record.get("error"):
            counts["records_error_dropped"] += 1
        else:
            kept.append(record)
    counts["records_profiled"] = len(kept)
    return kept, counts


def _seconds(records: Sequence[dict[str, Any]], key: str) -> list[float]:
    values = (metric(r, key) for r in records)
    return [v / MS_PER_S for v in values if v is not None and v > 0]


def latency_fields(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    ttft = _seconds(records, "time_to_first_token")
    e2el = _seconds(records, "request_latency")
    itl = _seconds(records, "inter_token_latency")
    out: dict[str, Any] = {**stats_for("ttft", ttft), **stats_for("e2el", e2el)}
    ratios = e2e_per_osl(records)
    ratio_stats = stats_for("e2el_per_osl", ratios)
    out.update(inverse_stats(ratio_stats, ratios, "e2el_per_osl", "e2e_norm_intvty"))
    burst = decode_burst(itl)
    if burst is not None:  # as the fixed-length rows: no figure the client could not time
        out.update({"decode_na": "burst", "decode_na_reason": burst})
        return out
    itl_stats = stats_for("itl", itl)
    out.update(itl_stats)
    out.update({key.replace("_itl", "_tpot"): value for key, value in itl_stats.items()})
    out.update(inverse_stats(itl_stats, itl, "itl", "intvty"))
    return out


def decode_burst(itl: Sequence[float]) -> str | None:
    """Why the ITL figures are not a decode (None when they are): no gap between tokens reached
    the client (every response in one chunk, e.g. --stream-interval above the output length), or
    the median gap is under BURST_FLOOR_MS, the time between tokens of one network chunk."""
    if not itl:
        return ("no inter-token gap reached the client (each response arrived in one chunk): "
                "ITL, TPOT and interactivity cannot be timed; E2E-normalised interactivity can")
    median_ms = statistics.median(itl) * MS_PER_S
    if median_ms < BURST_FLOOR_MS:
        return (f"median ITL {median_ms:.4f} ms is under the {BURST_FLOOR_MS} ms floor: the tokens "
                "reached the client in chunks, not one by one; E2E-normalised interactivity holds")
    return None


def e2e_per_osl(records: Sequence[dict[str, Any]]) -> list[float]:
    """Seconds of E2E latency per output token, per request (requests without output skipped)."""
    out = []
    for record in records:
        e2el, osl = metric(record, "request_latency"), output_tokens(record)
        if e2el is not None and osl is not None and e2el > 0 and osl > 0:
            out.append(e2el / MS_PER_S / osl)
    return out


def output_tokens(record: dict[str, Any]) -> float | None:
    """AIPerf's output_sequence_length (the server's count under --use-server-token-count), as
    InferenceX reads it; the usage field only where a record lacks it."""
    for key in ("output_sequence_length", "usage_completion_tokens"):
        value = metric(record, key)
        if value is not None:
            return value
    return None


def input_tokens(record: dict[str, Any]) -> float | None:
    for key in ("input_sequence_length", "usage_prompt_tokens"):
        value = metric(record, key)
        if value is not None:
            return value
    return None


def throughput_fields(records: Sequence[dict[str, Any]], gpu_count: int) -> dict[str, float]:
    starts = [_ns(r, "request_start_ns") for r in records]
    ends = [_ns(r, "request_end_ns") for r in records]
    known_starts = [s for s in starts if s is not None]
    known_ends = [e for e in ends if e is not None]
    if not known_starts or not known_ends:
        return {}
    duration = (max(known_ends) - min(known_starts)) / NS_PER_S
    if duration <= 0:
        return {}
    total_in = sum(input_tokens(r) or 0.0 for r in records)
    total_out = sum(output_tokens(r) or 0.0 for r in records)
    out = {"duration_seconds": duration, "input_tput_tps": total_in / duration,
           "output_tput_tps": total_out / duration,
           "total_tput_tps": (total_in + total_out) / duration,
           "total_input_tokens": total_in, "total_output_tokens": total_out,
           "mean_input_tokens": total_in / len(records),
           "mean_output_tokens": total_out / len(records)}
    # InferenceX's per-GPU figures, under the names m3patch's fixed-length rows use too.
    out.update(tput_per_gpu=out["total_tput_tps"] / gpu_count,
               output_tput_per_gpu=out["output_tput_tps"] / gpu_count,
               input_tput_per_gpu=out["input_tput_tps"] / gpu_count)
    return out


def _ns(record: dict[str, Any], key: str) -> int | None:
    meta = record.get("metadata")
    value = meta.get(key) if isinstance(meta, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def score(records: Iterable[dict[str, Any]], gpu_count: int) -> dict[str, Any]:
    """Every request-side field of one cell; `num_requests_successful` 0 when nothing counted."""
    kept, accounting = split_records(records)
    fields: dict[str, Any] = {"num_requests_total": accounting["records_total"],
                              "num_requests_successful": len(kept),
                              "request_accounting": accounting}
    fields.update(latency_fields(kept))
    fields.update(throughput_fields(kept, gpu_count))
    return fields
