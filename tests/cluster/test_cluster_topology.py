"""Topology recipes: schema, per-worker marker counts, DP ranks, every node's argv; the rendezvous
records read back as hostile input and compared (pure; no server)."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from m3patch.cluster import rendezvous as rv
from m3patch.cluster.network import NodeNetwork
from m3patch.cluster.node_plan import kv_probe_prompt, plan_node, plan_set
from m3patch.cluster.slurm import sbatch_script, task_table
from m3patch.errors import NodeLost, NodeMismatch, ResultsInvalid, UsageError
from m3patch.markers import MarkerChecker
from m3patch.patching.series import load_series
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.topology import REQUIRED_EXTRA, NodeId
from m3patch.schema import SchemaError
from m3patch.serving.supervisor import Supervisor
from m3patch.serving.vllm_parser import series_spec

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
DIGEST = "ab" * 32
SET = "set-test"


def variant(tmp_path: Path, edit: dict[str, object], base: Path = DP2) -> Path:
    data = yaml.safe_load(base.read_text())
    data.update(edit)
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_dp2_nodes_ranks_and_argv() -> None:
    recipe = load_recipe(DP2)
    topo = recipe.topology
    assert topo is not None and topo.dp_size == 2
    assert topo.nodes() == (NodeId("node", 0), NodeId("head", 0))  # head last: it reports ready
    assert topo.head == NodeId("head", 0)
    plans = {p.node: p for p in plan_set(recipe, "/py", Path("/run"))}
    head, node = plans[NodeId("head", 0)].argv, plans[NodeId("node", 0)].argv
    assert "--headless" not in head and head[head.index("--port") + 1] == "8775"
    assert head[head.index("--data-parallel-size") + 1] == "2"
    assert node[node.index("--data-parallel-start-rank") + 1] == "1"
    assert "--headless" in node and node[node.index("--data-parallel-rpc-port") + 1] == "13385"
    assert dict(plans[NodeId("node", 0)].plan.env_overrides)["VLLM_CPU_OMP_THREADS_BIND"] == "1"


def test_headless_node_is_not_gated_on_the_provenance_line() -> None:
    recipe = load_recipe(DP2)
    head = plan_node(recipe, NodeId("head", 0), "/py", Path("/l"), DIGEST)
    node = plan_node(recipe, NodeId("node", 0), "/py", Path("/l"), DIGEST)
    assert {"provenance", "provenance-ledger"} <= {m.id for m in head.plan.markers}
    assert not {"provenance", "provenance-ledger"} & {m.id for m in node.plan.markers}
    # forbidden provenance markers still apply everywhere
    assert "provenance-bad-ledger" in {m.id for m in node.plan.markers}


def test_marker_counts_are_per_worker(tmp_path: Path) -> None:
    data = yaml.safe_load(DP2.read_text())
    data["topology"]["roles"]["node"]["local-dp"] = 3
    data["parallelism"] = {"tp": 2}
    path = variant(tmp_path, data)
    recipe = load_recipe(path)
    node = plan_node(recipe, NodeId("node", 0), "/py", Path("/l"), None)
    counts = {m.id: m.count for m in node.plan.markers}
    assert counts["cpu-moe-backend"] == 6  # 1 per worker x local DP 3 x TP 2
    assert recipe.topology is not None and recipe.topology.dp_size == 4


@pytest.mark.parametrize(("edit", "message"), [
    ({"roles": {"n": {"kind": "dp-headless"}}}, "exactly one dp-head"),
    ({"roles": {"h": {"kind": "dp-head", "nodes": 2}}}, "exactly one node"),
    ({"roles": {"h": {"kind": "dp-hed"}}}, "Perhaps you meant 'dp-head'?"),
    ({"roles": {"h": {"kind": "dp-head", "vllm-args": {"data-parallel-size": 4}}}}, "set by m3patch"),
    ({"roles": {"h": {"kind": "dp-head"}, "p": {"kind": "prefill", "port": 9}}}, "either data-parallel"),
    ({"roles": {"p": {"kind": "prefill", "port": 9}, "x": {"kind": "proxy"}}}, "needs a decode"),
    ({"roles": {"p": {"kind": "prefill"}, "d": {"kind": "decode", "port": 8},
                "x": {"kind": "proxy"}}}, "needs its own port"),
    ({"roles": {"h": {"kind": "dp-head", "markers": {"counts": {"a": 1}}}}}, "counts/waive"),
    ({"roles": {"h": {"kind": "dp-head"}}, "rpc-port": 70000}, "above 65535"),
    ({"roles": {"h": {"kind": "dp-head", "metrics-port": 29001}}}, "only a proxy role takes it"),
])
def test_bad_topologies_are_refused(tmp_path: Path, edit: dict[str, object], message: str) -> None:
    path = variant(tmp_path, {"topology": edit})
    with pytest.raises(SchemaError, match=message):
        load_recipe(path)


def test_recipe_level_counts_are_refused_with_a_topology(tmp_path: Path) -> None:
    data = yaml.safe_load(DP2.read_text())
    data["markers"]["required"][0]["count"] = 1
    with pytest.raises(SchemaError, match="counts go on the roles"):
        load_recipe(variant(tmp_path, data))


def record(role: str, **kw: object) -> rv.NodeRecord:
    fields: dict[str, object] = {"set_id": SET, "role": role, "rank": 0, "host": "h",
                                 "address": "10.0.0.1", "pid": 1, "pgid": 2,
                                 "series": "vllm-0.32.0", "ledger_sha256": DIGEST,
                                 "tree_sha256": DIGEST, "verified": True, "state": "ready"}
    fields.update(kw)
    return rv.NodeRecord(**fields)  # type: ignore[arg-type]


def test_rendezvous_round_trip_and_compare(tmp_path: Path) -> None:
    rv.publish(tmp_path, record("node"))
    records = rv.read_records(tmp_path, SET, (NodeId("node", 0), NodeId("late", 0)))
    expected = (NodeId("node", 0), NodeId("late", 0))
    assert rv.compare(expected, records, "vllm-0.32.0", DIGEST, "fix") == [NodeId("late", 0)]
    with pytest.raises(NodeMismatch, match=r"node node/0 .* runs series vllm-0.32.0 tree sha256:abab"):
        rv.compare(expected, records, "vllm-0.32.0", "cd" * 32, "fix")
    rv.publish(tmp_path, record("node", verified=False))
    with pytest.raises(NodeMismatch, match="did not verify"):
        rv.compare(expected, rv.read_records(tmp_path, SET, expected), "vllm-0.32.0", DIGEST, "fix")
    rv.publish(tmp_path, record("node", state="exited", exit_code=18, reason="died"))
    with pytest.raises(NodeLost, match=r"node node/0 .* exited with status 18: died"):
        rv.compare(expected, rv.read_records(tmp_path, SET, expected), "vllm-0.32.0", DIGEST, "fix")


def test_tree_digest_ignores_only_the_apply_time() -> None:
    """Two hosts applying the same series a second apart hold one tree; another file does not."""
    ledger = {"series": "vllm-0.32.0", "patches": ["provenance"], "mode": "strict",
              "files": [{"path": "vllm/a.py", "pre": "aa" * 32, "post": "bb" * 32, "dirs": []}],
              "time": "2026-12-01T20:00:00Z", "tool": "m3patch 0.1.0"}
    later = {**ledger, "time": "2026-12-01T20:00:01Z"}
    other = {**ledger, "files": [{**ledger["files"][0], "post": "cc" * 32}]}  # type: ignore[dict-item]
    digest = rv.tree_sha256(json.dumps(ledger, indent=2).encode(), "a")
    assert rv.tree_sha256(json.dumps(later).encode(), "b") == digest
    assert rv.tree_sha256(json.dumps(other).encode(), "c") != digest
    with pytest.raises(ResultsInvalid, match="not JSON"):
        rv.tree_sha256(b"{", "d")


@pytest.mark.parametrize("bad", [
    {"state": "dancing"}, {"ledger_sha256": "xyz"}, {"tree_sha256": "ab"}, {"rank": "0"},
    {"verified": "yes"}, {"schema": 1}, {"role": "other"},
])
def test_hostile_records_are_refused(tmp_path: Path, bad: dict[str, object]) -> None:
    rv.publish(tmp_path, record("node"))
    path = rv.record_path(tmp_path, SET, NodeId("node", 0))
    data = {**json.loads(path.read_text()), **bad}
    path.write_text(json.dumps(data))
    with pytest.raises(ResultsInvalid):
        rv.read_records(tmp_path, SET, (NodeId("node", 0),))


def test_the_kv_probe_fits_the_instances_max_model_len(tmp_path: Path) -> None:
    """The P/D set's KV probe is refused with 400 (by the router's render call and the prefill
    instance) once its prompt exceeds max-model-len: the CPU P/D set's 512 once took a
    1,271-character (1,271-token) probe, so no KV moved and the set exited 12."""
    pd = REPO / "recipes" / "cpu_tiny_moe_pd.yaml"
    prompts = [kv_probe_prompt(load_recipe(pd), k) for k in range(3)]
    assert len(set(prompts)) == 3  # ExampleConnector keys stored KV by the prompt
    assert all(400 <= len(p) <= 512 - 16 and p.isascii() for p in prompts)
    data = yaml.safe_load(pd.read_text())
    data["topology"]["roles"]["decode"]["vllm-args"]["max-model-len"] = 300
    assert len(kv_probe_prompt(load_recipe(variant(tmp_path, data, pd)), 0)) == 300 - 16
    del data["topology"]["roles"]["decode"]["vllm-args"]["max-model-len"]
    data["vllm-args"]["max-model-len"] = "1k"  # vLLM's 1,000
    assert len(kv_probe_prompt(load_recipe(variant(tmp_path, data, pd)), 0)) == 1000 - 16
    del data["vllm-args"]["max-model-len"]
    assert len(kv_probe_prompt(load_recipe(variant(tmp_path, data, pd)), 0)) == 1200


def test_sbatch_runs_every_node_and_kills_on_bad_exit() -> None:
    recipe = load_recipe(DP2)
    assert task_table(recipe) == [("node", 0), ("head", 0)]
    script = sbatch_script(recipe, Path("/shared/run"))
    assert "#SBATCH --nodes=2" in script and "#SBATCH --ntasks-per-node=1" in script
    assert "srun $M3PATCH_SRUN_ARGS --kill-on-bad-exit=1 --ntasks=2" in script
    assert '--output="$RUN/logs/task-%t.out"' in script
    assert "roles=(node:0 head:0)" in script
    assert 'm3patch_exec $M3PATCH_CMD serve "$RECIPE" --role "${pair%%:*}" --rank "${pair##*:}"' in script
    assert 'source "${M3PATCH_SITE_HOOK}"' in script
    assert 'HEAD_RECORD="$RUN/nodes/$M3PATCH_SET_ID/head-0.json"' in script
    assert 'm3patch_exec $M3PATCH_CMD bench "$RECIPE" --url "http://$HEAD_IP:8775"' in script
    assert 'kill -TERM "$SET"' in script  # srun forwards TERM; one INT only prints task states


NODES_BY_RECIPE = {"mi355x_tp4_pd": ("prefill/0", "decode/0", "proxy/0"),
                   "mi300x_ep16_2node": ("head/0", "node/0"),
                   "cpu_tiny_moe_dp2": ("head/0", "node/0")}


@pytest.mark.parametrize("name", sorted(NODES_BY_RECIPE))
def test_topologies_render_every_node(name: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "m3patch", "serve", name, "--dry-run"],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    assert "topology:" in proc.stdout
    for node in NODES_BY_RECIPE[name]:
        assert f"# node {node} " in proc.stdout


def test_a_moriio_config_without_a_key_vllm_needs_is_refused(tmp_path: Path) -> None:
    data = yaml.safe_load((REPO / "recipes" / "mi355x_tp4_pd.yaml").read_text())
    extra = data["topology"]["roles"]["decode"]["vllm-args"]["kv-transfer-config"]
    del extra["kv_connector_extra_config"]["http_port"]
    with pytest.raises(SchemaError, match="MoRIIOConnector reads http_port with no default"):
        load_recipe(variant(tmp_path, data, base=REPO / "recipes" / "mi355x_tp4_pd.yaml"))


def test_connector_keys_without_default_match_vllm_033(pristine_033: Path) -> None:
    """REQUIRED_EXTRA is what vLLM 0.33.0's MoRIIO and NIXL code reads as extra_config[KEY]
    (no default); read from the real tree, so a new required key fails here."""
    v1 = pristine_033 / "vllm" / "distributed" / "kv_transfer" / "kv_connector" / "v1"
    bare = re.compile(r"extra_config\[\s*[\"'](\w+)[\"']\s*\]")
    for connector, folder in (("MoRIIOConnector", "moriio"), ("NixlConnector", "nixl")):
        code = "\n".join(line.split("#", 1)[0] for f in sorted((v1 / folder).glob("*.py"))
                         for line in f.read_text().splitlines())
        read = set(bare.findall(code))
        # MoRIIO's own __init__ fills handshake_port / notify_port when absent, but
        # moriio_common reads all three bare; the table requires every one
        assert read <= set(REQUIRED_EXTRA.get(connector, ())), (connector, read)
        assert set(REQUIRED_EXTRA.get(connector, ())) <= read, connector
    assert "http_port" in REQUIRED_EXTRA["MoRIIOConnector"]


def test_gpu_topologies_plan() -> None:
    pd = load_recipe(REPO / "recipes" / "mi355x_tp4_pd.yaml")
    prefill = plan_node(pd, NodeId("prefill", 0), "/py", Path("/l"), None).argv
    assert '"kv_connector":"MoRIIOConnector"' in prefill[prefill.index("--kv-transfer-config") + 1]
    assert '"http_port":8100' in prefill[prefill.index("--kv-transfer-config") + 1]
    assert "--enable-scale-out" in prefill  # the router renders requests on the instances
    proxy = plan_node(pd, NodeId("proxy", 0), "/py", Path("/l"), None).argv
    assert proxy[0].endswith("/vllm-router") and "--vllm-pd-disaggregation" in proxy
    assert proxy[proxy.index("--kv-connector") + 1] == "moriio"  # the router's MoRIIO handshake
    assert proxy[proxy.index("--worker-startup-timeout-secs") + 1] == "3600"
    assert proxy[proxy.index("--prefill") + 1] == "http://<prefill/0-address>:8100"
    assert proxy[proxy.index("--decode") + 1] == "http://<decode/0-address>:8200"
    # the router's own metrics port, named, so a second set's router can be moved off it
    assert proxy[proxy.index("--prometheus-port") + 1] == "29000"
    ep = load_recipe(REPO / "recipes" / "mi300x_ep16_2node.yaml")
    assert ep.topology is not None and ep.topology.dp_size == 16
    node = plan_node(ep, NodeId("node", 0), "/py", Path("/l"), None)
    assert node.argv[node.argv.index("--data-parallel-start-rank") + 1] == "8"
    assert {m.id: m.count for m in node.plan.markers}["block-fp8-layer-per-worker"] == 8


@pytest.mark.parametrize(("recipe", "extra", "message"), [
    ("cpu_tiny_moe_dp2", ["--role", "head"], "go together"),
    ("cpu_tiny_moe_dp2", ["--role", "nobody", "--rank", "0"], "no role 'nobody'"),
    ("cpu_tiny_moe_dp2", ["--role", "node", "--rank", "3"], "ranks 0..0"),
    ("cpu_tiny_moe", ["--role", "h", "--rank", "0"], "no `topology:` section"),
])
def test_role_and_rank_errors_exit_2(recipe: str, extra: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "m3patch", "serve", recipe, *extra],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_serve_writes_the_sbatch_job(tmp_path: Path) -> None:
    job = tmp_path / "job.sbatch"
    proc = subprocess.run([sys.executable, "-m", "m3patch", "serve", "cpu_tiny_moe_dp2",
                           "--write-sbatch", str(job), "--run-dir", str(tmp_path / "run")],
                          capture_output=True, text=True, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    text = job.read_text()
    assert text.startswith("#!/bin/bash") and "srun $M3PATCH_SRUN_ARGS --kill-on-bad-exit=1" in text
    assert f"RUN={tmp_path / 'run'}" in text
    # Slurm opens --output before the script runs: the folder exists, made by m3patch
    assert f"#SBATCH --output={tmp_path / 'run'}/logs/batch-%j.out" in text
    assert (tmp_path / "run" / "logs").is_dir()
    assert "#SBATCH --time=0:35:00" in text  # ready 300 + run 1200 + stop 600 s
    assert "--gpus-per-node" not in text and "--exclusive" not in text  # the CPU recipe
    assert [x.name for x in (tmp_path / "run").iterdir()] == ["logs"]  # and starts nothing
    single = subprocess.run([sys.executable, "-m", "m3patch", "serve", "cpu_tiny_moe",
                             "--write-sbatch", str(tmp_path / "x")], capture_output=True,
                            text=True, cwd=REPO, check=False)
    assert single.returncode == 2 and "no `topology:` section" in single.stderr


def test_the_gpu_job_asks_for_what_its_nodes_use() -> None:
    text = sbatch_script(load_recipe(REPO / "recipes" / "mi300x_ep16_2node.yaml"),
                         Path("/shared/run"))
    assert "#SBATCH --gpus-per-node=8\n#SBATCH --exclusive\n" in text  # local DP 8 x TP 1
    assert "#SBATCH --time=4:10:00" in text  # ready 3600 + run 10800 + stop 600 s
    assert "--cpus-per-task=$SLURM_CPUS_ON_NODE" in text  # the node's CPUs, not Slurm's one
    # srun is the batch step's own background job: $! is srun's pid, SIGTERM reaches it
    srun = next(line for line in text.splitlines() if line.startswith("srun "))
    assert "--kill-on-bad-exit=1" in srun and "m3patch_exec" not in srun
    pd = sbatch_script(load_recipe(REPO / "recipes" / "mi355x_tp4_pd.yaml"), Path("/r"))
    assert "#SBATCH --gpus-per-node=4\n" in pd


def test_a_taken_router_metrics_port_refuses_the_proxy_before_it_starts(tmp_path: Path) -> None:
    """Before: vllm-router binds its Prometheus metrics on 127.0.0.1:29000 whatever its --port,
    so the router of a second P/D set on the host panicked at start ("failed to install
    Prometheus metrics exporter: ... Address already in use"), seen with vllm-router 0.1.17
    here. The proxy now names the port (topology.roles.ROLE.metrics-port) and a taken one is
    refused before the router starts, naming the key."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe_pd.yaml").read_text())
        data["topology"]["roles"]["proxy"]["metrics-port"] = port
        with socket.socket() as free:  # the router's own port: free, so the metrics port decides
            free.bind(("127.0.0.1", 0))
            data["server"]["port"] = free.getsockname()[1]
        recipe = load_recipe(variant(tmp_path, data, base=REPO / "recipes" / "cpu_tiny_moe_pd.yaml"))
        loopback = NodeNetwork("127.0.0.1", "lo", "127.0.0.1")
        plan = plan_node(recipe, NodeId("proxy", 0), "/py", tmp_path / "proxy.log", None, loopback)
        assert plan.argv[plan.argv.index("--prometheus-port") + 1] == str(port)
        supervisor = Supervisor(plan.plan.spec, MarkerChecker(()))
        with pytest.raises(UsageError) as info:
            supervisor.start()
    assert info.value.message == (f"127.0.0.1:{port} is already in use by another process; "
                                  "vllm-router's metrics endpoint could not bind it")
    assert "set topology.roles.proxy.metrics-port to a free port" in (info.value.hint or "")
    assert supervisor.proc is None and not (tmp_path / "proxy.log").exists()


@pytest.mark.parametrize("name", ["cpu_tiny_moe_dp2", "cpu_tiny_moe_pd", "mi300x_ep16_2node",
                                  "mi355x_tp4_pd"])
def test_every_flag_a_node_runs_with_is_its_target_vllms_own(name: str) -> None:
    """The launch check judges the recipe's own arguments; the flags m3patch adds per node
    (--data-parallel-*, --headless, --enable-scale-out, --host, --port) are checked here against
    the series' launch spec (vLLM's own parser, dumped when the series was locked): a vLLM that
    renamed one fails this test when its series is locked, not a node at start. A flag that
    takes a value is given one, and a switch none."""
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    spec = series_spec(load_series(recipe.series_dir))
    assert spec is not None
    topo = recipe.topology
    assert topo is not None
    for node in topo.nodes():
        if topo.role(node.role).kind == "proxy":
            continue
        argv = plan_node(recipe, node, "/py", Path("/l"), None).argv
        args = list(argv[argv.index("serve") + 2:])  # after `vllm serve MODEL`
        for i, arg in enumerate(args):
            if not arg.startswith("--"):
                continue
            action = spec.actions.options.get(arg.split("=", 1)[0])
            assert action is not None, (name, str(node), arg)
            value_follows = i + 1 < len(args) and not args[i + 1].startswith("--")
            assert action["takes_value"] == value_follows, (name, str(node), arg)
