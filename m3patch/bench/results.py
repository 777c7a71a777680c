"""Per-cell result files: read and check vLLM's result JSON, decide pass/fail, add provenance.

A per-cell file is vLLM's own result object with one extra top-level key, `m3patch`, holding the
cell, the provenance and the client's wall time, so tools that read vLLM results still read it.
Every malformed or missing file raises ResultsInvalid naming the file and the key.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from m3patch.bench.cells import Cell
from m3patch.errors import ResultsInvalid
from m3patch.fsio import read_json, write_json_atomic
from m3patch.schema import finite_number, short_repr

# Below this median time per output token the client did not see a decode, only the tokens of
# one network chunk: decode figures are null with the reason (aggregate.py, agentic scoring).
BURST_FLOOR_MS = 0.1

CELL_SCHEMA = 1
METRICS = ("ttft", "tpot", "itl", "e2el")
# Required in every per-cell file (vLLM always writes median_*; p90/p99 were requested by every
# m3patch version). The optional ones were added later (mean/std are always written by vLLM 0.33,
# p99.9 only when requested): a recorded file without them still loads, their fields null.
STATS = ("median", "p90", "p99")
OPTIONAL_STATS = ("mean", "std", "p99.9")
COUNT_KEYS = ("completed", "failed", "num_prompts")
NUMBER_KEYS = (
    "duration", "total_input_tokens", "total_output_tokens", "request_throughput",
    "output_throughput", "total_token_throughput",
    *(f"{stat}_{metric}_ms" for metric in METRICS for stat in STATS),
)  # fmt: skip
OPTIONAL_KEYS = tuple(f"{stat}_{metric}_ms" for metric in METRICS for stat in OPTIONAL_STATS)
FIX_HINT = "rerun the cell: m3patch bench RECIPE --resume (it re-measures invalid cells)"


def invalid(where: Path | str, key: str | None, problem: str) -> ResultsInvalid:
    at = f" key {key!r}:" if key else ""
    return ResultsInvalid(f"{where}:{at} {problem}", hint=FIX_HINT)


def read_json_object(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = read_json(path, error=ResultsInvalid, hint=FIX_HINT, expect=dict)
    return data


def number(data: dict[str, Any], key: str, where: Path | str) -> float:
    """A finite, non-negative number under `key` (bools are not numbers here)."""
    if key not in data:
        raise invalid(where, key, "missing")
    value = data[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise invalid(where, key, f"expected a number, got {short_repr(value)}")
    number = finite_number(value)
    if number is None or number < 0:
        raise invalid(where, key, f"expected a finite number >= 0, got {short_repr(value)}")
    return number


def count(data: dict[str, Any], key: str, where: Path | str) -> int:
    value = number(data, key, where)
    if value != int(value):
        raise invalid(where, key, f"expected a whole number, got {data[key]!r}")
    return int(value)


def check_vllm_result(data: dict[str, Any], where: Path | str) -> None:
    """The keys the aggregate needs: fail on the first one missing or malformed."""
    for key in COUNT_KEYS:
        count(data, key, where)
    for key in NUMBER_KEYS:
        number(data, key, where)
    for key in OPTIONAL_KEYS:
        if key in data:
            number(data, key, where)


def cell_failures(data: dict[str, Any], cell: Cell) -> list[str]:
    """Why a checked result does not count; vLLM's client exits 0 in every one of these cases."""
    problems = []
    if data["num_prompts"] != cell.num_prompts:
        problems.append(f"num_prompts is {data['num_prompts']}, the cell sends {cell.num_prompts}")
    if data["failed"] > 0:
        problems.append(f"{data['failed']} of {data['num_prompts']} requests failed")
    if data["completed"] < cell.num_prompts:
        problems.append(f"only {data['completed']} of {cell.num_prompts} requests completed")
    return problems


# Files from before a convention was recorded: vLLM's lengths, completions, ISL = the prompt.
CELL_RECORD_DEFAULTS = {"length_convention": "vllm", "chat": False, "isl_convention": "prompt"}


def cell_record(cell: Cell) -> dict[str, Any]:
    par = cell.parallelism
    return {
        "cell_id": cell.cell_id, "isl": cell.seq.isl, "osl": cell.seq.osl,
        "concurrency": cell.concurrency, "range_ratio": cell.range_ratio,
        "length_convention": cell.length_convention, "chat": cell.chat,
        "isl_convention": "chat-template" if cell.chat else "prompt",
        "num_prompts": cell.num_prompts, "num_warmups": cell.num_warmups,
        **asdict(par), "gpu_count": par.gpu_count, "parallelism": par.label,
    }  # fmt: skip


def cell_document(
    vllm_result: dict[str, Any], cell: Cell, provenance: dict[str, Any], client_seconds: float
) -> dict[str, Any]:
    extra = {
        "schema": CELL_SCHEMA,
        "cell": cell_record(cell),
        "provenance": provenance,
        "client_seconds": round(client_seconds, 3),
    }
    return {**vllm_result, "m3patch": extra}


def write_result(path: Path, data: object) -> None:
    """A result file, sorted keys; a write failure is a results error (exit 17)."""
    write_json_atomic(path, data, sort_keys=True, error=ResultsInvalid)


def read_cell_file(path: Path) -> dict[str, Any]:
    """A per-cell file written by m3patch: vLLM's keys plus a well-formed `m3patch` block."""
    data = read_json_object(path)
    check_vllm_result(data, path)
    extra = data.get("m3patch")
    if not isinstance(extra, dict):
        raise invalid(path, "m3patch", "missing (not a per-cell file written by m3patch bench)")
    if extra.get("schema") != CELL_SCHEMA:
        raise invalid(path, "m3patch.schema", f"expected {CELL_SCHEMA}, got {extra.get('schema')!r}")
    for block in ("cell", "provenance"):
        if not isinstance(extra.get(block), dict):
            raise invalid(path, f"m3patch.{block}", "missing or not an object")
    cell = extra["cell"]
    for key in ("cell_id", "isl", "osl", "concurrency", "tp", "pp", "ep", "dp", "gpu_count"):
        if key not in cell:
            raise invalid(path, f"m3patch.cell.{key}", "missing")
    return data


def gated_by(provenance: object, recipe_sha256: str) -> bool:
    """A provenance block of a result measured on a server m3patch verified and gated (never an
    external one), launched from exactly these recipe bytes."""
    return (isinstance(provenance, dict) and provenance.get("verified") is True
            and provenance.get("recipe_sha256") == recipe_sha256)


def finished_cell(path: Path, cell: Cell, gated: str | None = None) -> bool:
    """For --resume: a valid per-cell file for exactly this cell, with every request done; with
    `gated` (a recipe's sha256, as ci asks), also measured on a gated server of that recipe."""
    if not path.is_file():
        return False
    try:
        data = read_cell_file(path)
    except ResultsInvalid:
        return False
    # Files written before the length convention and chat client were recorded measured vLLM's
    # convention over completions: read their absence as exactly that.
    stored = {**CELL_RECORD_DEFAULTS, **data["m3patch"]["cell"]}
    same_cell = stored == cell_record(cell)
    if gated is not None and not gated_by(data["m3patch"]["provenance"], gated):
        return False
    return same_cell and not cell_failures(data, cell)
