"""An agentic cell's file: InferenceX's agentic fields, AIPerf's own export, the m3patch block.

    cells/<cell_id>.json
      scenario_type: agentic-coding, conc, kv_offloading, kv_offload_backend,
      allocated_cpu_dram_gb, num_requests_*, request_accounting, the latency / interactivity /
      throughput fields (agentic.scoring), the server fields (agentic.metrics),
      aiperf_export: profile_export_aiperf.json as AIPerf wrote it,
      aiperf_artifacts: where AIPerf's files are kept (raw/<cell_id>/),
      m3patch: {schema, scenario, cell, provenance, client_seconds, aiperf_version}
Read back like every file the tool reads: each field the row needs is checked; a headline figure
that is missing or not finite makes the file invalid (ResultsInvalid, 17).
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from m3patch.bench.cells import AgenticCell
from m3patch.bench.results import CELL_SCHEMA, count, invalid, number, read_json_object
from m3patch.errors import ResultsInvalid
from m3patch.recipe.agentic import AGENTIC_CODING
from m3patch.schema import finite_number

HEADLINE = ("p90_e2e_norm_intvty", "tput_per_gpu", "output_tput_per_gpu", "input_tput_per_gpu",
            "p90_ttft", "p50_ttft", "p90_e2el")
OPTIONAL_NUMBERS = ("server_gpu_cache_hit_rate", "server_cpu_cache_hit_rate",
                    "server_overall_cache_hit_rate", "gpu_kv_cache_usage_pct",
                    "cpu_kv_cache_usage_pct", "p50_itl", "p90_itl", "p50_intvty", "p90_intvty")
CELL_KEYS = ("cell_id", "concurrency", "kv_offloading", "tp", "pp", "ep", "dp", "gpu_count")


def is_agentic(data: dict[str, Any]) -> bool:
    extra = data.get("m3patch")
    return isinstance(extra, dict) and extra.get("scenario") == AGENTIC_CODING


def cell_record(cell: AgenticCell) -> dict[str, Any]:
    par, kv = cell.parallelism, cell.kv_offload
    return {
        "cell_id": cell.cell_id, "scenario_type": AGENTIC_CODING, "concurrency": cell.concurrency,
        "kv_offloading": kv.tier, "kv_offload_backend": kv.backend,
        "kv_offload_version": kv.version, "kv_offload_label": kv.label, "trace": cell.trace,
        "duration_s": cell.duration_s, "request_count": cell.request_count,
        "warmup_request_count": cell.warmup_request_count,
        **asdict(par), "gpu_count": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def cell_document(cell: AgenticCell, fields: dict[str, Any], export: dict[str, Any], *,
                  provenance: dict[str, Any], client_seconds: float, aiperf_version: str,
                  artifacts: str, dram_gb: int) -> dict[str, Any]:
    kv = cell.kv_offload
    return {
        "scenario_type": AGENTIC_CODING, "conc": cell.concurrency,
        "kv_offloading": kv.tier,
        "kv_offload_backend": {"name": kv.backend, "version": kv.version} if kv.backend else None,
        "allocated_cpu_dram_gb": dram_gb, **fields,
        "aiperf_export": export, "aiperf_artifacts": artifacts,
        "m3patch": {"schema": CELL_SCHEMA, "scenario": AGENTIC_CODING, "cell": cell_record(cell),
                    "provenance": provenance, "client_seconds": round(client_seconds, 3),
                    "aiperf_version": aiperf_version},
    }  # fmt: skip


def check_fields(data: dict[str, Any], where: Path | str) -> None:
    """The figures a row and the gate read: present, finite, >= 0; at least one request."""
    if count(data, "num_requests_successful", where) < 1:
        raise invalid(where, "num_requests_successful", "no profiled request completed")
    count(data, "num_requests_total", where)
    for key in HEADLINE:
        number(data, key, where)
    for key in OPTIONAL_NUMBERS:
        if data.get(key) is not None:
            number(data, key, where)
    if not isinstance(data.get("aiperf_export"), dict):
        raise invalid(where, "aiperf_export", "missing: the cell carries AIPerf's own export")


def read_agentic_cell(path: Path) -> dict[str, Any]:
    data = read_json_object(path)
    check_fields(data, path)
    extra = data["m3patch"]
    if extra.get("schema") != CELL_SCHEMA:
        raise invalid(path, "m3patch.schema", f"expected {CELL_SCHEMA}, got {extra.get('schema')!r}")
    for block in ("cell", "provenance"):
        if not isinstance(extra.get(block), dict):
            raise invalid(path, f"m3patch.{block}", "missing or not an object")
    for key in CELL_KEYS:
        if key not in extra["cell"]:
            raise invalid(path, f"m3patch.cell.{key}", "missing")
    return data


def finished(path: Path, cell: AgenticCell, trace_key: str | None = None) -> bool:
    """For --resume: a valid file for exactly this cell; with `trace_key`, measured on that
    synthesized trace (an edited manifest keeps its name, not its sessions)."""
    if not path.is_file():
        return False
    try:
        data = read_json_object(path)
        if not is_agentic(data):
            return False
        data = read_agentic_cell(path)
    except ResultsInvalid:
        return False
    if trace_key is not None:
        replayed = data["m3patch"]["provenance"].get("agentic_trace")
        if not isinstance(replayed, dict) or replayed.get("key") != trace_key:
            return False
    return bool(data["m3patch"]["cell"] == cell_record(cell))


ROW_FIELDS = (
    "scenario_type", "kv_offloading", "allocated_cpu_dram_gb", "num_requests_total",
    "num_requests_successful", "duration_seconds", "input_tput_tps", "output_tput_tps",
    "total_tput_tps", "tput_per_gpu", "output_tput_per_gpu", "input_tput_per_gpu",
    "mean_input_tokens", "mean_output_tokens",
    *(f"{stat}_{m}" for m in ("ttft", "e2el", "itl", "tpot", "intvty", "e2e_norm_intvty")
      for stat in ("mean", "p50", "p75", "p90", "p95", "std")),
    "server_prefix_cache_queries", "server_prefix_cache_hits", *OPTIONAL_NUMBERS[:5],
    "decode_na", "decode_na_reason",
)  # fmt: skip
KEY_FIELDS = ("cell_id", "concurrency", "tp", "pp", "ep", "dp", "dp_attention", "gpu_count",
              "parallelism", "kv_offload_label", "trace")


def agentic_row(data: dict[str, Any], provenance_fields: tuple[str, ...]) -> dict[str, Any]:
    """One aggregate row of a checked agentic cell (pure): InferenceX's names, m3patch's keys."""
    cell, prov = data["m3patch"]["cell"], data["m3patch"]["provenance"]
    row: dict[str, Any] = {key: cell.get(key) for key in KEY_FIELDS}
    row.update({key: prov.get(key) for key in provenance_fields})
    row.update({key: data.get(key) for key in ROW_FIELDS})
    backend = data.get("kv_offload_backend")
    row.update(
        isl=None, osl=None, range_ratio=None, conc=cell.get("concurrency"),
        kv_offload_backend=backend.get("name") if isinstance(backend, dict) else None,
        kv_offload_version=backend.get("version") if isinstance(backend, dict) else None,
        hw=prov.get("hw"), framework="vllm", precision=prov.get("precision"),
        spec_decoding=prov.get("spec_decoding"), disagg=False, is_multinode=False,
        # The fixed-length table's interactivity column: AIPerf's median ITL, inverted.
        median_intvty=data.get("p50_intvty"),
    )  # fmt: skip
    return row


def finite_or_none(value: object) -> float | None:
    return finite_number(value)
