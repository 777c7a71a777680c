"""A real P/D set on CPU: prefill and decode instances linked by vLLM's ExampleConnector, behind
m3patch's proxy, gated on the decode side. The answer through prefill -> decode (decode loads
the KV the prefill computed) equals the decode instance computing the same prompt alone. ~3 min here;
~2.7 GiB per instance. Run under `flock /tmp/m3patch-serve.lock`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import yaml

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.local_launcher import TEARDOWN_S
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_pd.yaml"
READY_WAIT_S = 420
PROMPT = " ".join(["the quick brown fox jumps over the lazy dog"] * 10)  # > 2 KV blocks of 32


def variant(tmp_path: Path, kv_dir: Path) -> Path:
    data = yaml.safe_load(RECIPE.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    for role in ("prefill", "decode"):
        kv = data["topology"]["roles"][role]["vllm-args"]["kv-transfer-config"]
        kv["kv_connector_extra_config"]["shared_storage_path"] = str(kv_dir)
    data["topology"]["roles"]["decode"]["markers"]["required"][0]["text"] = \
        f"Shared storage path is {kv_dir}"
    path = tmp_path / "cpu_tiny_moe_pd.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def complete(port: int) -> dict[str, object]:
    body = {"model": "tiny-moe", "prompt": PROMPT, "max_tokens": 16, "temperature": 0,
            "logprobs": 1}
    request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        return json.loads(reply.read())  # type: ignore[no-any-return]


def test_prefill_decode_through_the_proxy_equals_one_instance(
        cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> None:
    kv_dir = tmp_path / "kv"
    recipe = variant(tmp_path, kv_dir)
    run_dir, err = tmp_path / "run", tmp_path / "stderr.txt"
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model)}
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(recipe), "--run-dir",
                                 str(run_dir), "--hold", "900"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=fh, text=True)
    pgids: list[int] = []
    try:
        deadline = time.monotonic() + READY_WAIT_S
        while "set ready" not in err.read_text() and proc.poll() is None:
            assert time.monotonic() < deadline, err.read_text()
            time.sleep(1.0)
        assert proc.poll() is None, f"set exited early ({proc.returncode}):\n{err.read_text()}"
        records = rv.read_records(run_dir)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        assert {r.state for r in records.values()} == {"ready"}
        decode_log = run_dir / "logs" / "decode-0.log"
        alone = complete(8787)  # decode computes the prompt itself: nothing stored for it yet
        # ExampleConnector stores every new prompt, whatever the role: drop what decode stored,
        # so the prefill instance must compute the KV it hands over
        for item in kv_dir.iterdir() if kv_dir.exists() else ():
            shutil.rmtree(item)
        injected = decode_log.read_text().count("Inject KV cache of")
        split = complete(8785)  # proxy: prefill computes and stores the KV, decode loads it
        assert any(kv_dir.rglob("*.safetensors")), "prefill stored no KV"
        assert decode_log.read_text().count("Inject KV cache of") > injected, \
            "decode computed the prompt itself instead of loading the prefill's KV"
        a, b = alone["choices"][0], split["choices"][0]  # type: ignore[index]
        assert a["text"] == b["text"]
        deltas = [abs(x - y) for x, y in zip(a["logprobs"]["token_logprobs"],
                                             b["logprobs"]["token_logprobs"], strict=True)]
        assert max(deltas) < 1e-3, deltas
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=TEARDOWN_S + 30)
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the set"
