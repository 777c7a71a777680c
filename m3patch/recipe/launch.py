"""How to launch `vllm serve`: server address, parallelism, environment and `vllm-args`.

`vllm-args` are flattened into `vllm serve` arguments the way `vllm serve --config` does: `key:
true` becomes `--key`, a list `--key a b`, a nested mapping `--key '<json>'`, and `key: false`
`--no-key` only when that option exists (vLLM silently drops it otherwise). m3patch renders
`false` as `--no-key` always and lets the target vLLM's own parser refuse a `--no-key` it does not
have (m3patch.serving.vllm_parser, before the node is used): a `false` the server would ignore is
a recipe that does not do what it says. Options m3patch sets from other sections are refused here.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_bool,
    expect_int,
    expect_str,
    expect_str_keys,
    finite_text,
)

_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


@dataclass(frozen=True)
class Parallelism:
    tp: int
    ep: int
    dp: int
    dp_attention: bool

    def argv(self) -> tuple[str, ...]:
        # vLLM's expert parallelism is a switch: EP size = TP x DP. DP-attention runs TP1 x DP.
        if self.dp_attention:
            return ("--tensor-parallel-size", "1", "--data-parallel-size", str(self.tp),
                    "--enable-expert-parallel")
        out = ["--tensor-parallel-size", str(self.tp)]
        if self.dp > 1:
            out += ["--data-parallel-size", str(self.dp)]
        if self.ep > 1:
            out.append("--enable-expert-parallel")
        return tuple(out)


def server(data: dict[str, Any]) -> tuple[str, int]:
    check_keys(data, optional=("host", "port"))
    with at_key("host"):
        host = expect_str(data.get("host", "127.0.0.1"))
    with at_key("port"):
        port = expect_int(data.get("port", 8765), minimum=1)
        if port > 65535:
            msg = f"port {port} is above 65535"
            raise SchemaError(msg)
    return host, port


def parallelism(data: dict[str, Any]) -> Parallelism:
    check_keys(data, optional=("tp", "ep", "dp", "dp-attention"))
    with at_key("tp"):
        tp = expect_int(data.get("tp", 1), minimum=1)
    with at_key("dp"):
        dp = expect_int(data.get("dp", 1), minimum=1)
    with at_key("dp-attention"):
        dp_attention = expect_bool(data.get("dp-attention", False))
    with at_key("ep"):
        ep = expect_int(data.get("ep", 1), minimum=1)
        # vLLM has no EP size: --enable-expert-parallel spans all TP x DP ranks.
        if ep not in (1, tp * dp):
            msg = f"ep must be 1 or tp x dp = {tp * dp} (vLLM's EP spans every rank), got {ep}"
            raise SchemaError(msg)
    return Parallelism(tp, ep, dp, dp_attention)


def env(data: dict[str, Any], *, expands: bool = False) -> tuple[tuple[str, str], ...]:
    """`expands`: the values are expanded as `${VAR:-default}` later (topology.network.env, on
    each node); any other env is handed to the server as written."""
    out = []
    for name, value in expect_str_keys(data).items():
        with at_key(name):
            if not _ENV_NAME.match(name):
                msg = f"{name!r} is not an environment variable name"
                raise SchemaError(msg)
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                msg = f"expected a string or number (quote booleans: \"1\"/\"0\"), got {value!r}"
                raise SchemaError(msg)
            if not expands and "${" in str(value):
                # the server would get the text `${VAR}` itself: no shell stands between them
                msg = (f"{value!r}: this env is passed to the server as written, `${{...}}` "
                       "and all; write the value itself, or export the variable in the shell "
                       "that runs m3patch (the server inherits it), or in a multi-node recipe "
                       "put it in topology.network.env, which expands it on each node")
                raise SchemaError(msg)
            out.append((name, finite_text(value)))
    return tuple(out)


# Set by m3patch itself from other recipe sections; a recipe must not set them twice.
RESERVED_FLAGS = {
    "model": "model.source", "model-tag": "model.source", "host": "server.host",
    "port": "server.port", "served-model-name": "model.served-name",
    "tensor-parallel-size": "parallelism.tp", "data-parallel-size": "parallelism.dp",
    "speculative-config": "speculative", "config": "(m3patch passes arguments itself)",
}


def _scalar(value: object) -> str:
    if isinstance(value, bool) or value is None or isinstance(value, (dict, list)):
        msg = f"expected a string or number, got {type(value).__name__}"
        raise SchemaError(msg)
    # a YAML date (`revision: 2024-05-01`) is its text, as before
    return finite_text(value) if isinstance(value, (str, int, float)) else str(value)


def _json(value: dict[str, Any]) -> str:
    try:
        return json.dumps(value, separators=(",", ":"), sort_keys=False, allow_nan=False)
    except ValueError:  # allow_nan=False: JSON has no NaN or infinity (json.dumps writes `NaN`)
        msg = "expected finite numbers (JSON has no NaN or infinity)"
        raise SchemaError(msg) from None


def _one_flag(key: str, value: Any) -> list[str]:
    flag = f"--{key}"
    if value is True:
        return [flag]
    if value is False:
        # Whether --no-KEY exists is the target vLLM parser's to say (serving.vllm_parser
        # refuses a `false` it would not parse), not a hand-kept list's.
        return [f"--no-{key}"]
    if isinstance(value, dict):
        return [flag, _json(value)]
    if isinstance(value, list):
        if not value:
            msg = "an empty list would be dropped silently by vLLM; remove the key"
            raise SchemaError(msg)
        items = []
        for index, item in enumerate(value):
            with at_key(index):
                items.append(_scalar(item))
        return [flag, *items]
    if value is None:
        msg = "null is not a value; remove the key"
        raise SchemaError(msg)
    return [flag, _scalar(value)]


def flatten_vllm_args(args: Mapping[str, Any]) -> tuple[str, ...]:
    """`{'max-model-len': 512, 'enforce-eager': True}` -> `('--max-model-len', '512', '--enforce-eager')`."""
    argv: list[str] = []
    seen: dict[str, str] = {}
    for raw_key, value in expect_str_keys(args).items():
        with at_key(raw_key):
            key = _option_name(raw_key)
            if key in seen:  # argparse would keep the later one without a word
                msg = f"the same option as {seen[key]!r} (vLLM reads '_' as '-'): keep one"
                raise SchemaError(msg)
            seen[key] = raw_key
            argv.extend(_one_flag(key, value))
    return tuple(argv)


def _option_name(raw_key: str) -> str:
    """The option a key names, '_' read as '-' as vLLM does. A dotted key (`compilation-config.
    level`) sets one field of a JSON option: its option must not be one m3patch sets itself."""
    if raw_key.startswith("-") or not raw_key:
        msg = f"write the option name without dashes, e.g. {raw_key.lstrip('-')!r}"
        raise SchemaError(msg)
    if "=" in raw_key or any(c.isspace() for c in raw_key):
        msg = "write the option name alone as the key and its value as the value"
        raise SchemaError(msg)
    option, dot, field = raw_key.partition(".")
    option = option.replace("_", "-")  # a JSON field keeps its own spelling
    if option in RESERVED_FLAGS:
        msg = f"set this through {RESERVED_FLAGS[option]} instead"
        raise SchemaError(msg)
    return f"{option}{dot}{field}"
