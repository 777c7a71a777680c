"""The small-batch split-K decision logic on the recorded H200 runs (CPU only).

Fixtures are the committed device outputs in docs/results/tune-h200/small-batch/: call1's
sweep (scripts/measure/h200/small_batch_h200.py), call2's two `tune --check` runs of the candidate table,
call3's bench of the shipped tables.
"""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from m3patch.errors import ResultsInvalid
from m3patch.patching.series import load_series
from m3patch.tune import naming
from m3patch.tune.inputs import Alignment
from m3patch.tune.launch import MIN_K_ITERS_PER_SPLIT, GemmArgs, effective_split, splitk_sizes
from m3patch.tune.shapes import MoEShape
from m3patch.tune.small_batch import (
    FLOOR_TARGET,
    Timed,
    candidate_configs,
    confirmed,
    extra_configs,
    fastest,
    floor_fraction,
    reaches_target,
    split_k_picks,
    time_at_target,
)
from m3patch.tune.tile import TileConfig
from m3patch.tune.writer import read_table

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs/results/tune-h200/small-batch"
TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
TOLERANCE = 2e-2  # kernel_timer.TOLERANCE (kernel_timer imports torch)
SHIPPED = {1: "M16-N64-K128-G1-w4-s3-k8", 2: "M16-N64-K128-G1-w4-s3-k4",
           4: "M16-N64-K128-G1-w4-s3-k3"}


def _json(rel: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((RESULTS / rel).read_text())
    return data


def test_split_key_round_trips_and_unsplit_stays_vllms_spelling() -> None:
    plain = TileConfig(16, 64, 128, 1, 4, 3)
    split = TileConfig(16, 64, 128, 1, 4, 3, 8)
    assert plain.key == "M16-N64-K128-G1-w4-s3" and "SPLIT_K" not in plain.to_vllm()
    assert split.key == "M16-N64-K128-G1-w4-s3-k8" and split.to_vllm()["SPLIT_K"] == 8
    for cfg in (plain, split):
        assert TileConfig.from_key(cfg.key) == cfg
        assert TileConfig.from_vllm(cfg.to_vllm()) == cfg


def test_launcher_splits_gemm1_only() -> None:
    cfg = TileConfig(16, 64, 128, 1, 4, 3, 8)
    assert effective_split(cfg, 6144, 128) == 8  # GEMM1: 48 K iterations
    assert effective_split(cfg, 384, 128) == 1  # GEMM2: 3 iterations, never split
    assert effective_split(TileConfig(16, 64, 128, 1, 4, 3, 24), 6144, 128) == \
        48 // MIN_K_ITERS_PER_SPLIT
    assert effective_split(TileConfig(16, 64, 64, 1, 4, 3, 24), 6144, 64) == 24


def test_no_split_on_rocm(monkeypatch: pytest.MonkeyPatch) -> None:
    """A ROCm torch build times a split config unsplit, as patched vLLM runs it there."""
    torch = pytest.importorskip("torch")
    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    assert effective_split(TileConfig(16, 64, 128, 1, 4, 3, 8), 6144, 128) == 1


class _Sized:
    def __init__(self, *dims: int) -> None:
        self.dims = dims

    def size(self, axis: int) -> int:
        return self.dims[axis]


def test_splitk_buffers_cover_every_tile() -> None:
    """M=1, naive path: 4 pairs x 12 N tiles of 16x64 for GEMM1, 8 slices each."""
    align = Alignment(None, None, None)
    gemm1 = GemmArgs(_Sized(1, 6144), _Sized(128, 768, 6144), None, None, None, None, align,
                     False, 4)
    gemm2 = GemmArgs(_Sized(4, 384), _Sized(128, 6144, 384), None, None, None, None, align,
                     True, 1)
    cfg = TileConfig(16, 64, 128, 1, 4, 3, 8)
    assert splitk_sizes(gemm1, cfg, 128) == (4 * 12 * 8 * 16 * 64, 4 * 12)
    assert splitk_sizes(gemm2, cfg, 128) == (0, 0)


def test_candidate_grids_hold_the_default_and_only_block_fp8_tiles() -> None:
    defaults = [naming.default_config(TP8, b) for b in (1, 2, 4)]
    for grid in (candidate_configs(defaults), extra_configs(defaults)):
        assert set(defaults) <= set(grid)
        assert len(grid) == len(set(grid))
        assert all(c.block_m == 16 and 128 % c.block_k == 0 for c in grid)
    assert {c.split_k for c in candidate_configs()} == {1, 2, 3, 4, 6, 8, 12}


def test_recorded_picks_are_the_shipped_entries() -> None:
    picks = split_k_picks(_json("call1/small-batch.json"), TOLERANCE)
    assert {b: p["tuned_config"] for b, p in picks.items()} == SHIPPED
    checks = [_json(f"call2/check-tp8-run{i}.json") for i in (1, 2)]
    assert set(confirmed(picks, checks)) == {1, 2, 4}
    assert confirmed(picks, []) == {}  # no confirmation run: nothing ships


def test_a_nan_or_failed_error_never_passes() -> None:
    run = _json("call1/small-batch.json")
    for bad in (math.nan, "FAILED ConfigFailed", 0.5):
        broken = copy.deepcopy(run)
        for detail in broken["batches"]["2"]["details"]:
            detail["rel_err_fresh_seed"] = bad
        assert 2 not in split_k_picks(broken, TOLERANCE)


def test_one_check_that_is_not_a_win_drops_the_entry() -> None:
    picks = split_k_picks(_json("call1/small-batch.json"), TOLERANCE)
    checks = [_json(f"call2/check-tp8-run{i}.json") for i in (1, 2)]
    tie = copy.deepcopy(checks[1])
    for row in tie["per_batch"]:
        if row["batch"] == 4:
            row["verdict"] = "tie"
    assert set(confirmed(picks, [checks[0], tie])) == {1, 2}
    other = copy.deepcopy(checks[0])
    for row in other["per_batch"]:
        if row["batch"] == 1:
            row["tuned_config"] = "M16-N64-K128-G1-w4-s5"  # a check of some other table
    assert set(confirmed(picks, [other, checks[1]])) == {2, 4}


def test_fastest_and_floor_arithmetic_on_the_recorded_sweep() -> None:
    entry = _json("call1/small-batch.json")["batches"]["1"]
    rows = [Timed.from_row(r) for r in entry["sweep"]]
    best_split, best_plain = fastest(rows, split=True), fastest(rows, split=False)
    assert best_split is not None and best_plain is not None
    assert best_split.config.key == SHIPPED[1]
    assert best_plain.config.split_k == 1 and best_plain.us > best_split.us
    assert fastest([], split=True) is None
    floor = entry["floor_us"]
    assert time_at_target(floor) == pytest.approx(floor / FLOOR_TARGET)
    assert floor_fraction(floor, 2 * floor) == pytest.approx(0.5)
    with pytest.raises(ValueError, match="positive"):
        floor_fraction(floor, 0.0)


def test_no_recorded_batch_reached_the_target() -> None:
    """What the runs found: split-K wins, but M <= 4 stays under 70 % of the floor."""
    bench = _json("call3/bench.json")
    small = [r for r in bench["rows"] if r["shape"].startswith("E=128,") and r["batch"] <= 4]
    assert [r["verdict"] for r in small] == ["wins"] * 3
    for row in small:
        assert not reaches_target(row["fp8_floor_us"], row["tuned_us"])
    run = _json("call1/small-batch.json")
    for entry in run["batches"].values():
        assert not any(reaches_target(entry["floor_us"], r["us"]) for r in entry["sweep"])


def test_shipped_table_is_what_the_ship_step_makes(tmp_path: Path) -> None:
    """docs/results/tune-h200/tables (what patch 0005 ships) is reproduced byte for byte by
    scripts/maintain/ship_small_batch.py from the judged tables, call1's run and call2's checks."""
    out = tmp_path / "tables"
    subprocess.run([sys.executable, str(REPO / "scripts/maintain/ship_small_batch.py"),
                    "--tables", "docs/results/tune-h200/judged-tables",
                    "--run", "docs/results/tune-h200/small-batch/call1/small-batch.json",
                    "--check", "docs/results/tune-h200/small-batch/call2/check-tp8-run1.json",
                    "--check", "docs/results/tune-h200/small-batch/call2/check-tp8-run2.json",
                    "--out", str(out)], cwd=REPO, check=True, capture_output=True)
    shipped = REPO / "docs/results/tune-h200/tables"
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in shipped.iterdir())
    for path in out.iterdir():
        assert path.read_bytes() == (shipped / path.name).read_bytes(), path.name


def test_split_entries_ship_only_with_the_split_kernel() -> None:
    """Unsplit, the shipped M=1 tile (3 stages) is slower than vLLM's default (call1's sweep):
    a table with SPLIT_K entries needs patch 0007 after it in the series."""
    table = read_table(REPO / "docs/results/tune-h200/tables"
                       / naming.table_file_name(TP8, "NVIDIA H200"))
    assert {b: c.key for b, c in table.items() if c.split_k > 1} == SHIPPED
    ids = [p.id for p in load_series(REPO / "patches/vllm-0.33.0").patches]
    assert ids.index("tuned-tables-h200") < ids.index("moe-split-k")


def test_a_malformed_run_or_check_is_results_invalid_naming_the_key() -> None:
    run = _json("call1/small-batch.json")
    broken = copy.deepcopy(run)
    broken["batches"]["2"]["details"][0].pop("judge")
    with pytest.raises(ResultsInvalid, match=r"batches\.2\.details\[0\]: 'judge' missing"):
        split_k_picks(broken, TOLERANCE, "run.json")
    picks = split_k_picks(run, TOLERANCE)
    check = _json("call2/check-tp8-run1.json")
    check["per_batch"][0]["batch"] = True
    with pytest.raises(ResultsInvalid, match=r"check run 1: per_batch\[0\]: 'batch'"):
        confirmed(picks, [check])
    with pytest.raises(ResultsInvalid, match="'per_batch' missing"):
        confirmed(picks, [{"rows": []}])
