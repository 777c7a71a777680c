"""CI's check of the demo's printed output (scripts/ci/check_demo_output.py) on a real demo log.

tests/data/demo/: the output of the demo's main job, `m3patch ci recipes/cpu_tiny_moe.yaml`, on the
2-core machine (2026-12-02, the trained tiny model, floor 0.875; the run folder's path written
as RUN_DIR, the checkout's as ./) and that run's aggregate.json, with the accuracy gate's score in both.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
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


def _edit_cell_line(lines: list[str], concurrency: int, edit: object) -> list[str]:
    """The log with the table line of one concurrency edited (a list of cells -> a line, or
    None to drop it)."""
    check = _checker()
    header = next(check.cells_of(line) for line in lines if "TPOT p50 ms" in line)
    out = []
    for line in lines:
        cells = check.cells_of(line)
        if len(cells) == len(header) and cells[2] == str(concurrency):
            assert callable(edit)
            line = edit(header, cells)
            if line is None:
                continue
        out.append(line)
    return out


def test_a_degenerate_tpot_printed_as_a_number_fails() -> None:
    lines, rows = _inputs()

    def zero_tpot(header: list[str], cells: list[str]) -> str:
        cells[header.index("TPOT p50 ms")] = "0.0"
        return "  ".join(cells)

    label = f"{rows[0]['isl']}/{rows[0]['osl']}"
    assert _checker().table_problems(_edit_cell_line(lines, 1, zero_tpot), rows) == [
        f"{label} c1: TPOT 0.0 ms printed as a number"]


def test_a_missing_table_or_cell_line_fails() -> None:
    lines, rows = _inputs()
    check = _checker()
    assert check.table_problems([line for line in lines if "per-GPU results" not in line], rows)
    without_c4 = _edit_cell_line(lines, 4, lambda header, cells: None)
    label = f"{rows[0]['isl']}/{rows[0]['osl']}"
    assert check.table_problems(without_c4, rows) == [f"no table line for {label} at concurrency 4"]


def test_the_score_must_sit_beside_every_throughput_line() -> None:
    lines, rows = _inputs()
    check = _checker()
    no_column = [line.replace("Accuracy", "") for line in lines]
    assert check.table_problems(no_column, rows) == [
        "the results table has no Accuracy column (the gate's score beside the rows)"]

    def blank_score(header: list[str], cells: list[str]) -> str:
        cells[header.index("Accuracy")] = "-"
        return "  ".join(cells)

    label = f"{rows[0]['isl']}/{rows[0]['osl']}"
    assert check.table_problems(_edit_cell_line(lines, 2, blank_score), rows) == [
        f"{label} c2: Accuracy '-'"]


def test_the_gate_must_pass_a_real_score_against_a_real_floor(tmp_path: Path) -> None:
    check, record = _checker(), tmp_path / "eval.json"
    for score, floor, ok in ((0.96875, 0.75, True), (0.0, 0.0, False), (0.5, 0.75, False)):
        record.write_text(json.dumps({"tasks": [{"score": score, "min": floor}]}))
        assert (check.gate_problems(record) == []) is ok, (score, floor)
    record.write_text("{}")
    assert check.gate_problems(record) == [f"{record}: no single task with a score and a floor"]
    # the aggregate must carry the same score, floor and verdict
    record.write_text(json.dumps({"tasks": [{"score": 1.0, "min": 0.875}]}))
    same = [{"task": "tiny_arith", "score": 1.0, "min": 0.875, "passed": True}]
    assert check.gate_problems(record, same) == []
    for evals in ([], [{**same[0], "score": 0.5}], [{**same[0], "passed": False}], {"x": 1}):
        assert check.gate_problems(record, evals), evals


def _demo_run(tmp_path: Path, aggregate: dict[str, object]) -> Path:
    """The demo log with its run folder at tmp_path/run, holding every artifact the check asks
    for: `aggregate` as its aggregate.json, one cell file per row, the gate's eval.json."""
    run = tmp_path / "run"
    for name in ("server.log", "aggregate.csv", "plots/throughput_per_gpu.png",
                 "plots/interactivity_vs_throughput.png", "ledger.json", "ci.json"):
        (run / name).parent.mkdir(parents=True, exist_ok=True)
        (run / name).write_text("x")
    rows = aggregate["rows"]
    assert isinstance(rows, list)
    (run / "cells").mkdir()
    for index in range(len(rows)):
        (run / "cells" / f"c{index}.json").write_text("{}")
    (run / "eval").mkdir()
    (run / "eval" / "eval.json").write_text(json.dumps({"tasks": [{"score": 1.0, "min": 0.875}]}))
    (run / "aggregate.json").write_text(json.dumps(aggregate))
    log = tmp_path / "demo.log"
    log.write_text((DATA / "demo.log").read_text().replace("RUN_DIR", str(run)))
    return log


def test_an_aggregate_without_evals_fails_the_demo_check(tmp_path: Path) -> None:
    """Before: a missing `evals` key skipped the check, so a regression that stopped writing the
    scores into aggregate.json passed CI."""
    aggregate = json.loads((DATA / "aggregate.json").read_text())
    script = str(REPO / "scripts" / "ci" / "check_demo_output.py")
    log = _demo_run(tmp_path / "kept", aggregate)
    done = subprocess.run([sys.executable, script, str(log)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 0, done.stdout
    del aggregate["evals"]
    log = _demo_run(tmp_path / "dropped", aggregate)
    done = subprocess.run([sys.executable, script, str(log)], capture_output=True, text=True,
                          check=False)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "check_demo_output: aggregate.json has no `evals` (the gate's scores beside the rows)"]
