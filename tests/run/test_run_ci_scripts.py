"""CI's check of the demo's printed output (scripts/ci/check_demo_output.py) on a real demo log.

tests/data/demo/: the tail of `bash scripts/demo.sh` on the 2-core machine (2026-12-01, the
osl-16 workload; checkout and home paths made relative) and that run's aggregate.json.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

from core_helpers import REPO

DATA = REPO / "tests" / "data" / "demo"


def _checker() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_demo_output",
                                                  REPO / "scripts" / "ci" / "check_demo_output.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _inputs() -> tuple[list[str], list[dict[str, object]]]:
    lines = (DATA / "demo.log").read_text().splitlines()
    return lines, json.loads((DATA / "aggregate.json").read_text())["rows"]


def test_the_real_demo_table_passes() -> None:
    lines, rows = _inputs()
    assert _checker().table_problems(lines, rows) == []


def test_a_degenerate_tpot_printed_as_a_number_fails() -> None:
    lines, rows = _inputs()
    bad = [line.replace("│ 5.9         │", "│ 0.0         │") for line in lines]
    assert _checker().table_problems(bad, rows) == ["32/16 c1: TPOT 0.0 ms printed as a number"]


def test_a_missing_table_or_cell_line_fails() -> None:
    lines, rows = _inputs()
    check = _checker()
    assert check.table_problems([line for line in lines if "per-GPU results" not in line], rows)
    without_c4 = [line for line in lines if "│ 4    │" not in line]
    assert check.table_problems(without_c4, rows) == ["no table line for 32/16 at concurrency 4"]


def test_the_gate_must_pass_a_real_score_against_a_real_floor(tmp_path: Path) -> None:
    check, record = _checker(), tmp_path / "eval.json"
    for score, floor, ok in ((0.96875, 0.75, True), (0.0, 0.0, False), (0.5, 0.75, False)):
        record.write_text(json.dumps({"tasks": [{"score": score, "min": floor}]}))
        assert (check.gate_problems(record) == []) is ok, (score, floor)
    record.write_text("{}")
    assert check.gate_problems(record) == [f"{record}: no single task with a score and a floor"]
