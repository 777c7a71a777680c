"""One node of a multi-node set: its argv, env, log and markers (pure; reads the series manifest).

A vLLM node is the recipe's single-server launch (serving.launch_plan.plan_launch) plus the
role's `vllm-args`, `env` and the DP flags the topology computes, gated by:
- the series' and recipe's markers, except the provenance line on a headless node: it has no
  API server, so it never prints it; its tree is proven through the rendezvous instead (series
  id + ledger digest published by the `serve --role/--rank` that verified it);
- the role's markers, with per-worker counts scaled to the node (local DP x TP).
Every node binds and advertises its own address (`NodeNetwork`, resolved on the node by
m3patch.cluster.network): `--host`, VLLM_HOST_IP, the Gloo/NCCL interface and the recipe's
per-node `@{...}` values; a render (`recipe show`) prints placeholders instead.
The proxy node runs vLLM's own P/D router (`vllm-router --vllm-pd-disaggregation`), its
backends at the addresses the prefill and decode nodes published.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, replace
from pathlib import Path

from m3patch.cluster.network import SHOWN, NodeNetwork, node_env
from m3patch.errors import UsageError
from m3patch.markers import MarkerSpec
from m3patch.recipe.loader import Recipe
from m3patch.recipe.paths import expand
from m3patch.recipe.topology import ROUTER_CONNECTORS, NodeId, Role, Topology, node_markers
from m3patch.serving.launch_plan import LOOPBACK_ENV, PROVENANCE_PREFIX, LaunchPlan, plan_launch

ROUTER_LOG_LEVEL = "info"
METRICS_HOST = "127.0.0.1"  # where vllm-router binds its metrics (its default, kept)
# The KV probe's prompt: long enough for several KV blocks, and never over the instances'
# max-model-len. Every tokenizer the recipes use spends at least one character of plain ASCII
# per token; the slack covers BOS/special tokens and the probe's own 4 output tokens.
KV_PROBE_CHARS = 1200
KV_PROBE_SLACK = 16


@dataclass(frozen=True)
class NodePlan:
    node: NodeId
    role: Role
    plan: LaunchPlan
    serves_http: bool

    @property
    def argv(self) -> tuple[str, ...]:
        return self.plan.spec.argv


def require_topology(recipe: Recipe) -> Topology:
    if recipe.topology is None:
        msg = f"recipe {recipe.path} has no `topology:` section, so it has no roles or ranks"
        raise UsageError(msg, hint=f"drop --role/--rank: m3patch serve {recipe.path}")
    return recipe.topology


def require_node(recipe: Recipe, role_name: str, rank: int) -> NodeId:
    topo = require_topology(recipe)
    names = [r.name for r in topo.roles]
    if role_name not in names:
        msg = f"recipe {recipe.path} has no role {role_name!r} (roles: {', '.join(names)})"
        raise UsageError(msg, hint=f"m3patch recipe show {recipe.path}")
    role = topo.role(role_name)
    if not 0 <= rank < role.nodes:
        msg = f"role {role_name!r} of recipe {recipe.path} has ranks 0..{role.nodes - 1}, not {rank}"
        raise UsageError(msg, hint=f"m3patch recipe show {recipe.path}")
    return NodeId(role_name, rank)


def node_port(recipe: Recipe, topo: Topology, node: NodeId) -> int:
    """The node's HTTP port: its role's port + rank, the DP head's / proxy's is server.port.

    A headless node binds no port; its argv carries one m3patch keeps distinct (head port +
    start rank) so the supervisor's free-port check never hits the head."""
    role = topo.role(node.role)
    if role.kind == "dp-headless":
        return recipe.port + topo.start_rank(node)
    if role.port is None:
        return recipe.port
    return role.port + node.rank


def shown_backends(recipe: Recipe, topo: Topology) -> dict[str, tuple[str, ...]]:
    """The proxy's backends as a render shows them: each node's address is its own."""
    return {kind: tuple(f"http://<{r.name}/{k}-address>:{node_port(recipe, topo, NodeId(r.name, k))}"
                        for r in topo.roles if r.kind == kind for k in range(r.nodes))
            for kind in ("prefill", "decode")}


def _without_provenance(markers: tuple[MarkerSpec, ...]) -> tuple[MarkerSpec, ...]:
    return tuple(m for m in markers if not (m.kind == "required" and (
        m.text.startswith(PROVENANCE_PREFIX) or m.id == "provenance-ledger")))


def _with_host(argv: tuple[str, ...], host: str) -> tuple[str, ...]:
    out = list(argv)
    out[out.index("--host") + 1] = host
    return tuple(out)


def plan_node(recipe: Recipe, node: NodeId, python: str, log_path: Path,
              ledger_sha256: str | None, net: NodeNetwork = SHOWN,
              backends: dict[str, tuple[str, ...]] | None = None) -> NodePlan:
    topo = require_topology(recipe)
    role = topo.role(node.role)
    port = node_port(recipe, topo, node)
    netenv = node_env(net, node.role, node.rank, (*recipe.env, *role.env), topo.network.env)
    if role.kind == "proxy":
        urls = backends if backends is not None else shown_backends(recipe, topo)
        return NodePlan(node, role, _proxy_plan(recipe, port, log_path, net, netenv, urls), True)
    base = plan_launch(recipe, python, port, log_path, ledger_sha256)
    dp = topo.dp_args(node, net.head_address) if role.kind in ("dp-head", "dp-headless") else ()
    # vllm-router first asks every prefill and decode instance to render the request
    # (/v1/completions/render), which vLLM serves only with --enable-scale-out: without it the
    # render is refused (403) and ExampleConnector keyed every prompt's KV alike (found here).
    pd = ("--enable-scale-out",) if role.kind in ("prefill", "decode") else ()
    argv = (*_with_host(base.spec.argv, net.address), *role.vllm_args, *dp, *pd)
    overrides = tuple({**dict(base.env_overrides), **netenv}.items())
    env = {**base.spec.env, **netenv}
    markers = base.markers if role.serves_http else _without_provenance(base.markers)
    markers = (*markers, *node_markers(role, recipe.parallelism.tp))
    fix = f"m3patch serve {recipe.path} --role {node.role} --rank {node.rank}"
    spec = replace(base.spec, argv=argv, env=env, fix_hint=fix,
                   base_url=f"http://{net.address}:{port}")
    plan = LaunchPlan(spec, overrides, markers, base.marker_hint.replace(
        f"m3patch serve {recipe.path}", fix))
    return NodePlan(node, role, plan, role.serves_http)


def _proxy_plan(recipe: Recipe, port: int, log_path: Path, net: NodeNetwork,
                netenv: dict[str, str], backends: dict[str, tuple[str, ...]]) -> LaunchPlan:
    from m3patch.serving.supervisor import LaunchSpec

    topo = require_topology(recipe)
    role = next(r for r in topo.roles if r.kind == "proxy")
    connectors = {r.connector for r in topo.roles if r.connector in ROUTER_CONNECTORS}
    kv = [x for name in sorted(c for c in connectors if c) for x in
          ("--kv-connector", ROUTER_CONNECTORS[name])]
    argv = (expand(role.router), "--host", net.address, "--port", str(port),
            "--vllm-pd-disaggregation",
            *(x for url in backends["prefill"] for x in ("--prefill", url)),
            *(x for url in backends["decode"] for x in ("--decode", url)), *kv,
            # the router waits for its workers as long as the set may take to be ready
            "--worker-startup-timeout-secs", str(int(recipe.deadlines.ready_s)),
            "--request-timeout-secs", str(int(recipe.deadlines.request_s)),
            "--prometheus-port", str(role.metrics_port),
            "--log-level", ROUTER_LOG_LEVEL)
    overrides = tuple({**dict(LOOPBACK_ENV), **netenv}.items())
    spec = LaunchSpec(argv=argv, env={**os.environ, **dict(overrides)}, log_path=log_path,
                      base_url=f"http://{net.address}:{port}", served_model=recipe.model.served_name,
                      ready_deadline_s=recipe.deadlines.ready_s,
                      request_deadline_s=recipe.deadlines.request_s,
                      fix_hint=f"m3patch serve {recipe.path} --role {role.name} --rank 0",
                      also_binds=((METRICS_HOST, role.metrics_port,
                                   "vllm-router's metrics endpoint",
                                   f"set topology.roles.{role.name}.metrics-port to a free "
                                   "port"),))
    return LaunchPlan(spec, overrides, (), spec.fix_hint)


def max_model_len(recipe: Recipe, role: Role) -> int | None:
    """The max-model-len a role's instances start with (the role's own over the recipe's); None
    when neither states one (vLLM then takes the model's, far over the probe)."""
    argv = (*recipe.vllm_args, *role.vllm_args)
    stated = [argv[i + 1] for i, arg in enumerate(argv[:-1]) if arg == "--max-model-len"]
    # vLLM also takes '2k' (2,000) and '2K' (2,048); anything else ('auto', -1) is the model's
    match = re.fullmatch(r"(\d+)([kK]?)", stated[-1].strip()) if stated else None
    if match is None:
        return None
    return int(match[1]) * {"": 1, "k": 1000, "K": 1024}[match[2]]


def kv_probe_prompt(recipe: Recipe, attempt: int) -> str:
    """The P/D set's KV probe: a fresh prompt per attempt (ExampleConnector keys stored KV by the
    prompt), as long as the shortest prefill/decode max-model-len allows. A longer one is refused
    by the router's render call and by the prefill instance (HTTP 400), and no KV ever moves."""
    topo = require_topology(recipe)
    limits = [n for r in topo.roles if r.kind in ("prefill", "decode")
              if (n := max_model_len(recipe, r)) is not None]
    chars = min([KV_PROBE_CHARS, *(n - KV_PROBE_SLACK for n in limits)])
    words = " ".join(f"m3patch checks that KV moves {k}" for k in range(chars // 20 + 1))
    return f"{attempt} {words}"[:chars]


def role_recipes(recipe: Recipe) -> tuple[Recipe, ...]:
    """The launch of each role that runs vLLM, as the launch check takes it: the recipe with the
    role's vllm-args after its own and the role's env over its own (every rank of a role has
    them; the flags m3patch adds from the topology are not the recipe's to get wrong)."""
    topo = require_topology(recipe)
    return tuple(replace(recipe, vllm_args=(*recipe.vllm_args, *role.vllm_args),
                         env=tuple({**dict(recipe.env), **dict(role.env)}.items()),
                         launch_role=role.name)
                 for role in topo.roles if role.runs_vllm)


def plan_set(recipe: Recipe, python: str, run_dir: Path) -> tuple[NodePlan, ...]:
    """Every node of the set, in launch order (the head or proxy last)."""
    topo = require_topology(recipe)
    return tuple(plan_node(recipe, node, python, node_log(run_dir, node), None)
                 for node in topo.nodes())


def node_log(run_dir: Path, node: NodeId) -> Path:
    return run_dir / "logs" / f"{node.slug}.log"
