"""A set owns its records, and every node binds its own address (no server started).

Records left by an earlier run in a reused run folder, another set's records, a record forged
into this set's folder (a pgid of an unrelated process, pgid 0, a node outside the topology)
are never read as this set's: none makes a set ready, fails it, or gets a process killed. The
network: the head address never falls back to loopback, a node never advertises loopback to a
head on another address, recipes render no loopback address, per-node values fill in."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from m3patch.cluster import network
from m3patch.cluster import node as node_module
from m3patch.cluster import rendezvous as rv
from m3patch.cluster.fingerprint import argv_sha256, model_identity, torch_versions
from m3patch.cluster.local_launcher import LocalSet
from m3patch.cluster.node_plan import plan_node
from m3patch.errors import NodeAddress, NodeLost, NodeMismatch, ResultsInvalid, RunDirBusy
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.model_files import ModelNeed, Presence
from m3patch.recipe.topology import Network, NodeId
from m3patch.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
DP2 = REPO / "recipes" / "cpu_tiny_moe_dp2.yaml"
PD = REPO / "recipes" / "cpu_tiny_moe_pd.yaml"
HEAD, NODE = NodeId("head", 0), NodeId("node", 0)
NODES = (NODE, HEAD)
DIGEST = "ab" * 32


def record(set_id: str, node: NodeId, **kw: object) -> rv.NodeRecord:
    fields: dict[str, object] = {
        "set_id": set_id, "role": node.role, "rank": node.rank, "host": "h",
        "address": "127.0.0.1", "pid": 1, "pgid": None, "series": "vllm-0.32.0",
        "ledger_sha256": DIGEST, "tree_sha256": DIGEST, "verified": True, "state": "ready"}
    fields.update(kw)
    return rv.NodeRecord(**fields)  # type: ignore[arg-type]


def plant(run_dir: Path, folder: str, node: NodeId, **kw: object) -> Path:
    """A record file written by hand (as an earlier run, another set or a forger left it)."""
    path = run_dir / "nodes" / folder / f"{node.slug}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {"schema": rv.SCHEMA, **record(folder, node).__dict__, "heartbeat": time.time()}
    data.update(kw)
    path.write_text(json.dumps(data))
    return path


@pytest.fixture
def bystander() -> Iterator[subprocess.Popen[bytes]]:
    """An unrelated process in its own process group: no record may get it killed."""
    proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
    yield proc
    proc.kill()
    proc.wait()


def own_process(set_id: str) -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "300"], start_new_session=True,
                            env={**os.environ, rv.SET_ID_VAR: set_id})


# ------------------------------------------------------------------ records


def test_an_earlier_runs_ready_and_exited_records_are_not_this_sets(tmp_path: Path) -> None:
    plant(tmp_path, "set-old", HEAD, state="ready")
    plant(tmp_path, "set-old", NODE, state="exited", exit_code=19, reason="model missing")
    # the pre-identity layout (RUN/nodes/head-0.json) is not read either
    (tmp_path / "nodes" / "head-0.json").write_text(json.dumps({"state": "ready"}))
    assert rv.read_records(tmp_path, "set-new", NODES) == {}
    assert rv.compare((NODE,), rv.read_records(tmp_path, "set-new", NODES), "s", DIGEST, "f") \
        == [NODE]  # still waiting: neither "ready" nor "exited" counts


def test_a_record_stamped_with_another_set_is_left_out(tmp_path: Path) -> None:
    plant(tmp_path, "set-a", HEAD, set_id="set-b")
    assert rv.read_records(tmp_path, "set-a", NODES) == {}


def test_a_record_for_a_node_outside_the_topology_is_never_read(tmp_path: Path) -> None:
    plant(tmp_path, "set-a", NodeId("ghost", 0), state="exited", pgid=4242)
    assert rv.read_records(tmp_path, "set-a", NODES) == {}


@pytest.mark.parametrize("pgid", [0, 1, -5])
def test_a_record_naming_group_0_or_1_is_refused(tmp_path: Path, pgid: int) -> None:
    plant(tmp_path, "set-a", HEAD, pgid=pgid)
    with pytest.raises(ResultsInvalid, match=f"pgid {pgid} is not"):
        rv.read_records(tmp_path, "set-a", NODES)
    assert not rv.owns_group(pgid, "set-a")
    assert not rv.owns_group(os.getpgrp(), "set-a")


def test_teardown_kills_only_groups_this_set_started(tmp_path: Path,
                                                     bystander: subprocess.Popen[bytes]) -> None:
    mine = own_process("set-a")
    other_set = own_process("set-b")
    try:
        # a forged record in this set's own folder names the bystander, another names a
        # process of another set; a node outside the topology names the bystander too
        plant(tmp_path, "set-a", NODE, pgid=bystander.pid, state="starting")
        plant(tmp_path, "set-a", NodeId("ghost", 0), pgid=bystander.pid)
        plant(tmp_path, "set-b", HEAD, pgid=other_set.pid)
        plant(tmp_path, "set-a", HEAD, pgid=mine.pid)  # this set's own server group
        local = LocalSet(load_recipe(DP2), tmp_path, None, "set-a")
        assert sorted(local.pids()) == [mine.pid]  # the /dev/shm cleaner looks at these only
        local.teardown()
        assert mine.wait(timeout=10) == -signal.SIGKILL  # the one group the set started
        assert bystander.poll() is None and other_set.poll() is None
    finally:
        for proc in (mine, other_set):
            proc.kill()
            proc.wait()


def test_a_run_folder_held_by_a_live_set_is_refused(tmp_path: Path) -> None:
    plant(tmp_path, "set-live", HEAD, state="starting")
    with pytest.raises(RunDirBusy, match="in use by set set-live"):
        rv.require_free(tmp_path, "set-new")
    rv.require_free(tmp_path, "set-live")  # its own folder
    plant(tmp_path, "set-live", HEAD, state="exited")
    plant(tmp_path, "set-dead", HEAD, state="ready", heartbeat=time.time() - rv.STALE_S - 1)
    rv.require_free(tmp_path, "set-new")  # an exited set and a silent one hold nothing


@pytest.mark.parametrize("bad", ["", "../x", ".hidden", "a/b", "x" * 65])
def test_set_ids_are_file_names(monkeypatch: pytest.MonkeyPatch, bad: str) -> None:
    monkeypatch.delenv("SLURM_JOB_ID", raising=False)
    monkeypatch.setenv(rv.SET_ID_VAR, bad)
    if bad:
        with pytest.raises(Exception, match="is not 1-64"):
            rv.set_identity()
    else:
        assert rv.set_identity() is None


def test_slurm_job_is_the_set_identity(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(rv.SET_ID_VAR, raising=False)
    monkeypatch.setenv("SLURM_JOB_ID", "417")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    assert rv.set_identity() == "slurm-417.2"
    assert rv.set_identity("mine") == "mine"


def cli(*args: str, env: dict[str, str] | None = None,
        timeout: float = 120) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if not k.startswith(("M3PATCH_", "SLURM_"))}
    full.update(env or {})
    return subprocess.run([sys.executable, "-m", "m3patch", *args], capture_output=True,
                          text=True, cwd=REPO, env=full, timeout=timeout, check=False)


def test_a_dead_set_in_a_reused_folder_never_reports_ready(tmp_path: Path) -> None:
    """Every node exits 19 (no model); the earlier run's `ready` records must not make the set
    ready: not exit 0, not "ready in 0.0 s"."""
    run = tmp_path / "run"
    for folder in ("set-old", "nodes-legacy"):
        plant(run, folder, HEAD, state="ready", heartbeat=0.0)
        plant(run, folder, NODE, state="ready", heartbeat=0.0)
    proc = cli("serve", str(DP2), "--run-dir", str(run), "--stop-after-ready", "--quiet",
               env={"M3PATCH_TINY_MODEL": str(tmp_path / "no-model")})
    assert proc.returncode == 26, proc.stderr
    assert "ready in" not in proc.stderr and "exited with status 19" in proc.stderr


def test_a_node_without_a_set_identity_is_refused() -> None:
    proc = cli("serve", str(DP2), "--role", "node", "--rank", "0", "--run-dir", "/nonexistent")
    assert proc.returncode == 2 and "no set identity" in proc.stderr, proc.stderr


def pd_variant(tmp_path: Path, join_s: int) -> Path:
    data = yaml.safe_load(PD.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["deadlines"]["join-s"] = join_s
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_the_join_deadline_names_the_nodes_that_never_arrived(tmp_path: Path) -> None:
    """The P/D proxy alone (it has no tree, so nothing is applied): no prefill or decode node
    ever publishes in the run folder (not started, or a folder they do not share)."""
    started = time.monotonic()
    proc = cli("serve", str(pd_variant(tmp_path, 3)), "--role", "proxy", "--rank", "0",
               "--run-dir", str(tmp_path / "run"), "--set-id", "set-j", "--quiet")
    assert proc.returncode == 26, proc.stderr
    assert "node(s) prefill/0, decode/0 never joined set set-j within deadlines.join-s 3 s" \
        in proc.stderr
    assert "a run folder every node shares" in proc.stderr
    assert time.monotonic() - started < 60
    exited = rv.read_records(tmp_path / "run", "set-j", (NodeId("proxy", 0),))
    assert exited[NodeId("proxy", 0)].state == "exited"


def test_join_deadline_is_shorter_than_ready(tmp_path: Path) -> None:
    data = yaml.safe_load(DP2.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["deadlines"]["join-s"] = data["deadlines"]["ready-s"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError, match="must be shorter than ready-s"):
        load_recipe(path)


# ------------------------------------------------------------------ network


@pytest.mark.parametrize(("address", "message"), [
    ("${M3PATCH_TEST_UNSET_ADDR}", "M3PATCH_TEST_UNSET_ADDR is not set"),
    ("${M3PATCH_TEST_UNSET_ADDR:-}", "is empty here"),
    ("no-such-host.invalid", "does not resolve on this host"),
    ("192.0.2.77", "is not an address of this host"),  # TEST-NET-1: never ours
])
def test_the_head_never_falls_back_to_loopback(address: str, message: str) -> None:
    with pytest.raises(NodeAddress, match=message):
        network.head_network(Network(), address)


def test_the_head_binds_the_loopback_the_recipe_asks_for() -> None:
    net = network.head_network(Network(), "${M3PATCH_TEST_UNSET_ADDR:-127.0.0.1}")
    assert net == network.NodeNetwork("127.0.0.1", "lo", "127.0.0.1")


def test_a_node_never_advertises_loopback_to_a_remote_head(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(network.HOST_IP_VAR, "127.0.0.1")
    with pytest.raises(NodeAddress, match=r"would advertise loopback 127\.0\.0\.1"):
        network.node_network(Network(), "192.0.2.77")
    with pytest.raises(NodeAddress, match="not an interface of this host"):
        network.node_network(Network(interface="m3nope0"), "127.0.0.1")


def test_cli_head_without_an_address_exits_28(tmp_path: Path) -> None:
    proc = cli("serve", "mi300x_ep16_2node", "--role", "head", "--rank", "0", "--set-id", "s1",
               "--run-dir", str(tmp_path / "run"))
    assert proc.returncode == 28, proc.stderr
    assert "M3PATCH_HEAD_ADDR is not set" in proc.stderr and "never falls back" in proc.stderr


@pytest.mark.parametrize("name", ["mi300x_ep16_2node", "mi355x_tp4_pd"])
def test_gpu_topologies_render_no_loopback(name: str) -> None:
    proc = cli("recipe", "show", name)
    assert proc.returncode == 0, proc.stderr
    assert "127.0.0.1" not in proc.stdout and "localhost" not in proc.stdout
    assert "--host '<node-address>'" in proc.stdout or "--host <node-address>" in proc.stdout
    assert "GLOO_SOCKET_IFNAME" in proc.stdout and "network: node address" in proc.stdout


def test_per_node_values_fill_in(tmp_path: Path) -> None:
    data = yaml.safe_load(DP2.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["topology"]["network"] = {"interface": "auto", "env": {
        "NCCL_IB_HCA": "${M3PATCH_TEST_UNSET_HCA:-mlx5_@{rank}}", "MY_ADDR": "@{address}"}}
    data["topology"]["roles"]["node"]["env"]["WHERE"] = "@{role}-@{rank} to @{head}"
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    recipe = load_recipe(path)
    net = network.NodeNetwork("10.1.2.3", "eth7", "10.1.2.1")
    plan = plan_node(recipe, NODE, "/py", Path("/l"), None, net)
    env = dict(plan.plan.env_overrides)
    assert env["VLLM_HOST_IP"] == "10.1.2.3" and env["GLOO_SOCKET_IFNAME"] == "eth7"
    assert env["NCCL_SOCKET_IFNAME"] == "eth7" and env["MY_ADDR"] == "10.1.2.3"
    assert env["NCCL_IB_HCA"] == "mlx5_0" and env["WHERE"] == "node-0 to 10.1.2.1"
    argv = plan.argv
    assert argv[argv.index("--host") + 1] == "10.1.2.3"
    assert argv[argv.index("--data-parallel-address") + 1] == "10.1.2.1"
    data["topology"]["roles"]["node"]["env"]["BAD"] = "@{hostname}"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(SchemaError, match=r"@\{hostname\} is not a node value"):
        load_recipe(path)


# ------------------------------------------------------------------ cross-node comparison


def test_a_node_differing_in_any_fingerprint_field_is_named(tmp_path: Path) -> None:
    head = {"vllm_version": "0.33.0+rocm700", "vllm_commit": "abc", "torch": "2.11.0",
            "gpu_runtime": "rocm 7.0", "model": "r1 config.json sha256:00",
            "argv_sha256": "ff"}
    for name, other in (("vllm_commit", "abd"), ("gpu_runtime", "rocm 6.4"),
                        ("model", "r2 config.json sha256:00"), ("argv_sha256", "fe")):
        rv.publish(tmp_path, record("set-f", NODE, fingerprint={**head, name: other}))
        records = rv.read_records(tmp_path, "set-f", NODES)
        with pytest.raises(NodeMismatch, match=f"node node/0 .* differs from the head in {name}"):
            rv.compare((NODE,), records, "vllm-0.32.0", DIGEST, "fix", head)
    rv.publish(tmp_path, record("set-f", NODE, fingerprint=head))
    assert rv.compare((NODE,), rv.read_records(tmp_path, "set-f", NODES), "vllm-0.32.0",
                      DIGEST, "fix", head) == []
    # a field one node could not read (torch not beside its tree) is unknown, not different
    rv.publish(tmp_path, record("set-f", NODE, fingerprint={**head, "torch": "absent"}))
    assert rv.compare((NODE,), rv.read_records(tmp_path, "set-f", NODES), "vllm-0.32.0",
                      DIGEST, "fix", head) == []


def test_fingerprint_reads_torch_and_the_model_snapshot(tmp_path: Path) -> None:
    site = tmp_path / "site"
    (site / "torch").mkdir(parents=True)
    (site / "torch" / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.11.0+rocm7.0'\ndebug = False\n"
        "cuda: Optional[str] = None\nhip: Optional[str] = '7.0.51831'\n")
    assert torch_versions(site) == ("2.11.0+rocm7.0", "rocm 7.0.51831")
    assert torch_versions(tmp_path / "none") == ("absent", "absent")
    recipe = load_recipe(DP2)
    snap = tmp_path / "models--x--y" / "snapshots" / "0123abcd"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text("{}")
    need = ModelNeed("model", "model.source", "x/y", None, True)
    print_ = model_identity((Presence(need, snap, None),))
    assert print_.startswith("0123abcd config.json sha256:44136fa3")
    # the argv hash ignores what is per node by design, not the recipe's own launch
    assert argv_sha256(recipe) == argv_sha256(load_recipe(DP2))
    data = yaml.safe_load(DP2.read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["vllm-args"]["max-model-len"] = 256
    edited = tmp_path / "edited.yaml"
    edited.write_text(yaml.safe_dump(data))
    assert argv_sha256(load_recipe(edited)) != argv_sha256(recipe)


def test_a_node_whose_record_stops_beating_is_lost(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Judged on this host's clock by whether the record changes, not by the other host's
    wall time: a node that beats with a skewed clock is alive, a silent one is lost."""
    monkeypatch.setattr(node_module, "SILENT_NODE_S", 0.2)
    recipe = load_recipe(DP2)
    fast = replace(recipe, deadlines=replace(recipe.deadlines, request_s=0.1))
    runner = node_module.NodeRun(fast, HEAD, tmp_path, "/py", "set-b")
    skewed = {NODE: record("set-b", NODE, heartbeat=10.0)}  # ten seconds after 1970: skewed
    runner._raise_if_other_silent(skewed)
    time.sleep(0.2)
    runner._raise_if_other_silent({NODE: record("set-b", NODE, heartbeat=11.0)})  # it beat
    time.sleep(0.4)
    with pytest.raises(NodeLost, match=r"node node/0 .* stopped beating"):
        runner._raise_if_other_silent({NODE: record("set-b", NODE, heartbeat=11.0)})
