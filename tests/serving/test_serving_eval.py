"""The accuracy gate for real: lm-eval (its own venv) against `vllm serve` of the tiny model.

The tiny model is trained to add (scripts/setup/make_tiny_model.py), so the shipped floor means
something: a series whose CPU MoE kernel routes tokens to the wrong experts (test data, every
marker kept) passes the marker gate and fails `ci` with exit 20 after the sweep, the real series
passes the same run, and `eval --baseline ... --max-drop` fails the wrong kernel against the
real series' score as well. Each test leaves the venv's tree holding the real series.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from m3patch.serving.processes import group_members, live_processes

REPO = Path(__file__).resolve().parents[2]
BASE_RECIPE = REPO / "recipes" / "cpu_tiny_moe.yaml"
REAL_SERIES = REPO / "patches" / "vllm-0.32.0"
WRONG_SERIES = REPO / "tests" / "data" / "perturbed-moe-0.32.0"  # experts swapped, markers kept
WRONG_ID = "vllm-0.32.0-perturbed-moe"
SHIPPED_FLOOR = float(yaml.safe_load(BASE_RECIPE.read_text())["eval"]["tasks"][0]["min"])
SCORE = re.compile(r"eval tiny_arith: exact_match,strict-match = ([0-9.]+) over 32 samples")
pytestmark = [pytest.mark.serve, pytest.mark.slow]


def gated_recipe(path: Path, venv: Path, model: Path, port: int, *,
                 series: Path = REAL_SERIES) -> Path:
    """The shipped recipe and its floor, on this venv and model, with one short sweep cell."""
    data = yaml.safe_load(BASE_RECIPE.read_text())
    data["target"]["python"] = str(venv / "bin" / "python")
    data["model"]["source"] = str(model)
    data["series"] = str(series)
    data["server"]["port"] = port
    data["sweep"]["rows"] = [{"isl": 32, "osl": 32, "concurrency": [1]}]  # one short cell
    (gate,) = data["eval"]["tasks"]
    gate["task-dir"] = str(REPO / "recipes" / "evals" / "tiny_arith")
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


def held_series(venv: Path) -> str | None:
    """The series id the venv's vLLM tree holds (its ledger), None when it holds none."""
    ledgers = list(venv.glob("lib/python3*/site-packages/vllm/.m3patch/ledger.json"))
    return str(json.loads(ledgers[0].read_text())["series"]) if ledgers else None


def switch_series(venv: Path, series: Path) -> None:
    """Revert whichever series the tree holds, then apply `series`: the user's two commands."""
    python = str(venv / "bin" / "python")
    held, wanted = held_series(venv), str(yaml.safe_load((series / "series.yaml").read_text())["id"])
    if held is not None and held != wanted:
        old = WRONG_SERIES if held == WRONG_ID else REAL_SERIES
        done = m3patch("revert", "--python", python, "--series", str(old), timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
    done = m3patch("apply", "--python", python, "--series", str(series), "--verify", timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.fixture(scope="module")
def real_scores() -> dict[str, Path]:
    """The real series' eval.json once a test has scored it: the next uses it as its baseline
    rather than starting a server of its own for it (CI time)."""
    return {}


@pytest.fixture
def real_series_after(cpu_venv: Path) -> Iterator[None]:
    """Whatever a test switched to, the venv's tree holds the real series again afterwards."""
    yield
    switch_series(cpu_venv, REAL_SERIES)


def test_a_wrong_moe_kernel_passes_the_markers_and_fails_the_gate_the_real_series_passes(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path, real_series_after: None,
        real_scores: dict[str, Path]) -> None:
    # The series a user could ship by mistake: the CPU MoE kernel routes tokens to the wrong
    # experts while every marker (backend, architecture, provenance) still prints.
    switch_series(cpu_venv, WRONG_SERIES)
    wrong = gated_recipe(tmp_path / "wrong.yaml", cpu_venv, tiny_model, free_port(),
                         series=WRONG_SERIES)
    run = tmp_path / "wrong-run"
    done = m3patch("ci", str(wrong), "--run-dir", str(run), timeout=900)
    assert done.returncode == 20, done.stderr[-3000:]
    steps = {s["name"]: s for s in json.loads((run / "ci.json").read_text())["steps"]}
    assert steps["serve-sweep"]["status"] == "ok", steps
    assert "markers passed" in steps["serve-sweep"]["message"]
    assert steps["results"]["status"] == "ok" and steps["eval"]["status"] == "failed", steps
    (found,) = SCORE.findall(done.stderr)
    assert float(found) < SHIPPED_FLOOR
    assert (f"accuracy gate failed: tiny_arith exact_match,strict-match = {found}, "
            f"below min {SHIPPED_FLOOR:g}") in done.stderr
    # The sweep ran first and its results stay: cells, aggregate, plots; the failing score sits
    # beside the throughput rows, in the table and in aggregate.json.
    assert len(list((run / "cells").glob("*.json"))) == 1 and (run / "aggregate.json").is_file()
    (row,) = json.loads((run / "aggregate.json").read_text())["evals"]
    assert (row["task"], row["score"], row["min"], row["passed"]) == (
        "tiny_arith", float(found), SHIPPED_FLOOR, False)
    # (ci tees every step's output to stderr: its stdout stays for what a workflow parses)
    assert f"tiny_arith {float(found):.4f} (min {SHIPPED_FLOOR:g}) FAILED" in done.stderr
    record = json.loads((run / "eval" / "eval.json").read_text())
    assert record["passed"] is False and record["tasks"][0]["samples"] == 32
    assert record["provenance"]["verified"] is True and record["provenance"]["ledger_sha256"]
    summary = json.loads((run / "serve.json").read_text())
    assert group_members(summary["pgid"]) == [], "the server outlived the failed gate"
    assert naming(run) == [], "the harness outlived the failed gate"

    # Revert it and re-apply the real series: the same run passes on the same floor.
    switch_series(cpu_venv, REAL_SERIES)
    real = gated_recipe(tmp_path / "real.yaml", cpu_venv, tiny_model, free_port())
    done = m3patch("ci", str(real), "--run-dir", str(tmp_path / "real-run"), timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    (found,) = SCORE.findall(done.stderr)
    assert float(found) >= max(SHIPPED_FLOOR, 0.9) and SHIPPED_FLOOR > 0  # the shipped seed adds
    table = done.stderr.split("per-GPU results", 1)[1]
    assert "Accuracy" in table and f"tiny_arith {float(found):.4f} (min {SHIPPED_FLOOR:g}) ok" in table
    (row,) = json.loads((tmp_path / "real-run" / "aggregate.json").read_text())["evals"]
    assert (row["score"], row["score_name"], row["n_eff"], row["passed"]) == (
        float(found), "em_strict", 32, True)
    real_scores["eval.json"] = tmp_path / "real-run" / "eval" / "eval.json"


class HeldServer:
    """`m3patch serve RECIPE --hold`: the user's server for `m3patch eval` to ask."""

    def __init__(self, recipe: Path, run_dir: Path) -> None:
        self.err = run_dir.with_suffix(".err")
        with self.err.open("w") as err_fh:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "m3patch", "serve", str(recipe), "--run-dir", str(run_dir),
                 "--hold", "600", "--quiet"],
                cwd=REPO, stdout=subprocess.DEVNULL, stderr=err_fh, text=True)

    def __enter__(self) -> HeldServer:
        deadline = time.monotonic() + 400
        while "ready in" not in self.err.read_text() and self.proc.poll() is None:
            assert time.monotonic() < deadline, self.err.read_text()
            time.sleep(0.5)
        assert self.proc.poll() is None, self.err.read_text()
        return self

    def __exit__(self, *exc: object) -> None:
        self.proc.send_signal(signal.SIGINT)
        self.proc.wait(timeout=120)


def real_baseline(venv: Path, model: Path, tmp_path: Path) -> Path:
    """`m3patch eval` of a held server on the real series: a met floor, recorded in full."""
    switch_series(venv, REAL_SERIES)
    real = gated_recipe(tmp_path / "real.yaml", venv, model, free_port())
    base = tmp_path / "base"
    with HeldServer(real, tmp_path / "serve-real"):
        started = time.monotonic()
        done = m3patch("eval", str(real), "--run-dir", str(base), timeout=600)
        seconds = time.monotonic() - started
    assert done.returncode == 0, done.stderr[-3000:]
    record = json.loads((base / "eval" / "eval.json").read_text())
    (score,) = record["tasks"]
    assert score["score"] >= SHIPPED_FLOOR and (score["samples"], score["passed"]) == (32, True)
    assert record["provenance"]["series"] and record["seconds"] < seconds
    (harness,) = record["harness"]
    assert (base / harness["results"]).is_file() and (base / harness["log"]).is_file()
    return base / "eval" / "eval.json"


@pytest.mark.extended  # CI time: one more server (about 3 minutes on 2 shared cores); the ci test above is CI's proof
def test_eval_baseline_max_drop_fails_the_wrong_kernel_against_the_real_series_score(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path, real_series_after: None,
        real_scores: dict[str, Path]) -> None:
    baseline = real_scores.get("eval.json") or real_baseline(cpu_venv, tiny_model, tmp_path)
    (score,) = json.loads(baseline.read_text())["tasks"]
    switch_series(cpu_venv, WRONG_SERIES)
    wrong = gated_recipe(tmp_path / "wrong.yaml", cpu_venv, tiny_model, free_port(),
                         series=WRONG_SERIES)
    with HeldServer(wrong, tmp_path / "serve-wrong"):
        done = m3patch("eval", str(wrong), "--run-dir", str(tmp_path / "cand"),
                       "--baseline", str(baseline), "--max-drop", "0.05", timeout=600)
    assert done.returncode == 20, done.stderr[-3000:]
    (judged,) = json.loads((tmp_path / "cand" / "eval" / "eval.json").read_text())["tasks"]
    assert (judged["baseline"], judged["max_drop"], judged["passed"]) == (score["score"], 0.05, False)
    drop = score["score"] - judged["score"]
    assert drop > 0.05 and (f"tiny_arith exact_match,strict-match = {judged['score']:.4f}, "
                            f"{drop:.4f} under the baseline {score['score']:.4f} (max-drop 0.05)"
                            ) in done.stderr
