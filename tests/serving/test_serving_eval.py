"""The accuracy gate for real: lm-eval (its own venv) against `vllm serve` of the tiny model.

The random-weight model answers none of the shipped task's 32 sums, so both sides are honest:
a floor of 0 passes and records the score; a floor of 0.5 fails the gated run with exit 20
after the sweep's results were written, and nothing is left running.
"""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from m3patch.serving.processes import group_members, live_processes

REPO = Path(__file__).resolve().parents[2]
BASE_RECIPE = REPO / "recipes" / "cpu_tiny_moe.yaml"
pytestmark = [pytest.mark.serve, pytest.mark.slow]


def gated_recipe(path: Path, venv: Path, model: Path, port: int, floor: float) -> Path:
    data = yaml.safe_load(BASE_RECIPE.read_text())
    data["target"]["python"] = str(venv / "bin" / "python")
    data["model"]["source"] = str(model)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["server"]["port"] = port
    data["sweep"]["rows"] = [{"isl": 32, "osl": 32, "concurrency": [1]}]  # one short cell
    (gate,) = data["eval"]["tasks"]
    gate["task-dir"] = str(REPO / "recipes" / "evals" / "tiny_arith")
    gate["min"] = floor
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def naming(folder: Path) -> list[int]:
    """Live processes whose command line names `folder` (the harness writes under it)."""
    pids = []
    for proc in live_processes():
        try:
            if str(folder).encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                pids.append(proc.pid)
        except OSError:
            continue
    return pids


def m3patch(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, check=False)


def test_a_missed_floor_exits_20_after_the_sweep_and_leaves_nothing(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    recipe = gated_recipe(tmp_path / "r.yaml", cpu_venv, tiny_model, free_port(), 0.5)
    run = tmp_path / "run"
    done = m3patch("serve", str(recipe), "--bench", "--quiet", "--run-dir", str(run), timeout=900)
    assert done.returncode == 20, done.stderr[-3000:]
    assert "accuracy gate failed: tiny_arith exact_match,strict-match = 0.0000, below min 0.5" \
        in done.stderr
    # The sweep ran first and its results stay: cells, aggregate, plots.
    assert len(list((run / "cells").glob("*.json"))) == 1 and (run / "aggregate.json").is_file()
    record = json.loads((run / "eval" / "eval.json").read_text())
    assert record["passed"] is False and record["tasks"][0]["samples"] == 32
    assert record["tasks"][0]["failures"] and record["provenance"]["verified"] is True
    assert record["provenance"]["ledger_sha256"]
    summary = json.loads((run / "serve.json").read_text())
    assert group_members(summary["pgid"]) == [], "the server outlived the failed gate"
    assert naming(run) == [], "the harness outlived the failed gate"


@pytest.mark.extended  # the demo (CI) runs the same met floor through serve --bench and checks eval.json
def test_eval_command_passes_a_met_floor_and_records_the_score(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    recipe = gated_recipe(tmp_path / "r.yaml", cpu_venv, tiny_model, free_port(), 0.0)
    err = tmp_path / "serve.err"
    with err.open("w") as err_fh:
        server = subprocess.Popen(
            [sys.executable, "-m", "m3patch", "serve", str(recipe), "--run-dir",
             str(tmp_path / "serve"), "--hold", "600", "--quiet"],
            cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_fh, text=True)
    try:
        deadline = time.monotonic() + 400
        while "ready in" not in err.read_text() and server.poll() is None:
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(0.5)
        assert server.poll() is None, err.read_text()
        run = tmp_path / "eval-run"
        started = time.monotonic()
        done = m3patch("eval", str(recipe), "--run-dir", str(run), timeout=600)
        seconds = time.monotonic() - started
        assert done.returncode == 0, done.stderr[-3000:]
        assert "eval tiny_arith: exact_match,strict-match = 0.0000 over 32 samples (ok" in done.stderr
        record = json.loads((run / "eval" / "eval.json").read_text())
        (score,) = record["tasks"]
        assert (score["score"], score["samples"], score["passed"]) == (0.0, 32, True)
        assert record["provenance"]["series"] and record["seconds"] < seconds
        (harness,) = record["harness"]
        assert (run / harness["results"]).is_file() and (run / harness["log"]).is_file()
    finally:
        server.send_signal(signal.SIGINT)
        server.wait(timeout=120)
