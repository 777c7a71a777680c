"""Write a tuned table in vLLM's format, with provenance in a sidecar. Pure apart from `write_*`.

vLLM 0.33.0 `get_moe_configs` loads the JSON, drops only `triton_version` and turns every other
key into an int, so the table itself may hold nothing else: provenance (device, driver, versions,
date, command, per-batch timings) lives in `<table>.provenance.json` next to it, a name the
lookup never asks for.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from m3patch.errors import ResultsInvalid
from m3patch.fsio import read_json, write_json_atomic
from m3patch.tune.judge import JUDGE_RULE, Judgement
from m3patch.tune.routing import ROUTING_DENSE, ROUTING_EP
from m3patch.tune.space import TileConfig

__all__ = ["PROVENANCE_SUFFIX", "ROUTING_DENSE", "ROUTING_EP", "Provenance", "SearchRecord",
           "nearest_config", "read_table", "table_dict", "write_table"]

PROVENANCE_SUFFIX = ".provenance.json"
TABLE_KEYS = ("BLOCK_SIZE_M", "BLOCK_SIZE_N", "BLOCK_SIZE_K", "GROUP_SIZE_M", "num_warps",
              "num_stages")


@dataclass(frozen=True)
class SearchRecord:
    """What the search did at one batch size."""

    space: int  # configs in the pruned space (vLLM's default always among them)
    timed: int  # of those, with a quick timing
    resumed: int  # of the timed, taken from the cache of an earlier run
    failed: int
    default: str  # vLLM 0.33.0's default config key at this batch size
    default_us: float | None  # its refine timing, measured beside the picks


@dataclass(frozen=True)
class Provenance:
    device: str
    driver: str
    torch: str
    triton: str
    date: str
    command: str
    kernel_origin: str
    kernel_sha256: str
    shape: str
    timings_us: Mapping[int, float]
    expert_parallel: bool = False
    search: Mapping[int, SearchRecord] = field(default_factory=dict)
    judged: Mapping[int, Judgement] = field(default_factory=dict)
    routing: str = ""  # routing.Routing.describe(); empty: the benchmark convention


def table_dict(best: Mapping[int, TileConfig], triton_version: str) -> dict[str, Any]:
    table: dict[str, Any] = {"triton_version": triton_version}
    for batch in sorted(best):
        table[str(batch)] = best[batch].to_vllm()
    return table


def provenance_dict(prov: Provenance) -> dict[str, Any]:
    return {
        "schema": 1, "tool": "m3patch tune", "device": prov.device, "driver": prov.driver,
        "torch": prov.torch, "triton": prov.triton, "date": prov.date, "command": prov.command,
        "kernel": {"origin": prov.kernel_origin, "fused_moe_py_sha256": prov.kernel_sha256},
        "shape": prov.shape,
        "routing": prov.routing or (ROUTING_EP if prov.expert_parallel else ROUTING_DENSE),
        "median_us_gemm1_plus_gemm2": {str(b): round(us, 2)
                                       for b, us in sorted(prov.timings_us.items())},
        "search": {str(b): _search_dict(rec) for b, rec in sorted(prov.search.items())},
        "judge": {"rule": JUDGE_RULE,
                  "per_batch": {str(b): j.to_dict() for b, j in sorted(prov.judged.items())}},
    }


def _search_dict(rec: SearchRecord) -> dict[str, Any]:
    return {"space": rec.space, "timed": rec.timed, "resumed_from_cache": rec.resumed,
            "failed": rec.failed, "vllm_default": rec.default,
            "vllm_default_us": None if rec.default_us is None else round(rec.default_us, 2)}


def _dump(path: Path, data: Mapping[str, Any]) -> None:
    write_json_atomic(path, data, indent=4)


def write_table(out_dir: Path, file_name: str, best: Mapping[int, TileConfig],
                prov: Provenance) -> Path:
    path = out_dir / file_name
    _dump(path, table_dict(best, prov.triton))
    _dump(path.with_name(path.name + PROVENANCE_SUFFIX), provenance_dict(prov))
    return path


def read_table(path: Path) -> dict[int, TileConfig]:
    """Load a table the way vLLM does (drop triton_version, int keys) and validate entries."""
    raw: dict[str, Any] = read_json(path, error=ResultsInvalid, expect=dict,
                                    hint="re-run `m3patch tune` to regenerate it")
    raw.pop("triton_version", None)
    table: dict[int, TileConfig] = {}
    for key, entry in raw.items():
        if not key.isdigit() or not isinstance(entry, dict) or set(entry) < set(TABLE_KEYS):
            msg = f"{path}: entry {key!r} is not batch -> {{{', '.join(TABLE_KEYS)}}}"
            raise ResultsInvalid(msg, hint="vLLM would fail on it; regenerate the table")
        table[int(key)] = TileConfig.from_vllm(entry)
    return table


def nearest_config(table: Mapping[int, TileConfig], batch: int) -> TileConfig:
    """vLLM's pick: the entry whose batch size is closest (ties: the first/smaller key)."""
    return table[min(table.keys(), key=lambda key: abs(key - batch))]
