"""Aggregate a run folder's per-cell files into aggregate.json and aggregate.csv.

Field names follow InferenceX's utils/process_result.py so its readers work unchanged:
tput_per_gpu = total_token_throughput / gpu_count, output_tput_per_gpu, input_tput_per_gpu
(total - output), latencies in seconds without the `_ms` suffix (median_ttft, p99_tpot, ...),
and interactivity `<stat>_intvty` = 1000 / <stat>_tpot_ms (tokens/s seen by one user). Each
row also carries InferenceX's row keys (`conc`, `hw`, `framework`, `precision`, `spec_decoding`,
`model`, `disagg`, `is_multinode`) beside m3patch's own (`concurrency`, the provenance
fields); a value m3patch does not know is null, never guessed. docs/inferencex-fields.md maps
every field. Statistics a recorded cell file lacks (mean, std, p99.9 before they were requested)
are null.

Decode figures are only kept when the client could time the decode. When the tokens reached it
in one burst (median TPOT under BURST_FLOOR_MS) TPOT, ITL and interactivity are null, with
`decode_na: "burst"` and a sentence in `decode_na_reason`, and the results table prints
"n/a (burst)". When only the gaps between chunks are under the floor (tokens arrived in clumps,
yet the mean decode rate over the request is real) only the ITL figures are null
(`decode_na: "itl clumped"`).
"""

from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from m3patch.bench.agentic.results import ROW_FIELDS as AGENTIC_FIELDS
from m3patch.bench.agentic.results import agentic_row, is_agentic, read_agentic_cell
from m3patch.bench.cell_shape import AGENTIC_SHAPE_FIELDS, SHAPE_FIELDS, shape
from m3patch.bench.inferencex import SOURCE_HINT, inferencex_aggregate, is_inferencex
from m3patch.bench.results import (
    BURST_FLOOR_MS,
    FIX_HINT,
    METRICS,
    invalid,
    read_cell_file,
    read_json_object,
    write_result,
)
from m3patch.errors import ResultsInvalid
from m3patch.eval.compare import EVALS, EvalRow, accuracy_cell, check_evals, evals_of_run
from m3patch.fsio import path_is, read_json, write_bytes_atomic
from m3patch.recipe.agentic import AGENTIC_CODING
from m3patch.recipe.lengths import CONVENTIONS
from m3patch.schema import finite_number, short_repr

AGGREGATE_JSON = "aggregate.json"
AGGREGATE_CSV = "aggregate.csv"
AGGREGATE_SCHEMA = 1
CELLS_DIR = "cells"
KEY_FIELDS = ("cell_id", "isl", "osl", "range_ratio", "length_convention", "concurrency", "tp",
              "pp", "ep", "dp", "dp_attention", "gpu_count", "parallelism")
PROVENANCE_FIELDS = ("recipe_name", "recipe_sha256", "series", "image", "vllm_version")
ALL_STATS = ("mean", "median", "std", "p90", "p99", "p99.9")
LATENCY_FIELDS = tuple(f"{stat}_{metric}" for metric in METRICS for stat in ALL_STATS)
# No std_intvty: 1000 / std(TPOT) is not a statistic of tokens/s per user.
INTVTY_STATS = tuple(stat for stat in ALL_STATS if stat != "std")
INTVTY_FIELDS = tuple(f"{stat}_intvty" for stat in INTVTY_STATS)
ITL_FIELDS = tuple(f"{stat}_itl" for stat in ALL_STATS)
# InferenceX's row keys that m3patch's own names do not already cover (utils/process_result.py
# on InferenceX main; docs/inferencex-fields.md). `image` is one of them too, already in the
# provenance fields; `dp_attention` is among the key fields, written as InferenceX's string.
INFERENCEX_FIELDS = ("conc", "hw", "model", "infmax_model_prefix", "framework", "precision",
                     "spec_decoding", "disagg", "is_multinode", "dcp_size", "pcp_size",
                     "recipe_fingerprint", "std_intvty")
# m3patch's own beside them: the speculative method vLLM ran (InferenceX says mtp for EAGLE3).
# `isl_convention`: "chat-template" (the stated ISL includes the chat template the client applied,
# InferenceX's --use-chat-template) or "prompt" (the prompt's own tokens; rows from before it).
OWN_FIELDS = ("speculative_method", "isl_convention")
ISL_CONVENTIONS = ("chat-template", "prompt")
# The single-node server m3patch starts is always vLLM, never disaggregated, never multi-node.
FRAMEWORK = "vllm"
# Where m3patch writes null (tokens reached the client in a burst or in clumps), InferenceX's
# figure for the same statistic is kept beside it under this prefix, named as InferenceX's.
INFERENCEX_FIGURE = "inferencex_"
DECODE_FIELDS = (*(f"{stat}_tpot" for stat in ALL_STATS), *ITL_FIELDS, *INTVTY_FIELDS)
NA_FIELDS = ("decode_na", "decode_na_reason")
# The floor under which a per-token time is not a decode rate. One decode step through vLLM's
# API server costs at least about a millisecond on any hardware m3patch targets (scheduler,
# forward pass, sampler, detokenizer, one SSE write), and speculative decoding that lands 4-5
# tokens per step still leaves 0.2 ms or more per token. A median TPOT or ITL under 0.1 ms
# (10,000 tok/s for one user) therefore means the tokens were queued and reached the client in
# one read: the figure measures that buffering, not the model, so it is reported as n/a.
COLUMNS = (
    *KEY_FIELDS, *INFERENCEX_FIELDS, *OWN_FIELDS, *PROVENANCE_FIELDS, "completed", "failed", "duration", "total_token_throughput",
    "output_throughput", "tput_per_gpu", "output_tput_per_gpu", "input_tput_per_gpu",
    *LATENCY_FIELDS, *INTVTY_FIELDS, *NA_FIELDS,
)  # fmt: skip


def read_any_cell(path: Path) -> dict[str, Any]:
    """A per-cell file of either scenario, checked: an agentic cell (AIPerf) or a fixed-length
    one (vLLM's client)."""
    if is_agentic(read_json_object(path)):
        return read_agentic_cell(path)
    return read_cell_file(path)


def cell_row(data: dict[str, Any]) -> dict[str, Any]:
    """One aggregate row from a checked per-cell document (pure)."""
    if is_agentic(data):
        return agentic_row(data, PROVENANCE_FIELDS)
    cell, prov = data["m3patch"]["cell"], data["m3patch"]["provenance"]
    gpus = cell["gpu_count"]
    total, output = data["total_token_throughput"], data["output_throughput"]
    # Cell files from before the length convention was recorded keep rows without it (vLLM's).
    row: dict[str, Any] = {key: cell.get(key) for key in KEY_FIELDS
                           if key in cell or key != "length_convention"}
    row.update({key: prov.get(key) for key in PROVENANCE_FIELDS})
    row.update(
        completed=data["completed"], failed=data["failed"], duration=data["duration"],
        total_token_throughput=total, output_throughput=output,
        tput_per_gpu=total / gpus, output_tput_per_gpu=output / gpus,
        input_tput_per_gpu=(total - output) / gpus,
    )  # fmt: skip
    row.update(inferencex_fields(data, cell, prov))
    for field in LATENCY_FIELDS:
        value = data.get(f"{field}_ms")
        row[field] = None if value is None else value / 1000.0
    for stat in INTVTY_STATS:
        tpot_ms = data.get(f"{stat}_tpot_ms")
        # osl=1 has no decode step: TPOT is 0 and interactivity is undefined, not infinite.
        row[f"{stat}_intvty"] = 1000.0 / tpot_ms if tpot_ms else None
    std_tpot_ms = data.get("std_tpot_ms")
    # InferenceX renames every tpot key: 1000 / std(TPOT), its figure, not a statistic of
    # tokens/s per user; m3patch's comparisons never use it.
    row["std_intvty"] = 1000.0 / std_tpot_ms if std_tpot_ms else None
    tag, reason = decode_na(data, cell.get("osl"))
    row.update(decode_na=tag, decode_na_reason=reason)
    if tag is not None:
        nulled = DECODE_FIELDS if tag == "burst" else ITL_FIELDS
        row.update({f"{INFERENCEX_FIGURE}{field}": row[field] for field in nulled})
        row.update(dict.fromkeys(nulled))
    return row


def inferencex_fields(
    data: dict[str, Any], cell: dict[str, Any], prov: dict[str, Any]
) -> dict[str, Any]:
    """InferenceX's own row keys for one cell (pure), from the provenance the run recorded (the
    recipe's `inferencex` identity); a cell recorded before it was kept has them null."""
    model = data.get("model_id")
    return {
        "conc": cell.get("concurrency"), "hw": prov.get("hw"),
        "model": model if isinstance(model, str) else None,
        "infmax_model_prefix": prov.get("infmax_model_prefix"),
        "framework": prov.get("framework") or FRAMEWORK, "precision": prov.get("precision"),
        "spec_decoding": prov.get("spec_decoding"), "disagg": False, "is_multinode": False,
        "dcp_size": prov.get("dcp_size", 1), "pcp_size": prov.get("pcp_size", 1),
        "recipe_fingerprint": prov.get("recipe_sha256"),
        # InferenceX copies DP_ATTENTION from the environment: the string "true" / "false".
        "dp_attention": "true" if cell.get("dp_attention") else "false",
        "speculative_method": prov.get("speculative_method"),
        "isl_convention": cell.get("isl_convention") or "prompt",
    }  # fmt: skip


def decode_na(data: dict[str, Any], osl: object) -> tuple[str | None, str | None]:
    """Which decode figures of a checked result are not measurements, and why (pure):
    (None, None), ("burst", reason) or ("itl clumped", reason).

    One output token has no decode step to time (TPOT 0 is then exact, not a burst)."""
    if isinstance(osl, int) and osl <= 1:
        return None, None
    tpot, itl = data["median_tpot_ms"], data["median_itl_ms"]
    if tpot < BURST_FLOOR_MS:
        return "burst", (
            f"median TPOT {tpot:.4f} ms is under the {BURST_FLOOR_MS} ms floor of a real decode "
            f"step: the tokens reached the client in one burst, so TPOT, ITL and interactivity "
            f"are not reported")
    if itl < BURST_FLOOR_MS:
        return "itl clumped", (
            f"median ITL {itl:.4f} ms is under the {BURST_FLOOR_MS} ms floor: the tokens reached "
            f"the client in clumps, so ITL is not reported (TPOT {tpot:.2f} ms, the mean decode "
            f"rate over each request, is)")
    return None, None


def _ms(seconds: object) -> str:
    return f"{seconds * 1000:.1f}" if isinstance(seconds, (int, float)) else "-"


def _decode(row: dict[str, Any], text: str | None) -> str:
    if text is None and row.get("decode_na"):
        return f"n/a ({row['decode_na']})"
    return text if text is not None else "-"


AGENTIC_COLUMNS = (
    "cell_id", "concurrency", "tp", "pp", "ep", "dp", "dp_attention", "gpu_count", "parallelism",
    "kv_offload_label", "kv_offload_backend", "kv_offload_version", "trace", *INFERENCEX_FIELDS,
    *PROVENANCE_FIELDS, *AGENTIC_FIELDS,
)  # fmt: skip
AGENTIC_RESULT_COLUMNS = ["parallelism", "kv-offload", "conc", "tok/s/GPU", "out tok/s/GPU",
                          "E2E-norm intvty p90", "TTFT p90 ms", "ITL p50 ms", "prefix hit %",
                          "KV use max %", "ok/total"]


def _pct(value: object) -> str:
    """A share in percent, three significant digits: a small real figure never prints as 0.0."""
    return f"{value * 100:.3g}" if isinstance(value, (int, float)) else "-"


def _num(value: object, spec: str = ".2f") -> str:
    return format(value, spec) if isinstance(value, (int, float)) else "-"


def agentic_result_cells(row: dict[str, Any]) -> list[Any]:
    """One line of an agentic run's table: InferenceX's headline first (tok/s per user, from
    1 / P90 of E2EL / OSL), the per-GPU throughput, the server's prefix-cache hit rate."""
    return [row["parallelism"], row.get("kv_offload_label"), row["concurrency"],
            _num(row.get("tput_per_gpu"), ".1f"), _num(row.get("output_tput_per_gpu"), ".1f"),
            _num(row.get("p90_e2e_norm_intvty")), _ms(row.get("p90_ttft")),
            _ms(row.get("p50_itl")), _pct(row.get("server_gpu_cache_hit_rate")),
            _pct(row.get("gpu_kv_cache_usage_pct")),
            f"{row.get('num_requests_successful')}/{row.get('num_requests_total')}"]


def table_of(rows: Sequence[dict[str, Any]], evals: Sequence[EvalRow] = ()
             ) -> tuple[list[str], list[list[Any]]]:
    """The results table's columns and lines for a run's rows (either scenario). With the run's
    eval rows, an Accuracy column: the run's one server answered both, so every line carries the
    same scores against their floors."""
    if rows and all(row.get("scenario_type") == AGENTIC_CODING for row in rows):
        columns, lines = AGENTIC_RESULT_COLUMNS, [agentic_result_cells(r) for r in rows]
    else:
        columns, lines = RESULT_COLUMNS, [result_cells(r) for r in rows]
    if not evals:
        return columns, lines
    cell = accuracy_cell(evals)
    return [*columns, "Accuracy"], [[*line, cell] for line in lines]


RESULT_COLUMNS = ["parallelism", "isl/osl", "conc", "tok/s/GPU", "out tok/s/GPU", "TTFT p50 ms",
                  "TPOT p50 ms", "tok/s/user", "ok/failed"]


def result_cells(row: dict[str, Any]) -> list[Any]:
    """One line of the results table users read first (pure): n/a with the reason, never a
    number the client could not measure."""
    intvty = row.get("median_intvty")
    return [row["parallelism"], f"{row['isl']}/{row['osl']}", row["concurrency"],
            f"{row['tput_per_gpu']:.1f}", f"{row['output_tput_per_gpu']:.1f}",
            _ms(row.get("median_ttft")),
            _decode(row, _ms(row["median_tpot"]) if row.get("median_tpot") is not None else None),
            _decode(row, f"{intvty:.1f}" if intvty else None),
            f"{row['completed']}/{row['failed']}"]


def cell_files(run_dir: Path) -> list[Path]:
    return sorted((run_dir / CELLS_DIR).glob("*.json"))


def rows_of_run(run_dir: Path, cell_ids: Sequence[str] | None = None) -> list[dict[str, Any]]:
    """Rows of the run's per-cell files; only `cell_ids` when given (each must exist)."""
    if cell_ids is None:
        files = cell_files(run_dir)
    else:
        files = [run_dir / CELLS_DIR / f"{cell_id}.json" for cell_id in cell_ids]
    if not files:
        raise invalid(run_dir / CELLS_DIR, None, "no per-cell result files")
    rows = [cell_row(read_any_cell(path)) for path in files]
    return sorted(rows, key=_order)


def _order(row: dict[str, Any]) -> tuple[Any, ...]:
    return (row.get("isl") or 0, row.get("osl") or 0, row.get("kv_offload_label") or "",
            row["gpu_count"], row["parallelism"], row["concurrency"])


def csv_text(rows: list[dict[str, Any]]) -> str:
    columns = (AGENTIC_COLUMNS if rows and rows[0].get("scenario_type") == AGENTIC_CODING
               else COLUMNS)
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(columns), lineterminator="\n")
    writer.writeheader()
    for row in rows:
        writer.writerow({key: "" if row.get(key) is None else row[key] for key in columns})
    return out.getvalue()


def write_aggregate(
    run_dir: Path, meta: dict[str, Any], cell_ids: Sequence[str] | None = None
) -> list[dict[str, Any]]:
    """aggregate.json (meta, the eval's scores, rows) and aggregate.csv (rows) from the run's
    per-cell files and its eval/eval.json."""
    rows = rows_of_run(run_dir, cell_ids)
    write_result(run_dir / AGGREGATE_JSON, {"schema": AGGREGATE_SCHEMA, **meta,
                                            EVALS: evals_of_run(run_dir), "rows": rows})
    write_bytes_atomic(run_dir / AGGREGATE_CSV, csv_text(rows).encode("utf-8"), error=ResultsInvalid)
    return rows


def attach_evals(run_dir: Path) -> dict[str, Any]:
    """aggregate.json again with the eval that ran after the sweep: its rows as they were, its
    `evals` from eval/eval.json. Returns the aggregate as load_aggregate reads it."""
    file = run_dir / AGGREGATE_JSON
    load_aggregate(file)  # the rows written back must be valid ones
    raw = read_json_object(file)
    evals = evals_of_run(run_dir)
    head = {key: value for key, value in raw.items() if key not in (EVALS, "rows")}
    write_result(file, {**head, EVALS: evals, "rows": raw["rows"]})
    return load_aggregate(file)


def load_aggregate(path: Path) -> dict[str, Any]:
    """An aggregate.json, or a run folder holding one, or an InferenceX result row (or array of
    rows) read as one; rows checked for the keys compare uses."""
    file = path / AGGREGATE_JSON if path_is(path, "dir") else path
    if not path_is(path, "any"):  # a mistyped run: re-running a cell is no fix for that
        msg = f"{path}: no such file or folder"
        raise ResultsInvalid(msg, hint="name a run folder (results/RECIPE/RUN) or its "
                             "aggregate.json; `ls results/*/` lists the runs")
    raw = read_json(file, error=ResultsInvalid, hint=FIX_HINT)
    if is_inferencex(raw):
        data = inferencex_aggregate(raw, file)
        for index, row in enumerate(data["rows"]):
            _check_row(row, f"rows[{index}]", file)
        _check_unique(data["rows"], file)
        return data
    if not isinstance(raw, dict):
        raise invalid(file, None, f"expected an m3patch aggregate (an object), or {SOURCE_HINT}")
    data = raw
    if data.get("schema") != AGGREGATE_SCHEMA:
        raise invalid(file, "schema", f"expected {AGGREGATE_SCHEMA}, got {data.get('schema')!r}")
    rows = data.get("rows")
    if not isinstance(rows, list) or not rows:
        raise invalid(file, "rows", "missing or empty")
    if EVALS in data:  # aggregates written before the scores were kept have none
        data[EVALS] = check_evals(data[EVALS], str(file), FIX_HINT)
    for index, row in enumerate(rows):
        rows[index] = row = _own_flags(row) if isinstance(row, dict) else row
        _check_row(row, f"rows[{index}]", file)
    _check_unique(rows, file)
    return data


def _check_unique(rows: list[dict[str, Any]], file: Path) -> None:
    """One row per cell, a cell being what compare matches on (its shape and concurrency): a
    second copy, under its own cell_id or not, would silently win (or go unmatched)."""
    first: dict[tuple[Any, ...], int] = {}
    for index, row in enumerate(rows):
        earlier = first.setdefault((shape(row), row["concurrency"]), index)
        if earlier != index:
            msg = (f"{file}: key 'rows[{index}]': cell {row['cell_id']!r} repeats the shape and "
                   f"concurrency of rows[{earlier}] ({rows[earlier]['cell_id']!r}); an aggregate "
                   "holds one row per cell")
            raise ResultsInvalid(msg, hint="aggregate the run again from its cell files: "
                                 "m3patch bench RECIPE --resume --run-dir RUN")


def _own_flags(row: dict[str, Any]) -> dict[str, Any]:
    """dp_attention as m3patch compares it (a bool); the file keeps InferenceX's string."""
    flag = row.get("dp_attention")
    if isinstance(flag, str) and flag in ("true", "false"):
        return {**row, "dp_attention": flag == "true"}
    return row


def _check_row(row: object, where: str, file: Path) -> None:
    if not isinstance(row, dict):
        raise invalid(file, where, "expected an object")
    for key in (*SHAPE_FIELDS, *AGENTIC_SHAPE_FIELDS):  # compared by value: scalars only
        value = row.get(key)
        if not (value is None or isinstance(value, (str, bool)) or finite_number(value) is not None):
            raise invalid(file, f"{where}.{key}", "expected a string, a finite number or null, "
                          f"got {type(value).__name__}")
    if row.get("scenario_type") == AGENTIC_CODING:
        _check_agentic_row(row, where, file)
        return
    for key in (*KEY_FIELDS, "tput_per_gpu", "median_intvty"):
        if key not in row and key != "length_convention":  # older aggregates: vLLM's
            raise invalid(file, f"{where}.{key}", "missing")
    counted = row.get("isl_convention")
    if counted is not None and counted not in ISL_CONVENTIONS:
        raise invalid(file, f"{where}.isl_convention",
                      f"expected one of {', '.join(ISL_CONVENTIONS)}, got {counted!r}")
    convention = row.get("length_convention")
    if convention is not None and convention not in CONVENTIONS:
        raise invalid(file, f"{where}.length_convention",
                      f"expected one of {', '.join(CONVENTIONS)}, got {convention!r}")
    for key in ("isl", "osl", "concurrency", "tp", "pp", "ep", "dp", "gpu_count"):
        value = row[key]
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(file, f"{where}.{key}", f"expected a positive integer, got {value!r}")
    if not isinstance(row["dp_attention"], bool):
        raise invalid(file, f"{where}.dp_attention", f"expected true/false, got {row['dp_attention']!r}")
    for key in ("cell_id", "parallelism"):
        if not isinstance(row[key], str):
            raise invalid(file, f"{where}.{key}", f"expected a string, got {row[key]!r}")
    ratio = row["range_ratio"]
    # null: an InferenceX row, which does not record its length distribution.
    if ratio is not None and finite_number(ratio) is None:
        raise invalid(file, f"{where}.range_ratio", f"expected a number, got {short_repr(ratio)}")
    tput = finite_number(row["tput_per_gpu"])
    if tput is None or tput < 0:
        raise invalid(file, f"{where}.tput_per_gpu",
                      f"expected a number >= 0, got {short_repr(row['tput_per_gpu'])}")


def _check_agentic_row(row: dict[str, Any], where: str, file: Path) -> None:
    """An agentic row: its shape keys and the headline figures compare and plot read."""
    for key in ("concurrency", "tp", "pp", "ep", "dp", "gpu_count"):
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise invalid(file, f"{where}.{key}", f"expected a positive integer, got {value!r}")
    for key in ("cell_id", "parallelism", "kv_offload_label"):
        if not isinstance(row.get(key), str):
            raise invalid(file, f"{where}.{key}", f"expected a string, got {row.get(key)!r}")
    for key in ("tput_per_gpu", "p90_e2e_norm_intvty"):
        value = finite_number(row.get(key))
        if value is None or value < 0:
            raise invalid(file, f"{where}.{key}", f"expected a number >= 0, got "
                          f"{short_repr(row.get(key))}")

