"""LMCache's per-rank servers: InferenceX's command lines and DRAM split, the version pin, the
health deadline and the teardown; the trace checks `model check` shares.

The real `lmcache server` cannot run on this CPU-only machine: the PyPI 0.5.3 wheel's c_ops
extension links libcudart.so.13 and libtorch_cuda.so, and it requires cupy-cuda13x. The servers
here are stand-ins (a small HTTP server answering /healthcheck, one that never answers, one that
exits), for the orchestration faults a real server would show the same way.
"""

from __future__ import annotations

import socket
import sys
import textwrap
from pathlib import Path

import pytest

from m3patch.bench.agentic.lmcache import ShardPlan, check_lmcache, plan_shards, servers, shard_gb
from m3patch.bench.agentic.preflight import require_trace, trace_missing
from m3patch.errors import KvOffloadError, ModelMissing
from m3patch.recipe.agentic import TraceSource
from m3patch.serving.processes import live_processes

STAND_IN = textwrap.dedent("""\
    import http.server, sys, time
    mode, port = sys.argv[1], int(sys.argv[2])
    if mode == "exit":
        sys.exit(3)
    if mode == "silent":
        time.sleep(600)
    class H(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/healthcheck" else 404)
            self.end_headers()
        def log_message(self, *args):
            pass
    http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
""")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def shard(tmp_path: Path, rank: int, mode: str) -> ShardPlan:
    script = tmp_path / "stand_in_lmcache.py"
    script.write_text(STAND_IN)
    port = free_port()
    return ShardPlan(rank, (sys.executable, str(script), mode, str(port)), port - 1, port)


def running(marker: str) -> list[int]:
    pids = []
    for proc in live_processes():
        try:
            if marker.encode() in Path(f"/proc/{proc.pid}/cmdline").read_bytes():
                pids.append(proc.pid)
        except OSError:
            continue
    return pids


def test_the_plan_is_inferencex_per_rank_command() -> None:
    plans = plan_shards("/venv/bin/lmcache", 1947, 8)
    assert [p.port for p in plans] == list(range(5555, 5563))
    assert [p.health_url for p in plans][-1] == "http://127.0.0.1:8087/healthcheck"
    argv = plans[0].argv
    assert argv[:2] == ("/venv/bin/lmcache", "server")
    assert argv[argv.index("--l1-size-gb") + 1] == "243"  # 1947 GB // TP8
    assert argv[argv.index("--supported-transfer-mode") + 1] == "lmcache_driven"
    assert argv[argv.index("--eviction-policy") + 1] == "LRU"
    (cpu,) = plan_shards("/venv/bin/lmcache", 2, 1, "engine_driven")
    assert cpu.argv[cpu.argv.index("--supported-transfer-mode") + 1] == "engine_driven"
    with pytest.raises(KvOffloadError, match="under 1 GB per rank"):
        shard_gb(7, 8)


def test_healthy_servers_are_yielded_then_stopped(tmp_path: Path) -> None:
    plans = [shard(tmp_path, 0, "serve"), shard(tmp_path, 1, "serve")]
    with servers(plans, tmp_path / "logs", deadline_s=30) as logs:
        assert [p.name for p in logs] == ["lmcache_server_0.log", "lmcache_server_1.log"]
        assert len(running("stand_in_lmcache.py")) >= 2
    assert running(str(tmp_path / "stand_in_lmcache.py")) == []


@pytest.mark.parametrize(("mode", "expected"), [
    ("exit", "LMCache server 1 exited with status 3"),
    ("silent", "did not answer within 3 s"),
])
def test_a_shard_that_fails_its_health_check_stops_the_whole_set(
        tmp_path: Path, mode: str, expected: str) -> None:
    plans = [shard(tmp_path, 0, "serve"), shard(tmp_path, 1, mode)]
    with pytest.raises(KvOffloadError) as info, servers(plans, tmp_path / "logs", deadline_s=3):
        pytest.fail("a failed shard must not yield")
    assert expected in info.value.message and "lmcache_server_1.log" in info.value.message
    assert running(str(tmp_path / "stand_in_lmcache.py")) == []


def test_the_installed_version_must_be_the_pin(tmp_path: Path) -> None:
    with pytest.raises(KvOffloadError, match=r"no LMCache installed; the recipe pins LMCache 0\.5\.3"):
        check_lmcache(sys.executable, "0.5.3")
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 0.5.2\n")
    fake.chmod(0o755)
    with pytest.raises(KvOffloadError, match=r"LMCache 0\.5\.2 installed; the recipe pins"):
        check_lmcache(str(fake), "0.5.3")
    fake.write_text("#!/bin/sh\necho 0.5.3\n")
    check_lmcache(str(fake), "0.5.3")


def test_the_trace_dataset_must_be_in_the_hub_cache(tmp_path: Path) -> None:
    trace = TraceSource("public-dataset", loader="semianalysis_cc_traces_weka_062126",
                        dataset="semianalysisai/cc-traces-weka-062126")
    env = {"HF_HUB_CACHE": str(tmp_path)}
    assert "is not in" in str(trace_missing(trace, env))
    snapshot = tmp_path / "datasets--semianalysisai--cc-traces-weka-062126" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "traces.parquet").write_bytes(b"x")
    assert trace_missing(trace, env) is None
    missing_file = TraceSource("file", path=tmp_path / "absent.jsonl", loader="mooncake_trace")
    with pytest.raises(ModelMissing, match=r"absent\.jsonl does not exist"):
        require_trace(missing_file, tmp_path / "r.yaml")


@pytest.mark.parametrize("kind", ["file", "agentic-code"])
def test_a_trace_name_longer_than_the_file_system_allows_is_named_as_missing(
        tmp_path: Path, kind: str) -> None:
    """Before: a recipe's trace file or agentic-code manifest named over NAME_MAX (255 bytes)
    ended `model check` in 70 (ENAMETOOLONG from is_file) after it had printed the model files
    as present; now it is a trace that is not there (19), named."""
    long = tmp_path / ("x" * 300)
    trace = (TraceSource("file", path=long, loader="mooncake_trace") if kind == "file"
             else TraceSource("agentic-code", manifest=long))
    with pytest.raises(ModelMissing) as info:
        require_trace(trace, tmp_path / "r.yaml")
    assert ("x" * 300) in info.value.message
