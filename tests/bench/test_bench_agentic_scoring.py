"""Scoring AIPerf's records as InferenceX does, the /metrics scrape, the cell file and its row."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from m3patch.bench.agentic import metrics
from m3patch.bench.agentic.results import cell_document, check_fields, read_agentic_cell
from m3patch.bench.agentic.scoring import percentile, score
from m3patch.bench.aggregate import load_aggregate, table_of, write_aggregate
from m3patch.bench.cells import AgenticCell, Parallelism
from m3patch.bench.compare import compare_rows
from m3patch.bench.results import write_result
from m3patch.errors import ResultsInvalid
from m3patch.recipe.agentic import KvOffload

MS = 1e6  # ns per ms


def record(e2el_ms: float, osl: int, *, isl: int = 100, ttft_ms: float = 50.0,
           itl_ms: float = 10.0, start_ms: float = 0.0, phase: str = "profiling",
           error: object = None) -> dict[str, Any]:
    return {
        "metadata": {"benchmark_phase": phase, "request_start_ns": int(start_ms * MS),
                     "request_end_ns": int((start_ms + e2el_ms) * MS)},
        "metrics": {"request_latency": {"value": e2el_ms, "unit": "ms"},
                    "time_to_first_token": {"value": ttft_ms, "unit": "ms"},
                    "inter_token_latency": {"value": itl_ms, "unit": "ms"},
                    "output_sequence_length": {"value": osl, "unit": "tokens"},
                    "input_sequence_length": {"value": isl, "unit": "tokens"}},
        "error": error,
    }


RECORDS = [record(1000, 10, start_ms=0), record(2000, 10, start_ms=0),
           record(3000, 10, start_ms=1000), record(4000, 10, start_ms=1000, itl_ms=40),
           record(99_000, 1, phase="warmup"), record(5000, 10, error={"type": "HTTP 500"})]


def test_percentile_is_linear_between_order_statistics() -> None:
    assert percentile([4.0, 1.0, 3.0, 2.0], 90) == pytest.approx(3.7)
    assert percentile([5.0], 90) == 5.0
    assert percentile([1.0, 2.0], 50) == pytest.approx(1.5)


def test_e2e_normalised_interactivity_is_one_over_p90_of_e2el_per_osl() -> None:
    fields = score(RECORDS, gpu_count=2)
    # The warm-up and the failed request are counted apart and never scored.
    assert fields["num_requests_total"] == 6 and fields["num_requests_successful"] == 4
    assert fields["request_accounting"]["records_warmup_dropped"] == 1
    assert fields["request_accounting"]["records_error_dropped"] == 1
    # E2EL/OSL = 0.1, 0.2, 0.3, 0.4 s per token; P90 = 0.3 + 0.7 * 0.1 = 0.37.
    assert fields["p90_e2e_norm_intvty"] == pytest.approx(1 / 0.37)
    assert fields["p50_e2e_norm_intvty"] == pytest.approx(1 / 0.25)
    assert fields["mean_e2e_norm_intvty"] == pytest.approx(1 / 0.25)
    # ITL 10, 10, 10, 40 ms: P90 = 10 + 0.7 * 30 = 31 ms; interactivity 1 / that; TPOT is ITL.
    assert fields["p90_itl"] == pytest.approx(0.031) == fields["p90_tpot"]
    assert fields["p90_intvty"] == pytest.approx(1 / 0.031)
    assert fields["p50_ttft"] == pytest.approx(0.05)
    assert fields["p90_e2el"] == pytest.approx(3.7)


@pytest.mark.parametrize("itl_ms", [0.03, None])
def test_tokens_in_one_chunk_give_no_decode_figures_but_the_e2e_headline(
        itl_ms: float | None) -> None:
    """As the fixed-length rows: a median ITL under the burst floor (the tokens of one network
    chunk), or no gap at all, is not a decode; ITL, TPOT and interactivity stay out, with the
    reason, and E2E-normalised interactivity (timed over the whole request) stays."""
    records = [record(1000, 16, itl_ms=itl_ms or 0.0) for _ in range(3)]
    if itl_ms is None:
        for r in records:
            del r["metrics"]["inter_token_latency"]
    fields = score(records, gpu_count=1)
    assert fields["decode_na"] == "burst" and "interactivity" in fields["decode_na_reason"]
    assert not [k for k in fields if k.endswith(("_itl", "_tpot", "_intvty")) and "e2e" not in k]
    assert fields["p90_e2e_norm_intvty"] == pytest.approx(16.0)


def test_throughput_spans_first_start_to_last_end_and_divides_by_gpus() -> None:
    fields = score(RECORDS, gpu_count=2)
    # 4 requests x (100 in + 10 out) over 0 .. 5 s (the last starts at 1 s and takes 4 s).
    assert fields["duration_seconds"] == pytest.approx(5.0)
    assert fields["total_tput_tps"] == pytest.approx(440 / 5)
    assert fields["output_tput_tps"] == pytest.approx(40 / 5)
    assert fields["tput_per_gpu"] == pytest.approx(440 / 5 / 2)
    assert fields["input_tput_per_gpu"] == pytest.approx(400 / 5 / 2)


def test_nothing_profiled_scores_nothing() -> None:
    fields = score([record(10, 1, phase="warmup")], gpu_count=1)
    assert fields["num_requests_successful"] == 0 and "p90_e2e_norm_intvty" not in fields


VLLM_METRICS = """\
# HELP vllm:prefix_cache_queries Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-moe"} 3305.0
vllm:prefix_cache_queries_created{engine="0",model_name="tiny-moe"} 1.79e+09
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-moe"} 768.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny-moe"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="tiny-moe"} NaN
python_gc_objects_collected_total{generation="0"} 1234.0
"""


def test_the_scrape_reads_the_cells_own_hit_rate_from_counter_deltas() -> None:
    after = metrics.parse(VLLM_METRICS)
    assert after["vllm:prefix_cache_hits_total"] == 768.0
    before = {"vllm:prefix_cache_queries_total": 305.0, "vllm:prefix_cache_hits_total": 68.0}
    cell = metrics.CellMetrics(before, after)
    cell.sample(after)
    cell.sample({"vllm:kv_cache_usage_perc": 0.5})
    fields = cell.fields()
    assert fields["server_gpu_cache_hit_rate"] == pytest.approx(700 / 3000)
    assert fields["gpu_kv_cache_usage_pct"] == 0.5
    assert fields["server_cpu_cache_hit_rate"] is None  # no external (offload) counters


def test_a_server_without_prefix_caching_has_no_hit_rate() -> None:
    zero = {"vllm:prefix_cache_queries_total": 0.0, "vllm:prefix_cache_hits_total": 0.0}
    assert metrics.CellMetrics(zero, dict(zero)).fields()["server_gpu_cache_hit_rate"] is None


CELL = AgenticCell(Parallelism(tp=2), 4, KvOffload("dram", "lmcache", "0.5.3"), "synthetic:x",
                   None, 18, 0)


def write_cell(run_dir: Path, fields: dict[str, Any]) -> Path:
    document = cell_document(CELL, fields, {"aiperf_version": "0.13.0"},
                             provenance={"recipe_name": "r", "series": "s"}, client_seconds=1.0,
                             aiperf_version="0.13.0", artifacts="raw/x", dram_gb=1234)
    path = run_dir / "cells" / f"{CELL.cell_id}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_result(path, document)
    return path


def test_a_cell_file_carries_aiperf_export_and_aggregates_into_an_agentic_row(tmp_path: Path) -> None:
    fields = {**score(RECORDS, 2), "server_gpu_cache_hit_rate": 0.25}
    path = write_cell(tmp_path, fields)
    data = read_agentic_cell(path)
    assert data["aiperf_export"] == {"aiperf_version": "0.13.0"}
    assert data["kv_offload_backend"] == {"name": "lmcache", "version": "0.5.3"}
    rows = write_aggregate(tmp_path, {"recipe_name": "r"})
    (row,) = rows
    assert row["scenario_type"] == "agentic-coding" and row["kv_offloading"] == "dram"
    assert row["p90_e2e_norm_intvty"] == pytest.approx(1 / 0.37)
    assert row["allocated_cpu_dram_gb"] == 1234 and row["conc"] == 4
    assert load_aggregate(tmp_path)["rows"][0]["cell_id"] == CELL.cell_id
    columns, lines = table_of(rows)
    assert "E2E-norm intvty p90" in columns
    assert lines[0][columns.index("prefix hit %")] == "25"
    header = (tmp_path / "aggregate.csv").read_text().splitlines()[0]
    assert "p90_e2e_norm_intvty" in header and "server_gpu_cache_hit_rate" in header


def test_compare_matches_agentic_rows_by_tier_and_concurrency(tmp_path: Path) -> None:
    write_cell(tmp_path, score(RECORDS, 2))
    base = write_aggregate(tmp_path, {"recipe_name": "r"})
    faster = [{**base[0], "p90_e2e_norm_intvty": base[0]["p90_e2e_norm_intvty"] * 2}]
    result = compare_rows(base, faster, "p90_e2e_norm_intvty")
    assert [c.change_pct for c in result.compared] == [pytest.approx(100.0)]
    other_tier = [{**base[0], "kv_offload_label": "kvnone", "kv_offloading": "none"}]
    assert not compare_rows(base, other_tier).compared


@pytest.mark.parametrize("broken", [
    {"p90_e2e_norm_intvty": None}, {"tput_per_gpu": "fast"}, {"num_requests_successful": 0},
    {"server_gpu_cache_hit_rate": -1.0},
])
def test_a_cell_missing_a_headline_figure_is_invalid(tmp_path: Path, broken: dict[str, Any]) -> None:
    path = write_cell(tmp_path, {**score(RECORDS, 2), **broken})
    with pytest.raises(ResultsInvalid) as info:
        read_agentic_cell(path)
    assert str(path) in info.value.message


def test_check_fields_requires_aiperf_export() -> None:
    with pytest.raises(ResultsInvalid, match="AIPerf's own export"):
        check_fields({**score(RECORDS, 2)}, "x.json")
