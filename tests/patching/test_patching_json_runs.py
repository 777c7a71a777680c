"""`--json` on the run reports (serve, bench, ci): the same versioned envelope as apply/status
(schema m3patch.report/1, tool version, tree, series, mode, ledger digest, exit code) plus the
recipe, the run folder and the steps; on an error the object carries the code and message too.
ci.json keeps its own fields and gains the envelope's. Real tree; the server step fails for want
of vLLM in this interpreter (a real failure of the real serve step), as in tests/run."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_helpers import gate_recorded_run

from m3patch import errors
from m3patch.commands import ci
from m3patch.patching.ledger import digest, ledger_path
from m3patch.patching.report_json import SCHEMA

REPO = Path(__file__).resolve().parents[2]
RECORDED = REPO / "tests" / "data" / "bench" / "runs"
ENVELOPE = {"schema", "command", "tool_version", "exit_code", "ok", "tree_root", "vllm_version",
            "series_id", "mode", "ledger_sha256"}


def recipe_on_this_python(tmp_path: Path) -> Path:
    """cpu_tiny_moe on the test series, this interpreter (no vllm: the server cannot start) and
    a model folder the pre-apply check accepts."""
    (tmp_path / "no-model").mkdir()
    (tmp_path / "no-model" / "config.json").write_text("{}")
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = text.replace('vllm-version: "0.32.0"', 'vllm-version: "0.33.0"')
    text = text.replace("series: vllm-0.32.0", f"series: {REPO}/tests/data/test-series")
    text = text.replace("${M3PATCH_TINY_MODEL:-~/.cache/m3patch/tiny-moe}", str(tmp_path / "no-model"))
    text = text.replace("${M3PATCH_CPU_VENV:-~/.cache/m3patch/vllm-cpu-venv}/bin/python", sys.executable)
    text = text.replace("range-ratio: 1.0", "range-ratio: 0.8")
    text = text.replace("task-dir: evals/", f"task-dir: {REPO}/recipes/evals/")
    path = tmp_path / "recipe.yaml"
    path.write_text(text)
    return path


def recorded_recipe(tmp_path: Path) -> Path:
    """The recipe of the recorded real run (tests/data/bench/runs/base): --resume keeps it all."""
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)
    text = text.replace("task-dir: evals/", f"task-dir: {REPO}/recipes/evals/")
    path = tmp_path / "cpu_tiny_moe.yaml"
    path.write_text(text.replace("series: vllm-", f"series: {REPO}/patches/vllm-"))
    return path


def m3patch(*args: str, env: dict[str, str] | None = None) -> tuple[int, dict[str, Any], str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("M3PATCH_")}
    proc = subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True,
                          text=True, env={**base, **(env or {})}, cwd=REPO, check=False,
                          timeout=300)
    report = json.loads(proc.stdout)  # stdout is the one object, nothing else
    assert report.keys() >= ENVELOPE and report["schema"] == SCHEMA, report
    assert report["exit_code"] == proc.returncode and report["ok"] == (proc.returncode == 0)
    return proc.returncode, report, proc.stderr


def test_ci_json_on_a_failing_server_names_the_tree_ledger_and_error(
        tmp_path: Path, vllm_tree: Path) -> None:
    run_dir = tmp_path / "run"
    code, report, stderr = m3patch("ci", str(recipe_on_this_python(tmp_path)), "--run-dir",
                                   str(run_dir), "--json", env={"M3PATCH_VLLM_ROOT": str(vllm_tree)})
    assert code == errors.ServerExited.exit_code, stderr
    ledger = digest(ledger_path(vllm_tree).read_bytes())
    assert report["command"] == "ci" and report["tree_root"] == str(vllm_tree)
    assert (report["series_id"], report["vllm_version"], report["mode"]) == (
        "test-series-0.33.0", "0.33.0", "strict")
    assert report["ledger_sha256"] == ledger
    assert report["error"]["type"] == "ServerExited" and report["error"]["message"]
    assert [(s["name"], s["status"]) for s in report["steps"]] == [
        ("recipe", "ok"), ("apply-verify", "ok"), ("serve-sweep", "failed"), ("results", "skipped"),
        ("eval", "skipped")]
    summary = json.loads((run_dir / ci.SUMMARY).read_text())
    assert summary["schema"] == 1 and summary["exit_code"] == code  # ci.json's own fields stay
    assert summary["steps"] == report["steps"] and summary["run_dir"] == str(run_dir)
    assert summary["report_schema"] == SCHEMA and summary["ledger_sha256"] == ledger
    assert summary["tree_root"] == str(vllm_tree) and summary["ok"] is False


def test_ci_json_for_a_bad_recipe_and_a_resumed_run(tmp_path: Path) -> None:
    code, report, _ = m3patch("ci", str(tmp_path / "missing.yaml"), "--json")
    assert code == errors.UsageError.exit_code
    assert report["error"]["type"] == "UsageError" and "missing.yaml" in report["error"]["message"]
    assert report["steps"][0]["status"] == "failed" and report["run_dir"] is None
    run = shutil.copytree(RECORDED / "base", tmp_path / "run")
    recipe = recorded_recipe(tmp_path)
    gate_recorded_run(run, recipe, eval_passed=True)
    code, report, stderr = m3patch("ci", str(recipe), "--resume", "--run-dir", str(run), "--json")
    assert code == 0, stderr
    assert "error" not in report and report["run_dir"] == str(run)
    assert report["tree_root"] is None and report["ledger_sha256"] is None  # no tree prepared
    assert [s["status"] for s in report["steps"]] == ["ok", "skipped", "ok", "ok", "skipped"]


def test_bench_json_on_stdout_or_into_a_file_and_compare_json(tmp_path: Path) -> None:
    run = shutil.copytree(RECORDED / "base", tmp_path / "run")
    recipe = str(recorded_recipe(tmp_path))
    code, report, stderr = m3patch("bench", recipe, "--resume", "--run-dir", str(run),
                                   "--no-plots", "--json")
    assert code == 0, stderr
    assert report["command"] == "bench" and report["run_dir"] == str(run)
    assert [s["name"] for s in report["steps"]] == ["recipe", "apply-verify", "serve", "sweep",
                                                    "results"]
    out = tmp_path / "bench.json"
    done = subprocess.run([sys.executable, "-m", "m3patch", "bench", recipe, "--resume",
                           "--run-dir", str(run), "--no-plots", "--json", str(out)],
                          capture_output=True, text=True, cwd=REPO, check=False, timeout=300)
    assert done.returncode == 0, done.stderr
    written = json.loads(out.read_text())
    assert written["schema"] == SCHEMA and written["exit_code"] == 0
    assert [s["status"] for s in written["steps"]] == [s["status"] for s in report["steps"]]
    code, report, _ = m3patch("bench", "compare", str(RECORDED / "base"), str(run), "--json")
    assert code == 0 and report["compare"]["metric"] == "tput_per_gpu"
    assert report["compare"]["compared"]
    code, report, _ = m3patch("bench", "compare", str(RECORDED / "base"),
                              str(tmp_path / "none"), "--json")
    assert code == errors.ResultsInvalid.exit_code and report["error"]["type"] == "ResultsInvalid"


def test_serve_json_on_a_failing_server_names_the_tree_and_error(
        tmp_path: Path, vllm_tree: Path) -> None:
    code, report, stderr = m3patch("serve", str(recipe_on_this_python(tmp_path)),
                                   "--stop-after-ready", "--run-dir", str(tmp_path / "serve"),
                                   "--json", env={"M3PATCH_VLLM_ROOT": str(vllm_tree)})
    assert code == errors.ServerExited.exit_code, stderr
    assert report["command"] == "serve" and report["tree_root"] == str(vllm_tree)
    assert report["ledger_sha256"] == digest(ledger_path(vllm_tree).read_bytes())
    assert report["error"]["type"] == "ServerExited"
    assert report["run_dir"] == str(tmp_path / "serve")


@pytest.mark.serve
def test_serve_json_after_a_real_ready_server_names_the_verified_ledger(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """A real vllm-cpu server, ready and gated, then stopped: the object on stdout carries the
    tree it patched and the ledger digest the provenance marker was checked against."""
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["target"]["python"] = str(cpu_venv / "bin" / "python")
    data["model"]["source"] = str(tiny_model)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        data["server"]["port"] = int(sock.getsockname()[1])
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    code, report, stderr = m3patch("serve", str(recipe), "--run-dir", str(tmp_path / "run"),
                                   "--quiet", "--stop-after-ready", "--json")
    assert code == 0, stderr[-3000:]
    assert report["command"] == "serve" and report["series_id"] == "vllm-0.32.0"
    assert report["ledger_sha256"] == digest(ledger_path(Path(report["tree_root"])).read_bytes())
    assert report["ready"].startswith("ready in") and report["base_url"].startswith("http://")
    assert f"ledger=sha256:{report['ledger_sha256']}" in (tmp_path / "run" / "server.log").read_text()
