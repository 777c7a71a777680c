"""Sweep expansion into cells, GPU counting, and the exact `vllm bench serve` argv."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from m3patch.bench.cells import Cell, Parallelism, SeqLen, expand, sweep_cells
from m3patch.bench.client import BenchTarget, bench_argv
from m3patch.errors import UsageError


def test_cells_cover_every_seq_len_and_concurrency_in_sweep_order() -> None:
    cells = expand([SeqLen(1024, 1024), SeqLen(8192, 1024)], [1, 2, 4], Parallelism(tp=8), 0.8)
    assert [(c.seq.isl, c.concurrency) for c in cells] == [
        (1024, 1), (1024, 2), (1024, 4), (8192, 1), (8192, 2), (8192, 4)]
    assert cells[2].num_prompts == 40 and cells[2].num_warmups == 8
    assert cells[2].cell_id == "isl1024-osl1024-tp8-pp1-ep1-dp1-c4"
    assert len({c.cell_id for c in cells}) == 6


def test_prompt_and_warmup_multipliers_come_from_the_sweep() -> None:
    (cell,) = expand([SeqLen(32, 16)], [3], Parallelism(), 0.0, 5, 1)
    assert (cell.num_prompts, cell.num_warmups) == (15, 3)


@pytest.mark.parametrize(("par", "gpus", "label"), [
    (Parallelism(tp=8), 8, "TP8"),
    (Parallelism(tp=8, ep=8), 8, "TP8+EP8"),
    (Parallelism(tp=2, dp=4, ep=8), 8, "TP2+DP4+EP8"),
    # dp-attention: InferenceX puts the whole GPU count in TP; vLLM runs TP1 x DP8.
    (Parallelism(tp=8, ep=8, dp_attention=True), 8, "TP8+EP8+DPA"),
    (Parallelism(tp=4, pp=2), 8, "TP4+PP2"),
])
def test_gpu_count_and_label(par: Parallelism, gpus: int, label: str) -> None:
    assert par.gpu_count == gpus
    assert par.label == label


def test_only_plain_tp_is_a_latency_shape() -> None:
    assert Parallelism(tp=8).is_tp_only
    assert not Parallelism(tp=8, ep=8).is_tp_only
    assert not Parallelism(tp=8, dp_attention=True).is_tp_only


def test_sweep_cells_are_the_rows_in_order() -> None:
    rows = ((32, 16, (1, 2)), (32, 16, (4, 8)), (64, 16, (4,)), (64, 16, (8,)))
    cells = sweep_cells(rows, Parallelism(tp=2), 0.0, 5, 1)
    assert [(c.seq.isl, c.concurrency) for c in cells] == [
        (32, 1), (32, 2), (32, 4), (32, 8), (64, 4), (64, 8)]
    assert (cells[-1].num_prompts, cells[-1].num_warmups) == (40, 8)


def test_a_repeated_cell_is_refused() -> None:
    with pytest.raises(UsageError, match="cell isl32-osl16-tp8-pp1-ep8-dp1-c4 appears twice"):
        sweep_cells(((32, 16, (2, 4)), (32, 16, (4, 8))), Parallelism(tp=8, ep=8), 0.0)


@pytest.mark.parametrize(("concs", "ratio", "needle"), [
    ([], 0.8, "no concurrency values"),
    ([4, 2], 0.8, "strictly increasing"),
    ([1, 1], 0.8, "strictly increasing"),
    ([0, 1], 0.8, "strictly increasing"),
    ([1], 1.0, "outside [0, 1)"),  # vLLM 0.33's client rejects 1.0 (the pre-0.9 "fixed" value)
    ([1], -0.1, "outside [0, 1)"),
])
def test_bad_sweeps_are_usage_errors(concs: list[int], ratio: float, needle: str) -> None:
    with pytest.raises(UsageError, match=needle.replace("[", r"\[").replace(")", r"\)")) as info:
        expand([SeqLen(32, 16)], concs, Parallelism(), ratio)
    assert info.value.hint


def test_no_seq_lens_is_an_error() -> None:
    with pytest.raises(UsageError, match="no isl/osl pairs"):
        expand([], [1], Parallelism(), 0.0)


def test_seq_len_labels() -> None:
    assert SeqLen(8192, 1024).label == "8k1k"
    assert SeqLen(32, 16).label == "32/16"


def test_bench_argv_has_every_inferencex_flag(tmp_path: Path) -> None:
    target = BenchTarget(Path("/venv/bin/python"), "http://127.0.0.1:8765", "tiny-moe", "/m/tiny")
    cell = Cell(SeqLen(1024, 128), Parallelism(tp=8), 16, 0.8)
    argv = bench_argv(target, cell, tmp_path, "c16.json", seed=7)
    assert argv[:5] == ["/venv/bin/python", "-m", "vllm.entrypoints.cli.main", "bench", "serve"]
    opts = dict(itertools.pairwise(argv[5:]))
    expected = {
        "--backend": "vllm", "--base-url": "http://127.0.0.1:8765", "--model": "tiny-moe",
        "--tokenizer": "/m/tiny", "--dataset-name": "random", "--random-input-len": "1024",
        "--random-output-len": "128", "--random-range-ratio": "0.8", "--num-prompts": "160",
        "--num-warmups": "32", "--max-concurrency": "16", "--request-rate": "inf",
        "--percentile-metrics": "ttft,tpot,itl,e2el", "--metric-percentiles": "90,99,99.9",
        "--result-dir": str(tmp_path), "--result-filename": "c16.json", "--seed": "7",
    }
    for flag, value in expected.items():
        assert opts[flag] == value, flag
    assert "--ignore-eos" in argv and "--save-result" in argv
