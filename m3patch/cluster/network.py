"""Where a node of a set binds, what it advertises, and which interface Gloo/NCCL/RCCL use.

Resolved on the node itself, at start, never at render time:
- the head address is the recipe's `topology.address` (`${M3PATCH_HEAD_ADDR}` in the shipped
  recipes), resolved to an IPv4 address on the head and checked to be one of the head's own.
  Every other node takes it from the head's rendezvous record, so all nodes use the one IP the
  head resolved, whatever their own resolvers say;
- a node's own address is `network.address`, else VLLM_HOST_IP when exported, else the source
  address of this host's route to the head (the address the head can reach it at);
- the interface is `network.interface`, else the one holding the node's address.
Loopback is used only when the recipe's head address is loopback itself (every node on one
host, asked for by the recipe). Nothing falls back to 127.0.0.1: a missing or unresolvable
address is NodeAddress (28) before any server starts.
"""

from __future__ import annotations

import contextlib
import fcntl
import ipaddress
import os
import re
import socket
import struct
from dataclasses import dataclass

from m3patch.errors import NodeAddress
from m3patch.recipe.paths import expand_vars
from m3patch.recipe.topology import Network
from m3patch.schema import SchemaError

# The interface environment variables Gloo and NCCL read; RCCL reads NCCL's.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
HOST_IP_VAR = "VLLM_HOST_IP"
HEAD_HINT = ("export M3PATCH_HEAD_ADDR=<the head node's IP on the cluster network> on the head "
             "(the Slurm job sets it)")
_SIOCGIFADDR = 0x8915
_PLACEHOLDER = re.compile(r"@\{([a-z]+)\}")


@dataclass(frozen=True)
class NodeNetwork:
    address: str  # what the node binds (--host) and advertises (VLLM_HOST_IP, its record)
    interface: str  # GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME
    head_address: str  # the head's IP (--data-parallel-address; the proxy's front door)


# What `recipe show` and `serve --dry-run` print: each node resolves these at start.
SHOWN = NodeNetwork("<node-address>", "<node-interface>", "<head-address>")


def is_loopback(address: str) -> bool:
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False


def resolve_head(spec: str) -> str:
    """The head's IPv4 address from `topology.address`, resolved here (on the head)."""
    try:
        text = expand_vars(spec).strip()
    except SchemaError as exc:
        msg = f"topology.address {spec!r}: {exc}; a set never falls back to 127.0.0.1"
        raise NodeAddress(msg, hint=HEAD_HINT) from None
    if not text:
        msg = f"topology.address {spec!r} is empty here; a set never falls back to 127.0.0.1"
        raise NodeAddress(msg, hint=HEAD_HINT)
    try:
        infos = socket.getaddrinfo(text, None, socket.AF_INET, socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as exc:
        msg = f"the head address {text!r} (topology.address) does not resolve on this host: {exc}"
        raise NodeAddress(msg, hint=HEAD_HINT) from None
    return str(infos[0][4][0])


def is_local(address: str) -> bool:
    """Whether this host (this network namespace) holds `address`: it can bind it."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.bind((address, 0))
        except OSError:
            return False
    return True


def route_source(target: str) -> str:
    """The source address of this host's route to `target` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            sock.connect((target, 9))
        except OSError as exc:
            msg = f"this host has no route to the head address {target}: {exc.strerror}"
            raise NodeAddress(msg, hint="set network.address (or VLLM_HOST_IP) to this node's "
                                        "address on the cluster network") from None
        return str(sock.getsockname()[0])


def interface_of(address: str) -> str | None:
    """The interface whose (primary) IPv4 address is `address`."""
    if is_loopback(address):
        return "lo"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _index, name in socket.if_nameindex():
            with contextlib.suppress(OSError):
                reply = fcntl.ioctl(sock.fileno(), _SIOCGIFADDR,
                                    struct.pack("256s", name[:15].encode()))
                if socket.inet_ntoa(reply[20:24]) == address:
                    return name
    return None


def _expand(value: str, key: str) -> str:
    try:
        return expand_vars(value).strip()
    except SchemaError as exc:
        msg = f"topology.network.{key} {value!r}: {exc}"
        raise NodeAddress(msg, hint=f"set topology.network.{key} in the recipe") from None


def head_network(net: Network, head_spec: str) -> NodeNetwork:
    """The head's own network: the head address must be one of this host's."""
    head = resolve_head(head_spec)
    if not is_local(head):
        msg = (f"the head address {head} (topology.address {head_spec!r}) is not an address "
               "of this host; the head binds and advertises it")
        raise NodeAddress(msg, hint=f"run the head on the host that holds {head}, or {HEAD_HINT}")
    return NodeNetwork(head, _interface(net, head), head)


def node_network(net: Network, head: str) -> NodeNetwork:
    """A non-head node's network, given the IP the head published."""
    chosen = _expand(net.address, "address")
    if chosen == "auto":
        chosen = os.environ.get(HOST_IP_VAR, "").strip() or route_source(head)
    if not is_local(chosen):
        msg = f"this node's address {chosen} (network.address / {HOST_IP_VAR}) is not this host's"
        raise NodeAddress(msg, hint="set network.address to an address of this host, or unset it "
                                    "(auto: the route to the head)")
    if is_loopback(chosen) and not is_loopback(head):
        msg = (f"this node would advertise loopback {chosen} while the head is at {head}: the "
               "head and the other nodes could not reach it")
        raise NodeAddress(msg, hint=f"unset {HOST_IP_VAR}, or set network.address to this "
                                    "node's address on the cluster network")
    return NodeNetwork(chosen, _interface(net, chosen), head)


def _interface(net: Network, address: str) -> str:
    name = _expand(net.interface, "interface")
    if name == "auto":
        found = interface_of(address)
        if found is None:
            msg = f"no interface of this host holds {address} as its address"
            raise NodeAddress(msg, hint="set topology.network.interface (e.g. ${M3PATCH_IFNAME})")
        return found
    try:
        socket.if_nametoindex(name)
    except OSError:
        known = ", ".join(n for _i, n in socket.if_nameindex())
        msg = f"topology.network.interface {name!r} is not an interface of this host ({known})"
        raise NodeAddress(msg, hint="set topology.network.interface to one listed") from None
    return name


def substitute(value: str, values: dict[str, str]) -> str:
    """A recipe env value with the node's own `@{address}`, `@{interface}`, `@{head}`,
    `@{role}`, `@{rank}` filled in."""
    return _PLACEHOLDER.sub(lambda m: values[m.group(1)], value)


def node_env(net: NodeNetwork, role: str, rank: int, env: tuple[tuple[str, str], ...],
             site_env: tuple[tuple[str, str], ...] = ()) -> dict[str, str]:
    """What the network sets on a node: its address and interface, then the recipe's env and
    the network section's site values (`${VAR:-default}` expanded here, on the node) with the
    node's own placeholders filled in; the network section wins."""
    values = {"address": net.address, "interface": net.interface, "head": net.head_address,
              "role": role, "rank": str(rank)}
    out = {HOST_IP_VAR: net.address, **dict.fromkeys(IFNAME_VARS, net.interface)}
    out.update((key, substitute(value, values)) for key, value in env)
    for key, value in site_env:
        out[key] = substitute(value if net is SHOWN else _expand(value, f"env.{key}"), values)
    return out
