"""The recipe's deadlines: how long the server may take to be ready, one request, the whole run.

`ready-s` bounds the wait for /health, `request-s` a silent request (and, per wave of requests,
a bench cell), `run-s` the whole serve / bench / ci run. For a multi-node set, `join-s` bounds
how long the head waits for every node's first record (and every node for the head's): a node
never started, or a run folder that is not shared, fails the set then, naming the nodes that
never arrived, not after the whole ready deadline. `probe-s` is the interval of the liveness
probe (a tiny bounded completion through each serving node once ready; 0 turns it off).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.schema import SchemaError, at_key, check_keys, expect_number

DEFAULT_JOIN_S = 300.0
DEFAULT_PROBE_S = 30.0


@dataclass(frozen=True)
class Deadlines:
    ready_s: float
    request_s: float
    run_s: float
    join_s: float = DEFAULT_JOIN_S
    probe_s: float = DEFAULT_PROBE_S


def deadlines(data: dict[str, Any]) -> Deadlines:
    check_keys(data, optional=("ready-s", "request-s", "run-s", "join-s", "probe-s"))
    values = []
    for key, default in (("ready-s", 900.0), ("request-s", 120.0), ("run-s", 4 * 3600.0)):
        with at_key(key):
            values.append(expect_number(data.get(key, default), minimum=1.0))
    ready_s = values[0]
    with at_key("join-s"):
        join_s = expect_number(data.get("join-s", min(DEFAULT_JOIN_S, ready_s / 2)), minimum=1.0)
        if join_s >= ready_s:
            msg = f"join-s {join_s:g} must be shorter than ready-s {ready_s:g}"
            raise SchemaError(msg)
    with at_key("probe-s"):
        probe_s = expect_number(data.get("probe-s", DEFAULT_PROBE_S), minimum=0.0)
    return Deadlines(values[0], values[1], values[2], join_s, probe_s)
