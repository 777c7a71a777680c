"""m3patch's aggregate rows carry InferenceX's field names, with InferenceX's values and units.

The InferenceX row (tests/data/bench/inferencex/README.md) follows the format written by
SemiAnalysisAI/InferenceX utils/process_result.py; it and the m3patch row are made from the same
real recorded `vllm bench serve` result, so every shared field must agree.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from m3patch.bench.aggregate import cell_row, load_aggregate
from m3patch.bench.cells import Cell, Parallelism, SeqLen
from m3patch.bench.results import cell_document, check_vllm_result, read_json_object
from m3patch.errors import ResultsInvalid
from m3patch.main import main

DATA = Path(__file__).parents[1] / "data" / "bench"
INFERENCEX_ROW = DATA / "inferencex" / "agg_isl32-osl16-c4.json"
VLLM_RESULT = DATA / "vllm" / "isl32-osl16-c4.json"
PROVENANCE = {"recipe_name": "cpu_tiny_moe", "image": None, "series": "vllm-0.32.0"}
# InferenceX keys m3patch writes differently, each for a stated reason (docs/inferencex-fields.md).
NOT_SHARED = {
    "hw", "precision", "spec_decoding",  # null unless the provenance states them: never guessed
    "infmax_model_prefix",  # InferenceX's model family label; m3patch names the recipe instead
    "dp_attention",  # InferenceX copies the env string "true"/"false"; m3patch writes a bool
    "image",  # InferenceX writes the env's string; m3patch the recipe's image, null on CPU
}


def _m3patch_row() -> dict[str, object]:
    data = read_json_object(VLLM_RESULT)
    check_vllm_result(data, VLLM_RESULT)
    cell = Cell(SeqLen(32, 16), Parallelism(), 4, 0.0)
    return cell_row(cell_document(data, cell, PROVENANCE, 1.0))


def test_every_inferencex_field_has_the_same_name_and_value() -> None:
    ifx = json.loads(INFERENCEX_ROW.read_text())
    row = _m3patch_row()
    # p50_* and std_intvty come from the recording's "50" percentile and InferenceX's blanket
    # tpot->intvty rename; m3patch keeps the median (the same number) and no 1000/std.
    dropped = {k for k in ifx if k.startswith("p50_")} | {"std_intvty"}
    shared = set(ifx) - NOT_SHARED - dropped
    assert shared - set(row) == set()
    for key in sorted(shared):
        if isinstance(ifx[key], float):
            assert row[key] == pytest.approx(ifx[key], rel=1e-6), key
        else:
            assert row[key] == ifx[key], key
    for key in (k for k in dropped if k.startswith("p50_") and k != "p50_intvty"):
        assert row[key.replace("p50_", "median_")] == pytest.approx(ifx[key], rel=1e-9)
    assert row["dp_attention"] is (ifx["dp_attention"] == "true")


def test_unknown_inferencex_fields_are_null_and_unrecorded_statistics_too() -> None:
    row = _m3patch_row()
    assert row["hw"] is None and row["precision"] is None and row["spec_decoding"] is None
    assert row["framework"] == "vllm" and row["conc"] == row["concurrency"] == 4
    # Recorded with percentiles 50,90,99: p99.9 was never measured, so it is null, not guessed.
    assert all(row[f"p99.9_{m}"] is None for m in ("ttft", "tpot", "itl", "e2el"))
    assert row["p99.9_intvty"] is None
    assert row["mean_tpot"] is not None and row["std_ttft"] is not None


def test_a_cell_with_p99_9_carries_it_in_seconds_and_as_interactivity() -> None:
    data = read_json_object(VLLM_RESULT)
    data.update({"p99.9_ttft_ms": 50.0, "p99.9_tpot_ms": 12.5, "p99.9_itl_ms": 20.0,
                 "p99.9_e2el_ms": 250.0})
    row = cell_row(cell_document(data, Cell(SeqLen(32, 16), Parallelism(), 4, 0.0), PROVENANCE, 1.0))
    assert row["p99.9_ttft"] == 0.05 and row["p99.9_tpot"] == 0.0125
    assert row["p99.9_intvty"] == 80.0


def test_an_optional_statistic_present_but_malformed_names_its_key() -> None:
    data = read_json_object(VLLM_RESULT)
    data["p99.9_tpot_ms"] = "12.5"
    with pytest.raises(ResultsInvalid, match=r"key 'p99.9_tpot_ms': expected a number"):
        check_vllm_result(data, VLLM_RESULT)


def test_an_aggregate_written_before_these_fields_still_loads() -> None:
    rows = load_aggregate(DATA / "aggregate-before-inferencex-fields.json")["rows"]
    assert "conc" not in rows[0] and "mean_tpot" not in rows[0]
    assert [row["concurrency"] for row in rows] == [1, 2, 4]


def test_compare_takes_an_inferencex_row_as_either_side(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    row = json.loads(INFERENCEX_ROW.read_text())
    faster = {**row, "tput_per_gpu": row["tput_per_gpu"] * 1.1, "p99_ttft": row["p99_ttft"] / 2}
    rows_file = tmp_path / "rows.json"
    rows_file.write_text(json.dumps([faster, {**faster, "conc": 8}]))
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(INFERENCEX_ROW), str(rows_file), "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    [cell] = result["compared"]
    assert cell["concurrency"] == 4 and cell["change_pct"] == pytest.approx(10.0)
    assert [u["reason"] for u in result["not_compared"]] == ["new only"]
    assert main(["bench", "compare", str(rows_file), str(INFERENCEX_ROW), "--metric", "p99_ttft",
                 "--json", str(out)]) == 0
    assert json.loads(out.read_text())["compared"][0]["change_pct"] == pytest.approx(100.0)
    assert "InferenceX cpu vllm fp32" in capsys.readouterr().out


def test_an_inferencex_row_beside_an_m3patch_run_is_another_workload(tmp_path: Path) -> None:
    # InferenceX's rows are its client's [int(0.8 L), L]; this m3patch run used vLLM's
    # convention, so it is never given a change figure, even at the same ISL/OSL, parallelism
    # and concurrency. Nothing compared: the command fails (17), and still writes the listing.
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(DATA / "runs" / "base"), str(INFERENCEX_ROW),
                 "--json", str(out)]) == ResultsInvalid.exit_code
    result = json.loads(out.read_text())
    assert result["compared"] == []
    differs = [u for u in result["not_compared"] if u["reason"] == "shape differs"]
    assert len(differs) == 1 and "InferenceX lengths" in differs[0]["detail"]


def test_an_inferencex_workload_cell_is_compared_with_an_inferencex_row(tmp_path: Path) -> None:
    # The same run, its cells re-labelled as measured with InferenceX's lengths (r = 0.8):
    # now the InferenceX row is the same workload and gets a change figure.
    run = shutil.copytree(DATA / "runs" / "base", tmp_path / "run")
    data = json.loads((run / "aggregate.json").read_text())
    for row in data["rows"]:
        row.update(length_convention="inferencex", range_ratio=0.8)
    (run / "aggregate.json").write_text(json.dumps(data))
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(run), str(INFERENCEX_ROW), "--json", str(out)]) == 0
    assert len(json.loads(out.read_text())["compared"]) == 1


@pytest.mark.parametrize(("change", "needle"), [
    ({"is_multinode": True}, "key 'is_multinode': a multi-node or disaggregated row"),
    ({"dp_attention": "maybe"}, "key 'dp_attention': expected true or false, got 'maybe'"),
    ({"conc": 0}, "key 'conc': expected a positive integer, got 0"),
    ({"isl": "1k"}, "key 'isl': expected a positive integer, got '1k'"),
])
def test_a_malformed_inferencex_row_exits_17_naming_the_key(
    change: dict[str, object], needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "agg_bad.json"
    bad.write_text(json.dumps({**json.loads(INFERENCEX_ROW.read_text()), **change}))
    assert main(["bench", "compare", str(INFERENCEX_ROW), str(bad)]) == 17
    assert needle in capsys.readouterr().err
