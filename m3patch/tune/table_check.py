"""`m3patch tune --check TABLE`: which shape a table is for, and the report of its judgements.

Pure: the GPU work (one judge measurement per entry) lives in job.run_check. A table's file
name holds only E and N; the rest of the shape (K, top-k, expert parallelism) comes from the
provenance sidecar the tuner writes beside it, or from the shape options, and both must agree
with the file name. Every file read here is validated like hostile input.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from m3patch.errors import BenchFailed, ResultsInvalid, UsageError
from m3patch.fsio import read_json
from m3patch.tune.judge import JUDGE_RULE, Judgement
from m3patch.tune.shapes import MoEShape, shape_from_key
from m3patch.tune.tile import TileConfig
from m3patch.tune.writer import PROVENANCE_SUFFIX, read_table

_NAME = re.compile(r"E=(\d+),N=(\d+),device_name=([^,]+)")


def _name_sizes(table: Path) -> tuple[int, int]:
    match = _NAME.match(table.name)
    if match is None:
        msg = f"{table}: not a vLLM fused-MoE table name (E=..,N=..,device_name=...json)"
        raise UsageError(msg, hint="pass a table written by `m3patch tune` or shipped by vLLM")
    return int(match[1]), int(match[2])


def shape_for_table(table: Path, given: MoEShape | None) -> MoEShape:
    """The shape to judge `table` at: `given`, else the sidecar's; E and N must match the name."""
    if not table.is_file():
        msg = f"{table}: no such table file"
        raise UsageError(msg, hint="pass the path of a table JSON (E=..,N=..,device_name=...json)")
    if given is None:
        sidecar = table.with_name(table.name + PROVENANCE_SUFFIX)
        hint = "pass the shape: --shape E,N,K,TOPK[,ep] (or --recipe / --model-config)"
        prov = read_json(sidecar, error=UsageError, hint=hint, expect=dict, missing_ok=True)
        if prov is None:
            msg = f"{table}: no {sidecar.name} beside it to say K, top-k and expert parallelism"
            raise UsageError(msg, hint=hint)
        given = shape_from_key(prov.get("shape"), f"{sidecar} key 'shape'")
    experts, width = _name_sizes(table)
    if (given.num_experts, given.width) != (experts, width):
        msg = (f"{table}: the table is for E={experts},N={width} but the shape is "
               f"E={given.num_experts},N={given.width}")
        raise UsageError(msg, hint="pass the shape the table was tuned for")
    return given


def report(table: Path, shape: MoEShape, routing: str, judgements: Sequence[Judgement],
           env: Mapping[str, str]) -> dict[str, Any]:
    """The JSON `--check` writes: environment, routing, the rule, and each judgement."""
    return {"schema": 1, "tool": "m3patch tune --check", "table": str(table), "shape": shape.key,
            "routing": routing, "rule": JUDGE_RULE, **env,
            "losing_batches": [j.batch for j in judgements if j.loses],
            "per_batch": [j.to_dict() for j in judgements]}


def fail_on_losses(table: Path, judgements: Sequence[Judgement], json_path: Path) -> None:
    """BenchFailed naming every batch size whose entry loses to the default beyond noise."""
    losing = [j for j in judgements if j.loses]
    if not losing:
        return
    worst = ", ".join(f"M={j.batch} {j.ratio:.3f}x (noise {100 * j.noise:.1f}%)" for j in losing)
    msg = (f"{table}: {len(losing)} of {len(judgements)} entries are slower than vLLM's default "
           f"beyond the measured noise: {worst}; details in {json_path}")
    raise BenchFailed(msg, hint="re-tune on this GPU (`m3patch tune ...`: its judge keeps the "
                                "default where the tuned config does not win), or remove "
                                "the table so that vLLM falls back to its default")


def table_entries(table: Path) -> dict[int, TileConfig]:
    """The table's entries; an empty table is invalid (vLLM would fall back silently)."""
    entries = read_table(table)
    if not entries:
        msg = f"{table}: the table holds no batch sizes"
        raise ResultsInvalid(msg, hint="regenerate it with `m3patch tune`")
    return entries
