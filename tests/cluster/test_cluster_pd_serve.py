"""A real P/D set on CPU: prefill and decode instances linked by vLLM's ExampleConnector, behind
vLLM's own router (vllm-router --vllm-pd-disaggregation), gated on the decode side.

Across three network namespaces (prefill, decode and router each on its own host and address; CI
runs it, ~98 s here): the set is gated on KV arriving at the decode node (`kv-arrived`), then each
prompt sent from the machine through the router's address answers as the prefill instance asked
directly (one instance of the same model and args computing the prompt alone: same greedy text,
logprobs within LOGPROB_TOL), and from KV the decode node received (one `Inject KV cache of N
tokens` per prompt); a streaming request streams through the router. Then the decode node hangs
but stays alive (its engine SIGSTOPped): its liveness probe ends it with 18 within probe-s +
request-s, the other nodes stop with 26 naming it. The router first asks each
instance to render the request (`POST /v1/completions/render`: needs `--enable-scale-out`, else
403), so every prompt must fit the instances' max-model-len: the set's own KV probe once did not
(1,271 tokens over 512), the render and the prefill answered 400 and the set exited 12.

`extended` (kept out of CI for time): the same set on loopback, its answers compared with a
single plain instance started beside it:

Three prompts of two or more whole KV blocks (ExampleConnector stores and loads whole blocks of
32 tokens, and keys them by the prompt's tokens) go through the proxy and to a plain instance of
the same model, args and series, started beside the set. At temperature 0 the text must be
equal and every token's logprob within LOGPROB_TOL (measured here: 0.0 through the former
proxy, 2.8e-17 through vllm-router). The decode log must
show one `Inject KV cache of N tokens` per prompt, N the prompt's whole blocks before its last
token: the answers came from KV the decode instance received, not from a recompute. The set
must still be serving afterwards: the decode role forbids the line ExampleConnector prints when
a load is skipped, which the series' example-connector-no-forward patch limits to real skips
(unpatched, it prints on every step without a forward, after nearly every request).
~3 min 15 s here (the set and the plain instance start together on two cores); ~2.6 GiB per
instance, ~8 GiB in all. Run under `flock /tmp/m3patch-serve.lock`."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from cluster_helpers import Bed, print_set_memory, set_records

from m3patch.cluster.local_launcher import TEARDOWN_S
from m3patch.markers import MarkerSpec, check_log_bytes, regex_text
from m3patch.serving.processes import group_members

pytestmark = pytest.mark.serve

REPO = Path(__file__).resolve().parents[2]
RECIPE = REPO / "recipes" / "cpu_tiny_moe_pd.yaml"
SERIES = REPO / "patches" / "vllm-0.32.0"
READY_WAIT_S = 420
PROXY_PORT, SINGLE_PORT = 8785, 8788
BLOCK = 32
LOGPROB_TOL = 1e-4  # fp32 on one core each; measured max |delta| 0.0
PROMPTS = (
    " ".join(["the quick brown fox jumps over the lazy dog"] * 10),
    " ".join(["one two three four five six seven eight"] * 12),
    "Prefill and decode run as two servers. " * 9,
)
INJECTED = re.compile(r"Inject KV cache of (\d+) tokens")


@dataclass
class Served:
    proc: subprocess.Popen[str]
    run_dir: Path
    err: Path


def variants(tmp_path: Path, kv_dir: Path, netns: bool = False) -> tuple[Path, Path]:
    """The recipe with a private KV folder, and the same recipe without its topology (plain)."""
    data = yaml.safe_load(RECIPE.read_text())
    data["series"] = str(SERIES)
    for role in ("prefill", "decode"):
        kv = data["topology"]["roles"][role]["vllm-args"]["kv-transfer-config"]
        kv["kv_connector_extra_config"]["shared_storage_path"] = str(kv_dir)
    data["topology"]["roles"]["decode"]["markers"]["required"][0]["text"] = \
        f"Shared storage path is {kv_dir}"
    if netns:  # a liveness probe often enough for the hung node below to be caught quickly
        data["deadlines"].update({"probe-s": PROBE_S, "request-s": REQUEST_S})
    pd = tmp_path / "cpu_tiny_moe_pd.yaml"
    pd.write_text(yaml.safe_dump(data, sort_keys=False))
    if netns:
        return pd, pd
    plain = {k: v for k, v in data.items() if k != "topology"}
    plain.update(name="cpu_tiny_moe_plain", results=str(tmp_path / "results-plain"))
    plain["server"] = {**data["server"], "port": SINGLE_PORT}
    single = tmp_path / "cpu_tiny_moe_plain.yaml"
    single.write_text(yaml.safe_dump(plain, sort_keys=False))
    return pd, single


def start(recipe: Path, run_dir: Path, env: dict[str, str]) -> Served:
    err = run_dir.with_suffix(".stderr.txt")
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "m3patch", "serve", str(recipe), "--run-dir",
                                 str(run_dir), "--hold", "900"], cwd=REPO, env=env,
                                stdout=subprocess.DEVNULL, stderr=fh, text=True)
    return Served(proc, run_dir, err)


def wait_ready(served: Served, line: str, deadline: float) -> None:
    while line not in served.err.read_text() and served.proc.poll() is None:
        assert time.monotonic() < deadline, served.err.read_text()
        time.sleep(1.0)
    assert served.proc.poll() is None, \
        f"exited early ({served.proc.returncode}):\n{served.err.read_text()}"


def stop(served: Served) -> None:
    if served.proc.poll() is None:
        served.proc.send_signal(signal.SIGINT)
        served.proc.wait(timeout=TEARDOWN_S + 30)


@pytest.fixture
def pd_and_plain(cpu_venv: Path, tiny_model: Path, tmp_path: Path) -> Iterator[tuple[Served, Served]]:
    pd, single = variants(tmp_path, tmp_path / "kv")
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model)}
    # apply once up front: the two launches below then both find the series applied
    subprocess.run([sys.executable, "-m", "m3patch", "apply", "--python", str(cpu_venv / "bin" / "python"),
                    "--series", str(SERIES), "--verify"], cwd=REPO, env=env, check=True,
                   stdout=subprocess.DEVNULL)
    the_set = start(pd, tmp_path / "run-pd", env)
    plain = start(single, tmp_path / "run-plain", env)
    try:
        deadline = time.monotonic() + READY_WAIT_S
        wait_ready(the_set, "set ready", deadline)
        wait_ready(plain, "ready in", deadline)
        pgids = [r.pgid for r in set_records(the_set.run_dir).values() if r.pgid is not None]
        yield the_set, plain
    finally:
        stop(the_set)
        stop(plain)
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the set"


def complete(port: int, prompt: str, host: str = "127.0.0.1") -> tuple[dict[str, Any], float]:
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 16, "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(f"http://{host}:{port}/v1/completions",
                                     data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    started = time.monotonic()
    with urllib.request.urlopen(request, timeout=120) as reply:
        data = json.loads(reply.read())
    return data, time.monotonic() - started  # type: ignore[no-any-return]


def complete_or_show(port: int, prompt: str, host: str, run_dir: Path) -> dict[str, Any]:
    """`complete`, and on an HTTP error what the answer said with the tail of every node's log:
    a failure in a set of three servers is read from their logs, which go with tmp_path."""
    try:
        return complete(port, prompt, host=host)[0]
    except urllib.error.HTTPError as exc:
        body = exc.read().decode(errors="replace")[:2000]
        tails = "\n".join(f"== {log.name} (last 60 lines)\n" + "\n".join(
            log.read_text(errors="replace").splitlines()[-60:])
            for log in sorted((run_dir / "logs").glob("*.log")))
        raise AssertionError(f"HTTP {exc.code} from {host}:{port}: {body}\n{tails}") from exc


def whole_blocks_before_last(prompt_tokens: int) -> int:
    """What ExampleConnector loads: the whole blocks of the prompt without its last token."""
    return (prompt_tokens - 2) // BLOCK * BLOCK


@pytest.mark.extended  # three vLLM instances for ~3 min 15 s
def test_prefill_decode_set_answers_like_a_single_instance(
        pd_and_plain: tuple[Served, Served]) -> None:
    the_set, plain = pd_and_plain
    expected_loads, worst = [], 0.0
    log_path = the_set.run_dir / "logs" / "decode-0.log"
    gated = len(log_path.read_bytes())  # the set's own KV probe (kv-arrived) injected before
    for prompt in PROMPTS:
        via_set, set_s = complete(PROXY_PORT, prompt)
        alone, alone_s = complete(SINGLE_PORT, prompt)
        got, want = via_set["choices"][0], alone["choices"][0]
        assert got["text"] == want["text"], (prompt, got["text"], want["text"])
        deltas = [abs(a - b) for a, b in zip(got["logprobs"]["token_logprobs"],
                                             want["logprobs"]["token_logprobs"], strict=True)]
        worst = max(worst, *deltas)
        tokens = via_set["usage"]["prompt_tokens"]
        assert tokens >= 2 * BLOCK + 2, f"prompt of {tokens} tokens loads less than two blocks"
        expected_loads.append(whole_blocks_before_last(tokens))
        print(f"pd: {tokens} prompt tokens, set {set_s:.2f} s, single {alone_s:.2f} s")
    print(f"pd: max |delta logprob| {worst}")
    assert worst <= LOGPROB_TOL
    for served in (the_set, plain):  # no gate ended the set or the plain instance
        assert served.proc.poll() is None, served.err.read_text()

    decode_log = log_path.read_bytes()[gated:]
    injected = MarkerSpec("kv-injected", "required", regex_text(INJECTED.pattern), "this test",
                          count=len(PROMPTS))
    skipped = MarkerSpec("kv-load-skipped", "forbidden",
                         "In connector.start_load_kv, but the attn_metadata is None", "this test")
    check_log_bytes(decode_log, (injected, skipped), log_name="decode-0.log", hint="see the log")
    loads = [int(n) for n in INJECTED.findall(decode_log.decode(errors="replace"))]
    assert sorted(loads) == sorted(expected_loads), (loads, expected_loads)


# ------------------------------------------------------------------ across network namespaces

SET = "set-netns-pd"
PROBE_S, REQUEST_S = 5, 20  # the netns set's deadlines.probe-s and request-s
HOSTS = {"prefill": 0, "decode": 1, "proxy": 2}
PORTS = {"prefill": 8786, "decode": 8787, "proxy": PROXY_PORT}


def stream(url: str, prompt: str) -> list[str]:
    """A streaming completion (as `vllm bench serve` sends): the text of every SSE event."""
    body = {"model": "tiny-moe", "prompt": prompt, "max_tokens": 16, "temperature": 0,
            "stream": True}
    request = urllib.request.Request(f"{url}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    pieces = []
    with urllib.request.urlopen(request, timeout=120) as reply:
        assert reply.headers.get_content_type() == "text/event-stream"
        for raw in reply:
            line = raw.decode().strip()
            if line.startswith("data: ") and line != "data: [DONE]":
                pieces.append(json.loads(line[6:])["choices"][0]["text"])
    return pieces


def test_pd_set_across_namespaces_through_vllm_router(
        netns_bed: Bed, router_venv: Path, cpu_venv: Path, tiny_model: Path,
        tmp_path: Path) -> None:
    bed, run_dir = netns_bed, tmp_path / "run"
    recipe, _ = variants(tmp_path, tmp_path / "kv", netns=True)
    env = {**os.environ, "M3PATCH_CPU_VENV": str(cpu_venv), "M3PATCH_TINY_MODEL": str(tiny_model),
           "M3PATCH_ROUTER_VENV": str(router_venv), "M3PATCH_SET_ID": SET}
    env.pop("VLLM_HOST_IP", None)
    procs: dict[str, subprocess.Popen[str]] = {}
    errs = {role: tmp_path / f"{role}.err" for role in HOSTS}
    pgids: list[int] = []
    try:
        for role, k in HOSTS.items():
            role_env = {**env, "M3PATCH_HEAD_ADDR": bed.address(k)} if role == "proxy" else env
            with errs[role].open("w") as fh:
                procs[role] = bed.popen(k, [sys.executable, "-m", "m3patch", "serve", str(recipe),
                                            "--role", role, "--rank", "0", "--run-dir",
                                            str(run_dir), "--hold", "900", "--quiet"],
                                        cwd=REPO, env=role_env, stderr=fh,
                                        stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_WAIT_S
        while True:
            folder = run_dir / "nodes" / SET
            records = set_records(run_dir, SET) if folder.is_dir() else {}
            proxy = next((r for r in records.values() if r.role == "proxy"), None)
            if proxy is not None and proxy.state == "ready":
                break
            logs = "\n".join(f"== {r}\n{e.read_text()}" for r, e in errs.items())
            assert all(p.poll() is None for p in procs.values()), logs
            assert time.monotonic() < deadline, logs
            time.sleep(1.0)
        pgids = [r.pgid for r in records.values() if r.pgid is not None]
        for record in records.values():  # every node on its own host and address
            assert record.address == bed.address(HOSTS[record.role]), record
            assert record.host == f"node{HOSTS[record.role]}"
        # the router runs with its backends at the addresses the nodes published
        router_log = (run_dir / "logs" / "proxy-0.log").read_text()
        ready = next(line for line in router_log.splitlines() if "Router ready | workers:" in line)
        for url in (f"http://{bed.address(0)}:8786", f"http://{bed.address(1)}:8787"):
            assert f'"{url}"' in ready, ready  # the router lists its workers in its own order
        assert f"Starting server on {bed.address(2)}:{PROXY_PORT}" in router_log
        for role, k in HOSTS.items():  # each serves on its own address only
            listens = [line.split()[3] for line in bed.run(k, ["ss", "-ltnH"]).stdout.splitlines()]
            assert f"{bed.address(k)}:{PORTS[role]}" in listens, (role, listens)
            assert f"127.0.0.1:{PORTS[role]}" not in listens, (role, listens)
        # the set was gated on KV arriving at the decode node (kv-arrived)
        decode_log = (run_dir / "logs" / "decode-0.log").read_text()
        assert "Inject KV cache of" in decode_log
        # through the router's own address, each prompt answers as a single instance of the same
        # model and args computing it alone (the prefill instance asked directly, temperature 0),
        # and from KV the decode node received: one inject of the prompt's whole blocks each
        router, worst = bed.address(2), 0.0
        for prompt in PROMPTS:
            loads_before = len(INJECTED.findall(decode_log))
            via_router = complete_or_show(PROXY_PORT, prompt, router, run_dir)
            alone, _ = complete(PORTS["prefill"], prompt, host=bed.address(0))
            got, want = via_router["choices"][0], alone["choices"][0]
            assert got["text"] == want["text"], (prompt, got["text"], want["text"])
            worst = max(worst, *(abs(a - b) for a, b in zip(
                got["logprobs"]["token_logprobs"], want["logprobs"]["token_logprobs"], strict=True)))
            for _ in range(50):  # the engine's log line reaches the file a moment after the reply
                decode_log = (run_dir / "logs" / "decode-0.log").read_text()
                if len(INJECTED.findall(decode_log)) > loads_before:
                    break
                time.sleep(0.1)
            loads = [int(n) for n in INJECTED.findall(decode_log)[loads_before:]]
            tokens = via_router["usage"]["prompt_tokens"]
            assert loads == [whole_blocks_before_last(tokens)], (prompt, tokens, loads)
        assert worst <= LOGPROB_TOL, worst
        # streaming works through the router (the sweep's client always streams)
        pieces = stream(f"http://{router}:{PROXY_PORT}", PROMPTS[1])
        assert len(pieces) > 1 and "".join(pieces)
        for role, proc in procs.items():
            assert proc.poll() is None, (role, errs[role].read_text())
        print_set_memory("pd", set_records(run_dir, SET))
        hung_decode_ends_the_set(bed, run_dir, procs, errs)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGINT)
        for proc in procs.values():
            try:
                proc.wait(timeout=TEARDOWN_S + 30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    for pgid in pgids:
        assert group_members(pgid) == [], f"process group {pgid} outlived the set"


def _stopped(pid: int) -> bool:
    """Whether `pid` is stopped (state T); a process that is gone counts as not stopped."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] in ("T", "t")


def hung_decode_ends_the_set(bed: Bed, run_dir: Path, procs: dict[str, subprocess.Popen[str]],
                             errs: dict[str, Path]) -> None:
    """The decode node hangs but stays alive: every process of its server except the API server
    is SIGSTOPped (the engine and its worker), so /health still answers 200 and only a
    completion shows the hang. Its liveness probe must catch it within one probe interval plus
    request-s, end it with 18 naming decode/0, and the other nodes must stop with 26 naming it.
    A process of the test's own on the decode host, outside the set, is never signalled."""
    records = set_records(run_dir, SET)
    decode = next(r for r in records.values() if r.role == "decode")
    assert decode.pgid is not None
    bystander = bed.popen(1, ["sleep", "600"], start_new_session=True)
    try:
        engine = [pid for pid in group_members(decode.pgid) if pid != decode.pgid]
        assert engine, "the decode server has no engine process to stop"
        for pid in engine:
            os.kill(pid, signal.SIGSTOP)
        hung = time.monotonic()
        health = f"http://{bed.address(1)}:{PORTS['decode']}/health"
        with urllib.request.urlopen(health, timeout=5) as reply:  # the hang /health cannot see
            assert reply.status == 200
        bound = PROBE_S + REQUEST_S + 10  # one interval, the probe's own bound, the watch loop
        while (record := set_records(run_dir, SET)[decode.node]).state != "exited":
            assert time.monotonic() - hung < bound, errs["decode"].read_text()[-3000:]
            time.sleep(0.5)
        caught = time.monotonic() - hung
        print(f"pd: hung decode caught in {caught:.1f} s (probe-s {PROBE_S}, request-s {REQUEST_S})")
        for proc in procs.values():
            proc.wait(timeout=TEARDOWN_S + 60)
        assert procs["decode"].returncode == 18, errs["decode"].read_text()[-3000:]
        assert record.exit_code == 18 and "node decode/0 is alive but did not complete" in \
            record.reason, record
        for role in ("prefill", "proxy"):
            assert procs[role].returncode == 26, (role, errs[role].read_text()[-3000:])
            assert "node decode/0" in errs[role].read_text(), (role, errs[role].read_text())
        assert bystander.poll() is None and not _stopped(bystander.pid)
    finally:
        for pid in group_members(bystander.pid):
            os.kill(pid, signal.SIGKILL)
        bystander.wait()
