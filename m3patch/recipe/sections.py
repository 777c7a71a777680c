"""Section parsers of a recipe (target, model, server, parallelism, env, markers, deadlines).

Each takes the raw mapping of its section (breadcrumbs are added by the caller) and returns a
frozen value. Split from recipe.py to keep both modules short.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.markers import MarkerSpec
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_bool,
    expect_choice,
    expect_int,
    expect_list,
    expect_mapping,
    expect_number,
    expect_str,
)

PLATFORMS = ("cpu", "cuda", "rocm-gfx942", "rocm-gfx950")
LOCAL_PREFIXES = ("/", "~", "./", "../", "$")
_VAR = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def expand(text: str) -> str:
    """`~` and `${VAR}` / `${VAR:-default}`; an unset variable without default is an error."""
    def one(match: re.Match[str]) -> str:
        value = os.environ.get(match.group(1)) or match.group(2)
        if value is None:
            msg = f"environment variable {match.group(1)} is not set (no default given)"
            raise SchemaError(msg)
        return value
    return str(Path(_VAR.sub(one, text)).expanduser())


@dataclass(frozen=True)
class Target:
    platform: str
    vllm_version: str
    image: str | None
    python: str | None


@dataclass(frozen=True)
class ModelSpec:
    source: str          # what vLLM is given: a local directory or a Hugging Face id
    is_local: bool
    served_name: str
    tokenizer: str       # for the bench client (a local dir avoids a hub lookup)
    draft: str | None
    revision: str | None = None  # a hub model's pinned commit (40 hex); None: whatever `main` is


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


@dataclass(frozen=True)
class Deadlines:
    ready_s: float
    request_s: float
    run_s: float


def _opt_str(data: dict[str, Any], key: str) -> str | None:
    if data.get(key) is None:
        return None
    with at_key(key):
        return expect_str(data[key])


def target(data: dict[str, Any]) -> Target:
    check_keys(data, required=("platform", "vllm-version"), optional=("image", "python"))
    with at_key("platform"):
        platform = expect_choice(data["platform"], PLATFORMS)
    with at_key("vllm-version"):
        version = expect_str(data["vllm-version"])
    python = _opt_str(data, "python")
    with at_key("python"):
        python = expand(python) if python else None
    return Target(platform, version, _opt_str(data, "image"), python)


def _source(text: str) -> tuple[str, bool]:
    """A path (starts with / ~ ./ ../ or ${VAR}) is expanded; anything else is a hub id."""
    if text.startswith(LOCAL_PREFIXES):
        return str(Path(expand(text)).absolute()), True
    return text, False


def _revision(data: dict[str, Any], is_local: bool) -> str | None:
    """A full commit: a branch or tag can move, and then the same recipe serves other weights."""
    text = _opt_str(data, "revision")
    with at_key("revision"):
        if text is not None and not _COMMIT.match(text):
            msg = (f"{text!r} is not a full 40-hex commit (a branch or tag can move; pin the "
                   f"commit its page shows)")
            raise SchemaError(msg)
        if text is not None and is_local:
            msg = "a revision pins a Hugging Face model; model.source is a local folder"
            raise SchemaError(msg)
    return text


def model(data: dict[str, Any]) -> ModelSpec:
    check_keys(data, required=("source", "served-name"),
               optional=("tokenizer", "draft", "revision"))
    with at_key("source"):
        source, is_local = _source(expect_str(data["source"]))
    with at_key("served-name"):
        served = expect_str(data["served-name"])
    tokenizer = _opt_str(data, "tokenizer")
    with at_key("tokenizer"):
        tokenizer = _source(tokenizer)[0] if tokenizer else source
    draft = _opt_str(data, "draft")
    return ModelSpec(source, is_local, served, tokenizer, _source(draft)[0] if draft else None,
                     _revision(data, is_local))


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


def env(data: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    out = []
    for name, value in data.items():
        with at_key(name):
            if not _ENV_NAME.match(name):
                msg = f"{name!r} is not an environment variable name"
                raise SchemaError(msg)
            if isinstance(value, bool) or not isinstance(value, (str, int, float)):
                msg = f"expected a string or number (quote booleans: \"1\"/\"0\"), got {value!r}"
                raise SchemaError(msg)
            out.append((name, str(value)))
    return tuple(out)


def _marker_list(raw: object, kind: str, source: str) -> list[MarkerSpec]:
    out = []
    for index, item in enumerate(expect_list(raw)):
        with at_key(index):
            data = expect_mapping(item)
            optional = ("count",) if kind == "required" else ()
            check_keys(data, required=("id", "text"), optional=optional)
            count = None
            if "count" in data:
                with at_key("count"):
                    count = expect_int(data["count"], minimum=1)
            out.append(MarkerSpec(expect_str(data["id"]), "required" if kind == "required"
                                  else "forbidden", expect_str(data["text"]), source, count))
    return out


def markers(data: dict[str, Any], *, source: str) -> tuple[tuple[MarkerSpec, ...],
                                                          tuple[tuple[str, int], ...],
                                                          tuple[tuple[str, str], ...]]:
    """(the recipe's own markers, expected counts by id, waivers of series markers by id).

    A waiver needs a reason: it is printed at every launch and in `recipe show`, so dropping a
    series marker is always visible (e.g. a backend choice that never reaches the patched path).
    """
    check_keys(data, optional=("required", "forbidden", "counts", "waive"))
    specs: list[MarkerSpec] = []
    for kind in ("required", "forbidden"):
        with at_key(kind):
            specs += _marker_list(data.get(kind, []), kind, source)
    counts = []
    with at_key("counts"):
        for marker_id, value in expect_mapping(data.get("counts", {})).items():
            with at_key(marker_id):
                counts.append((marker_id, expect_int(value, minimum=1)))
    waivers = []
    with at_key("waive"):
        for marker_id, reason in expect_mapping(data.get("waive", {})).items():
            with at_key(marker_id):
                waivers.append((marker_id, expect_str(reason)))
    return tuple(specs), tuple(counts), tuple(waivers)


def deadlines(data: dict[str, Any]) -> Deadlines:
    check_keys(data, optional=("ready-s", "request-s", "run-s"))
    values = []
    for key, default in (("ready-s", 900.0), ("request-s", 120.0), ("run-s", 4 * 3600.0)):
        with at_key(key):
            values.append(expect_number(data.get(key, default), minimum=1.0))
    return Deadlines(*values)
