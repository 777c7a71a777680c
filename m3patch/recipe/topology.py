"""The recipe's `topology:` section: which roles a multi-node set runs, how many nodes each, and
what each node's `vllm serve` adds to the recipe's own argv, env and markers.

Kinds of role:
- `dp-head`: the data-parallel head (API server, DP coordinator, its local engines); one node.
- `dp-headless`: `vllm serve --headless` ranks that join the head's DP group (engines only).
- `prefill`, `decode`: separate instances linked by a KV connector (disaggregated serving).
- `proxy`: vLLM's own P/D router (`vllm-router --vllm-pd-disaggregation`, the PyPI package
  InferenceX pins for its disaggregated runs; `router:` names its binary); the set's front door.
  A decode role's `kv-arrived:` is the log line that proves KV came from a prefill node: the
  head sends one long prompt through the router once the set answers, and every decode node's
  log must show the line (the connector loading is not enough).

`address` (the head's) and the `network:` section stay as written here: each node resolves them
at start (m3patch.cluster.network), so a render never shows a loopback address a real cluster
would not use. Env values may name the node's own `@{address}`, `@{interface}`, `@{head}`,
`@{role}` and `@{rank}`.

Marker counts in a role are per WORKER PROCESS (vLLM prints its `info_once` lines once per
process, and a node runs `local-dp x tp` of them), so a gate can say "every worker of every
node printed it"; `node_markers` scales them to one node's log. The recipe's top-level markers
apply to every vLLM node and may not give counts (a count there would be per node of one kind
only). Pure: parse, validate, compute ranks.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Literal, cast

from m3patch.markers import MarkerSpec
from m3patch.recipe import gates, launch
from m3patch.recipe.launch import flatten_vllm_args
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_choice,
    expect_int,
    expect_mapping,
    expect_str,
)

RoleKind = Literal["dp-head", "dp-headless", "prefill", "decode", "proxy"]
ROLE_KINDS: tuple[RoleKind, ...] = ("dp-head", "dp-headless", "prefill", "decode", "proxy")
DP_KINDS = ("dp-head", "dp-headless")
PD_KINDS = ("prefill", "decode", "proxy")
VLLM_KINDS = ("dp-head", "dp-headless", "prefill", "decode")
ROLE_KEYS = ("kind", "nodes", "local-dp", "port", "vllm-args", "env", "markers", "router",
             "kv-arrived", "metrics-port")
DEFAULT_ROUTER = "${M3PATCH_ROUTER_VENV:-~/.cache/m3patch/vllm-router-venv}/bin/vllm-router"
# vllm-router always serves Prometheus metrics on loopback, by default on 29000: a second router
# on the host (another P/D set) panicked at start on that port, so the proxy names its own.
DEFAULT_METRICS_PORT = 29000
# The keys vLLM 0.33's connectors read from kv_connector_extra_config with no default
# (moriio_common.py: int(extra_config["http_port"]), ["handshake_port"], ["notify_port"]; the
# NIXL connector reads every key with a default). tests/cluster check this against the tree.
REQUIRED_EXTRA = {"MoRIIOConnector": ("http_port", "handshake_port", "notify_port")}
# vllm-router's --kv-connector for a connector that needs the router's own handshake
ROUTER_CONNECTORS = {"MoRIIOConnector": "moriio", "NixlConnector": "nixl",
                     "MooncakeConnector": "mooncake"}
# m3patch writes these from the topology; a role setting them by hand would disagree with it.
OWNED_ARGS = ("data-parallel-size", "data-parallel-size-local", "data-parallel-address",
              "data-parallel-rpc-port", "data-parallel-start-rank", "headless", "port", "host",
              "enable-scale-out")
# A node is a host of the set: a count past this is a typo (10**9 built that many node ids).
MAX_NODES = 1024
DEFAULT_RPC_PORT = 13345
DEFAULT_ADDRESS = "${M3PATCH_HEAD_ADDR}"  # no default: a set never falls back to loopback
NETWORK_KEYS = ("interface", "address", "env")
PLACEHOLDERS = ("address", "interface", "head", "role", "rank")
_PLACEHOLDER = re.compile(r"@\{([^}]*)\}")
# A role name becomes a file name (RUN/nodes/<role>-<rank>.json, logs) and a word of the sbatch
# script (`role:rank` pairs split at ':'), so it is held to characters neither can misread.
_ROLE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_-]*")


@dataclass(frozen=True)
class Role:
    name: str
    kind: RoleKind
    nodes: int
    local_dp: int  # DP ranks (engine processes) per node; workers per node = local_dp x tp
    port: int | None  # the HTTP port of an API-serving role (None: the recipe's server.port)
    vllm_args: tuple[str, ...]
    env: tuple[tuple[str, str], ...]
    markers: tuple[MarkerSpec, ...]  # counts per worker process
    router: str = DEFAULT_ROUTER  # the proxy's vllm-router binary, as written
    kv_arrived: str | None = None  # decode: the log line that proves KV arrived
    connector: str | None = None  # prefill/decode: kv-transfer-config's kv_connector
    metrics_port: int = DEFAULT_METRICS_PORT  # the proxy's: vllm-router's metrics, on loopback

    @property
    def serves_http(self) -> bool:
        return self.kind != "dp-headless"

    @property
    def runs_vllm(self) -> bool:
        return self.kind in VLLM_KINDS


@dataclass(frozen=True)
class NodeId:
    role: str
    rank: int  # 0-based within the role

    def __str__(self) -> str:
        return f"{self.role}/{self.rank}"

    @property
    def slug(self) -> str:
        """File-name form (`head-0`), for logs and rendezvous records."""
        return f"{self.role}-{self.rank}"


@dataclass(frozen=True)
class Network:
    """Which address a node advertises and which interface Gloo/NCCL/RCCL use (as written:
    `auto` or a value with ${VAR}; resolved on the node)."""

    interface: str = "auto"  # auto: the interface holding the node's address
    address: str = "auto"  # auto: VLLM_HOST_IP if exported, else the route to the head
    env: tuple[tuple[str, str], ...] = ()  # site values (NCCL_IB_HCA, ...), placeholders allowed


@dataclass(frozen=True)
class Topology:
    address: str  # the head's address as written (${M3PATCH_HEAD_ADDR}); resolved on the head
    rpc_port: int
    roles: tuple[Role, ...]
    network: Network = Network()

    def role(self, name: str) -> Role:
        for role in self.roles:
            if role.name == name:
                return role
        known = ", ".join(r.name for r in self.roles)
        msg = f"no role {name!r} in the recipe's topology (roles: {known})"
        raise SchemaError(msg)

    @property
    def is_dp(self) -> bool:
        return any(r.kind in DP_KINDS for r in self.roles)

    @property
    def dp_size(self) -> int:
        return sum(r.nodes * r.local_dp for r in self.roles if r.kind in DP_KINDS)

    def nodes(self) -> tuple[NodeId, ...]:
        """Every node of the set, the head (or proxy) last: it is the one that reports ready."""
        order = sorted(self.roles, key=lambda r: r.kind in ("dp-head", "proxy"))
        return tuple(NodeId(r.name, k) for r in order for k in range(r.nodes))

    @property
    def head(self) -> NodeId:
        """The node whose readiness is the set's: the DP head, or the P/D proxy."""
        kind = "dp-head" if self.is_dp else "proxy"
        return NodeId(next(r.name for r in self.roles if r.kind == kind), 0)

    def start_rank(self, node: NodeId) -> int:
        """The first global DP rank of a DP node: the head holds 0.., headless ranks follow."""
        start = 0
        for role in sorted(self.roles, key=lambda r: r.kind != "dp-head"):
            if role.kind not in DP_KINDS:
                continue
            if role.name == node.role:
                return start + node.rank * role.local_dp
            start += role.nodes * role.local_dp
        msg = f"{node} is not a data-parallel node"
        raise SchemaError(msg)

    def dp_args(self, node: NodeId, head_address: str) -> tuple[str, ...]:
        """The DP flags m3patch adds to a DP node's `vllm serve` (the head's resolved IP)."""
        role = self.role(node.role)
        out = ["--data-parallel-size", str(self.dp_size), "--data-parallel-size-local",
               str(role.local_dp), "--data-parallel-address", head_address,
               "--data-parallel-rpc-port", str(self.rpc_port)]
        if role.kind == "dp-headless":
            out += ["--headless", "--data-parallel-start-rank", str(self.start_rank(node))]
        return tuple(out)


def node_markers(role: Role, tp: int) -> tuple[MarkerSpec, ...]:
    """The role's markers with per-worker counts scaled to one node's log (local DP x TP)."""
    workers = role.local_dp * tp
    return tuple(m if m.count is None else replace(m, count=m.count * workers)
                 for m in role.markers)


def topology(data: dict[str, Any], *, source: str) -> Topology | None:
    if not data:
        return None
    check_keys(data, required=("roles",), optional=("address", "rpc-port", "network"))
    with at_key("address"):
        # kept as written; the head resolves it at start (the Slurm job exports the head's IP)
        address = expect_str(data.get("address", DEFAULT_ADDRESS))
    with at_key("network"):
        net = network(expect_mapping(data.get("network", {})))
    with at_key("rpc-port"):
        rpc_port = _port(data.get("rpc-port", DEFAULT_RPC_PORT))
    roles = []
    with at_key("roles"):
        for name, raw in expect_mapping(data["roles"]).items():
            with at_key(name):
                if not _ROLE_NAME.fullmatch(str(name)):
                    msg = f"a role name is letters, digits, '_' and '-' (a file name), got {name!r}"
                    raise SchemaError(msg)
                roles.append(_role(str(name), expect_mapping(raw), source))
    _check_shape(tuple(roles))
    return Topology(address, rpc_port, tuple(roles), net)


def network(data: dict[str, Any]) -> Network:
    check_keys(data, optional=NETWORK_KEYS)
    values = []
    for key in ("interface", "address"):
        with at_key(key):
            values.append(expect_str(data.get(key, "auto")))
    with at_key("env"):
        env = launch.env(expect_mapping(data.get("env", {})), expands=True)
        check_placeholders(env)
    return Network(values[0], values[1], env)


def check_placeholders(env: tuple[tuple[str, str], ...]) -> None:
    """Every `@{...}` in an env value names one of the node's own values."""
    for key, value in env:
        for name in _PLACEHOLDER.findall(value):
            if name not in PLACEHOLDERS:
                with at_key(key):
                    msg = (f"@{{{name}}} is not a node value; use one of "
                           f"{', '.join('@{' + p + '}' for p in PLACEHOLDERS)}")
                    raise SchemaError(msg)


def _port(value: object) -> int:
    port = expect_int(value, minimum=1)
    if port > 65535:
        msg = f"port {port} is above 65535"
        raise SchemaError(msg)
    return port


def _role(name: str, data: dict[str, Any], source: str) -> Role:
    check_keys(data, required=("kind",), optional=ROLE_KEYS)
    with at_key("kind"):
        kind = cast("RoleKind", expect_choice(data["kind"], ROLE_KINDS))  # one of ROLE_KINDS
    with at_key("nodes"):
        nodes = expect_int(data.get("nodes", 1), minimum=1)
        if nodes > MAX_NODES:
            msg = f"a set runs at most {MAX_NODES} nodes, got nodes: {nodes}"
            raise SchemaError(msg)
    with at_key("local-dp"):
        local_dp = expect_int(data.get("local-dp", 1), minimum=1)
    with at_key("port"):
        port = None if data.get("port") is None else _port(data["port"])
    with at_key("vllm-args"):
        raw_args = expect_mapping(data.get("vllm-args", {}))
        owned = sorted(set(raw_args) & set(OWNED_ARGS))
        if owned:
            msg = (f"{', '.join(owned)} is set by m3patch from the topology (roles, nodes, "
                   "local-dp, address, rpc-port, port, the node's address, the router); remove "
                   "it here")
            raise SchemaError(msg)
        vllm_args = flatten_vllm_args(raw_args)
        connector = _connector(raw_args)
    with at_key("router"):
        router = expect_str(data.get("router", DEFAULT_ROUTER))
    with at_key("kv-arrived"):
        kv_arrived = None if data.get("kv-arrived") is None else expect_str(data["kv-arrived"])
    with at_key("metrics-port"):
        metrics_port = _port(data.get("metrics-port", DEFAULT_METRICS_PORT))
    with at_key("env"):
        env = launch.env(expect_mapping(data.get("env", {})))
        check_placeholders(env)
    with at_key("markers"):
        marker_gates = gates.markers(expect_mapping(data.get("markers", {})),
                                     source=f"{source} role {name}")
        if marker_gates.counts or marker_gates.waivers:
            msg = "a role states counts on its own markers (per worker); counts/waive are not allowed here"
            raise SchemaError(msg)
    role = Role(name, kind, nodes, local_dp, port, vllm_args, env, marker_gates.markers, router,
                kv_arrived, connector, metrics_port)
    _check_role(role)
    for key in ("router", "metrics-port"):
        if kind != "proxy" and key in data:
            msg = f"{key}: belongs to the proxy's vllm-router; only a proxy role takes it"
            raise SchemaError(msg)
    if kind != "decode" and kv_arrived is not None:
        msg = "kv-arrived: is the decode side's proof that KV arrived; only a decode role takes it"
        raise SchemaError(msg)
    return role


def _connector(raw_args: dict[str, Any]) -> str | None:
    """The role's KV connector; its config must carry every key the connector reads with no
    default, or the recipe is refused here, before any node starts."""
    config = raw_args.get("kv-transfer-config")
    if config is None:
        return None
    with at_key("kv-transfer-config"):
        config = expect_mapping(config)
        name = config.get("kv_connector")
        if not isinstance(name, str):
            msg = "kv_connector is missing (a connector class name, e.g. MoRIIOConnector)"
            raise SchemaError(msg)
        extra = config.get("kv_connector_extra_config", {})
        with at_key("kv_connector_extra_config"):
            extra = expect_mapping(extra)
            missing = [k for k in REQUIRED_EXTRA.get(name, ()) if k not in extra]
            if missing:
                msg = (f"{name} reads {', '.join(missing)} with no default (vLLM 0.33); the "
                       "server would fail at start. Add it here")
                raise SchemaError(msg)
    return name


def _check_role(role: Role) -> None:
    if role.kind in ("dp-head", "proxy") and role.nodes != 1:
        msg = f"a {role.kind} role has exactly one node, got nodes: {role.nodes}"
        raise SchemaError(msg)
    if role.kind not in DP_KINDS and role.local_dp != 1:
        msg = f"local-dp applies to data-parallel roles only, not {role.kind}"
        raise SchemaError(msg)
    if role.kind == "proxy" and (role.vllm_args or role.markers):
        msg = "the proxy runs vllm-router, not vLLM: it takes no vllm-args or markers"
        raise SchemaError(msg)


def _check_shape(roles: tuple[Role, ...]) -> None:
    kinds = [r.kind for r in roles]
    if any(k in DP_KINDS for k in kinds) and any(k in PD_KINDS for k in kinds):
        msg = "a topology is either data-parallel (dp-head, dp-headless) or P/D (prefill, decode, proxy)"
        raise SchemaError(msg)
    if any(k in DP_KINDS for k in kinds) and kinds.count("dp-head") != 1:
        msg = f"a data-parallel topology has exactly one dp-head role, got {kinds.count('dp-head')}"
        raise SchemaError(msg)
    if any(k in PD_KINDS for k in kinds):
        for needed in PD_KINDS:
            if needed not in kinds:
                msg = f"a P/D topology needs a {needed} role"
                raise SchemaError(msg)
        if kinds.count("proxy") != 1:
            msg = "a P/D topology has exactly one proxy role"
            raise SchemaError(msg)
        for role in roles:
            if role.kind in ("prefill", "decode") and role.port is None:
                msg = f"role {role.name} ({role.kind}) needs its own port (the proxy uses server.port)"
                raise SchemaError(msg)
    total = sum(r.nodes for r in roles)
    if total > MAX_NODES:
        with at_key("roles"):
            msg = f"a set runs at most {MAX_NODES} nodes, its roles' nodes add up to {total}"
            raise SchemaError(msg)
    ports = [r.port for r in roles if r.port is not None]
    if len(ports) != len(set(ports)):
        msg = f"two roles share a port: {sorted(ports)}"
        raise SchemaError(msg)
