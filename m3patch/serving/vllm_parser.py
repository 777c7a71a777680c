"""vLLM validates the launch: the rendered argv through the target interpreter's own parser.

Before a node is used (`serve --dry-run`, the preflight of `serve`, `bench` and `ci`), the
arguments after `vllm serve` are parsed by the `vllm serve` parser of the vLLM the launch
interpreter imports (vllm_cli_probe.py, run by that interpreter in a subprocess with a
deadline; no engine starts), and the recipe's environment is checked against that vLLM's
known variables (the keys of `environment_variables` in its envs.py, read as an AST: vLLM
itself only warns "Unknown vLLM environment variable detected" and runs on). Every finding
names the recipe key that produced it.

What the parser accepts silently but a recipe must not rely on is refused too: an option
prefix (vLLM's parser allows abbreviations: `max-num-batched-token` becomes
`--max-num-batched-tokens`), a value given to a switch, `key: false` where vLLM has no `--no-key`
(the parser's BooleanOptionalAction actions say which do), and unknown keys inside a JSON option
whose config class vLLM only builds when the engine starts (`--speculative-config`).

The parser's actions are cached per interpreter and vLLM version (`cached_actions`), so
read-only commands can use them without starting the interpreter.

Pure: `argv_sources`, `argv_findings`, `env_findings`, `known_env_vars`. Effects: `run_probe`
(spawns), the cache (through fsio), `check_launch`.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch.errors import LaunchRejected, M3PatchError, VllmNotFound
from m3patch.fsio import parse_json, read_json, write_json_atomic
from m3patch.output import info, warn
from m3patch.patching.ledger import ledger_path
from m3patch.patching.locate import VllmTree, find_vllm
from m3patch.patching.pristine import cache_root, cached_file
from m3patch.recipe.loader import Recipe
from m3patch.schema import suggest

PROBE_SOURCE = Path(__file__).with_name("vllm_cli_probe.py")
RESULT_PREFIX = "M3PATCH_PROBE_JSON: "
DEADLINE_ENV = "M3PATCH_VLLM_PARSER_TIMEOUT"
DEFAULT_DEADLINE_S = 300.0  # importing vLLM's CLI (torch included) takes 15-40 s on a busy host
CACHE_SCHEMA = 1
# Options m3patch renders from other recipe sections: a finding on them names that section.
OWN_OPTIONS = {
    "--host": "server.host", "--port": "server.port", "--served-model-name": "model.served-name",
    "--revision": "model.revision", "--tensor-parallel-size": "parallelism.tp",
    "--data-parallel-size": "parallelism.dp", "--enable-expert-parallel": "parallelism.ep",
    "--speculative-config": "speculative",
}
_OPTION = re.compile(r"--[A-Za-z0-9][A-Za-z0-9_.\-]*")


@dataclass(frozen=True)
class ArgSource:
    """One option (or the positional model) of the rendered argv and the recipe key behind it."""

    key: str
    option: str | None  # None: the positional model
    values: tuple[str, ...]


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
class LaunchCheck:
    checked_by: str  # what checked the launch, for the dry-run's header line
    vllm_parser: bool  # False: no target interpreter with vLLM here; static checks only


# ---- pure ----------------------------------------------------------------------------------

def argv_sources(recipe: Recipe) -> tuple[ArgSource, ...]:
    """The argv after `vllm serve`, split per option, each with the recipe key it came from."""
    args = recipe.serve_args()
    first_vllm_arg = len(args) - len(recipe.vllm_args)
    out = [ArgSource("model.source", None, (args[0],))]
    index = 1
    while index < len(args):
        option = args[index]
        end = index + 1
        while end < len(args) and not _OPTION.fullmatch(args[end]):
            end += 1
        name = option.split("=", 1)[0]
        key = (f"vllm-args.{name[2:].removeprefix('no-') if name.startswith('--no-') else name[2:]}"
               if index >= first_vllm_arg else OWN_OPTIONS.get(name, name))
        out.append(ArgSource(key, option, tuple(args[index + 1:end])))
        index = end
    return tuple(out)


def _option_name(option: str) -> str:
    """What vLLM's parser looks up: before `=` and the first `.`, underscores as dashes."""
    name = option.split("=", 1)[0].split(".", 1)[0]
    return "--" + name[2:].replace("_", "-")


def _one_source(src: ArgSource, actions: ParserActions) -> list[str]:
    assert src.option is not None
    name = _option_name(src.option)
    action = actions.options.get(name)
    if action is None:
        return [f"{src.key}: {_unknown_option(name, actions)}"]
    if not action["takes_value"] and src.values:
        return [f"{src.key}: {name} is a switch and takes no value, got {' '.join(src.values)!r}; "
                f"write `true` (or `false` where vLLM has --no-{name[2:]})"]
    choices = action["choices"]
    bad = [v for v in src.values if choices is not None and v not in choices]
    if bad:
        return [f"{src.key}: {bad[0]!r} is not a choice of {name} "
                f"({', '.join(choices)}).{suggest(bad[0], choices)}"]
    return []


def _unknown_option(name: str, actions: ParserActions) -> str:
    longer = sorted(o for o in actions.options if o.startswith(name) and o != name)
    if longer:
        return (f"{name} is an abbreviation: vLLM's parser would silently take it as {longer[0]}; "
                f"write the option in full ({longer[0][2:]!r})")
    plain = "--" + name.removeprefix("--no-")
    if name.startswith("--no-") and plain in actions.options:
        return (f"`{plain[2:]}: false` would be dropped: vLLM {actions.vllm_version} has no {name} "
                f"(only {plain}); remove the key (off is its default)")
    options = [o for o in actions.options if o.startswith("--")]
    return f"vLLM {actions.vllm_version} has no option {name}.{suggest(name, options)}"


def argv_findings(sources: tuple[ArgSource, ...], actions: ParserActions) -> list[str]:
    """What vLLM's parser says about each option, by recipe key (empty: accepted)."""
    out: list[str] = []
    for src in sources:
        if src.option is not None:
            out += _one_source(src, actions)
    return out


def parse_error_finding(message: str, sources: tuple[ArgSource, ...]) -> str:
    """vLLM's own parse error, prefixed by the recipe key it is about where it names one."""
    for src in sources:
        if src.option is not None and re.search(rf"{re.escape(_option_name(src.option))}\b",
                                                message):
            return f"{src.key}: vLLM's parser: {message}"
    for src in sources:
        if any(v and v in message for v in src.values):
            return f"{src.key}: vLLM's parser: {message}"
    return f"vLLM's parser: {message}"


def unknown_key_findings(unknown: list[dict[str, Any]], sources: tuple[ArgSource, ...]) -> list[str]:
    out = []
    for item in unknown:
        src = next((s for s in sources if s.option and _option_name(s.option) == item["option"]),
                   None)
        where = f"{src.key}.{item['key']}" if src else f"{item['option']} {item['key']}"
        out.append(f"{where}: {item['option']} has no key {item['key']!r} (vLLM would refuse it "
                   f"only when the engine starts).{suggest(item['key'], item['known'])}")
    return out


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


def env_findings(env: tuple[tuple[str, str], ...], known: frozenset[str], version: str) -> list[str]:
    out = []
    for name, _value in env:
        if name.startswith("VLLM_") and name not in known:
            out.append(f"env.{name}: vLLM {version} has no such variable (it would only warn "
                       f"'Unknown vLLM environment variable detected' and ignore it)."
                       f"{suggest(name, known)}")
    return out


def _answer_fields_ok(data: dict[str, Any]) -> bool:
    """The parse verdict beside the actions: an optional error string and a list of
    {option, key, known: [str]} for JSON options' unknown keys."""
    unknown = data.get("unknown_keys", [])
    return (data.get("parse_error") is None or isinstance(data["parse_error"], str)) and (
        isinstance(unknown, list) and all(
            isinstance(u, dict) and isinstance(u.get("option"), str)
            and isinstance(u.get("key"), str) and isinstance(u.get("known"), list)
            and all(isinstance(k, str) for k in u["known"]) for u in unknown))


def actions_from_dump(data: object, where: str) -> ParserActions:
    """The probe's (or the cache's) dump, checked like hostile input: the actions and the
    parse verdict the caller reads beside them."""
    def bad(why: str) -> LaunchRejected:
        return LaunchRejected(f"{where}: {why}", hint="delete the file (the probe writes it again)")

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
        ok = (isinstance(action, dict) and isinstance(action.get("options"), list)
              and all(isinstance(o, str) for o in action["options"])
              and isinstance(action.get("takes_value"), bool)
              and isinstance(action.get("negatable"), bool)
              and (action.get("choices") is None or (isinstance(action["choices"], list) and all(
                  isinstance(c, str) for c in action["choices"]))))
        if not ok:
            why = f"malformed action {str(action)[:120]}"
            raise bad(why)
        for option in action["options"]:
            options[option] = action
    return ParserActions(version, options)


# ---- effects -------------------------------------------------------------------------------

def deadline_s() -> float:
    raw = os.environ.get(DEADLINE_ENV)
    if raw is None:
        return DEFAULT_DEADLINE_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 < value < float("inf"):
        msg = f"{DEADLINE_ENV}={raw!r} is not a positive number of seconds"
        raise LaunchRejected(msg, hint=f"unset {DEADLINE_ENV} or set it to e.g. 300")
    return value


def run_probe(python: str, argv: list[str] | None, env: Mapping[str, str]) -> dict[str, Any]:
    """The probe's JSON from `python` (its own vLLM); a deadline, and no engine is started."""
    request = json.dumps({"argv": argv})
    limit = deadline_s()
    fix = f"check that `{python} -c 'import vllm'` works, or raise {DEADLINE_ENV}"
    try:
        proc = subprocess.run(
            [python, "-c", PROBE_SOURCE.read_text(encoding="utf-8")], input=request,
            capture_output=True, text=True, check=False, timeout=limit, cwd="/",
            env={**env, "VLLM_CONFIGURE_LOGGING": "0"})
    except subprocess.TimeoutExpired:
        msg = f"vLLM's argument parser in {python} did not answer within {limit:.0f} s"
        raise LaunchRejected(msg, hint=fix) from None
    except OSError as exc:
        msg = f"cannot run {python} to check the launch with vLLM's parser: {exc}"
        raise LaunchRejected(msg, hint=fix) from None
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr.strip() or proc.stdout.strip())[-600:]
        msg = f"vLLM's argument parser in {python} failed (exit {proc.returncode}): {tail}"
        raise LaunchRejected(msg, hint=fix)
    where = f"vLLM's argument parser in {python} printed"
    data: dict[str, Any] = parse_json(lines[-1].removeprefix(RESULT_PREFIX), where,
                                      error=LaunchRejected, hint=fix, expect=dict)
    return data


def cache_path(python: str, version: str) -> Path:
    key = hashlib.sha256(os.path.realpath(python).encode()).hexdigest()[:16]
    return cache_root() / "vllm-cli" / f"{key}-{version}.json"


def cached_actions(python: str, version: str) -> ParserActions | None:
    """The parser dump a previous check cached for this interpreter and vLLM version."""
    path = cache_path(python, version)
    if not path.is_file():
        return None
    data = read_json(path, error=LaunchRejected, hint=f"delete {path}", expect=dict)
    actions = actions_from_dump(data, str(path))
    return actions if actions.vllm_version == version else None


def verdict_key(python: str, tree: VllmTree, argv: list[str], env: Mapping[str, str]) -> str:
    """What the probe's answer depends on: the interpreter, the tree it imports (version,
    commit, and the ledger, which changes whenever a series rewrites files), the argv and the
    VLLM_* environment. Any change asks vLLM's parser again."""
    ledger = _read_or_none(ledger_path(tree.root)) or b""
    # The port is the recipe's checked 1-65535 integer (or a free one a test picked): the same
    # launch on another port gets the same answer.
    keyed = [("<port>" if i and argv[i - 1] == "--port" else a) for i, a in enumerate(argv)]
    parts = [os.path.realpath(python), str(tree.root.resolve()), tree.version, tree.commit or "",
             hashlib.sha256(ledger).hexdigest(), json.dumps(keyed),
             json.dumps(sorted((k, v) for k, v in env.items() if k.startswith("VLLM_")))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def probe_once(python: str, tree: VllmTree, argv: list[str],
               env: Mapping[str, str]) -> dict[str, Any]:
    """The probe's answer for this exact launch, from the verdict cache when the same launch
    was asked of the same tree before: importing vLLM costs 10-40 s per serve on a 2-core
    host, and a sweep restarts the same launch for every run. The cached answer is validated
    like the probe's own before use."""
    path = cache_root() / "vllm-cli" / "verdicts" / f"{verdict_key(python, tree, argv, env)}.json"
    if path.is_file():
        try:
            cached: dict[str, Any] = read_json(path, error=LaunchRejected, hint=f"delete {path}",
                                               expect=dict)
            actions_from_dump(cached, str(path))
            return cached
        except LaunchRejected:
            pass  # a bad cache entry is asked again and overwritten
    dump = run_probe(python, argv, env)
    if not isinstance(dump.get("no_vllm"), str):
        try:
            write_json_atomic(path, dump)
        except M3PatchError as exc:  # a cache that cannot be written only costs the next run time
            warn(f"could not cache vLLM's parser answer: {exc.message}")
    return dump


def _store(python: str, version: str, dump: dict[str, Any]) -> None:
    keep = {"schema": CACHE_SCHEMA, "python": os.path.realpath(python),
            "vllm_version": dump["vllm_version"], "actions": dump["actions"]}
    try:
        write_json_atomic(cache_path(python, version), keep)
    except M3PatchError as exc:  # a cache that cannot be written only costs the next run time
        warn(f"could not cache vLLM's parser options: {exc.message}")


def _static_fallback(recipe: Recipe, why: str, envs: bytes | None = None,
                     envs_from: str = "the tree") -> LaunchCheck:
    """No interpreter with vLLM here (a GPU recipe checked on a laptop): say so; check env
    names against the given envs.py, else the cached pristine tree of the target version."""
    if envs is None:
        envs = cached_file(recipe.target.vllm_version, "vllm/envs.py")
        envs_from = "the cached pristine tree"
    findings = ([] if envs is None else
                env_findings(recipe.env, known_env_vars(envs), recipe.target.vllm_version))
    _refuse(recipe, findings)
    checked = f"env names against {envs_from}" if envs is not None else "schema only"
    info(f"not checked by vLLM's parser: {why}; static checks only ({checked})")
    return LaunchCheck(f"static checks ({checked}); {why}", vllm_parser=False)


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _refuse(recipe: Recipe, findings: list[str]) -> None:
    if findings:
        lines = "\n".join(f"  - {f}" for f in findings)
        msg = f"{recipe.path}: vLLM would not run this launch as written:\n{lines}"
        raise LaunchRejected(msg, hint=f"fix those keys in {recipe.path}; re-check with "
                                       f"`m3patch serve {recipe.path} --dry-run`")


def check_launch(recipe: Recipe, python: str,
                 env: Mapping[str, str] | None = None) -> LaunchCheck:
    """Parse the launch with `python`'s own vLLM and check the env names; LaunchRejected (24)
    naming every bad recipe key. No vLLM importable by `python`: static checks, said so."""
    if not Path(python).exists():
        return _static_fallback(recipe, f"no target interpreter at {python}")
    try:
        tree = find_vllm(python=python)
    except VllmNotFound as exc:
        return _static_fallback(recipe, exc.message)
    sources = argv_sources(recipe)
    dump = probe_once(python, tree, list(recipe.serve_args()),
                      env if env is not None else dict(os.environ))
    if isinstance(dump.get("no_vllm"), str):  # a tree given by --vllm-root the interpreter lacks
        envs = _read_or_none(tree.package_dir / "envs.py")
        return _static_fallback(recipe, f"{python} cannot import vllm ({dump['no_vllm']})", envs,
                                str(tree.package_dir / "envs.py"))
    actions = actions_from_dump(dump, f"vLLM's parser in {python}")
    _store(python, tree.version, dump)
    findings = argv_findings(sources, actions)
    parse_error = dump.get("parse_error")
    if not findings and isinstance(parse_error, str):
        findings.append(parse_error_finding(parse_error, sources))
    findings += unknown_key_findings(dump.get("unknown_keys", []), sources)
    envs_file = tree.package_dir / "envs.py"
    try:
        known = known_env_vars(envs_file.read_bytes())
    except OSError as exc:
        msg = f"cannot read vLLM's known environment variables from {envs_file}: {exc}"
        raise LaunchRejected(msg, hint=f"check the tree `{python}` imports") from None
    findings += env_findings(recipe.env, known, tree.version)
    _refuse(recipe, findings)
    return LaunchCheck(f"vLLM {tree.version}'s own parser ({python})", vllm_parser=True)


def check_cached(recipe: Recipe) -> bool:
    """`recipe validate` (read-only, spawns nothing): the parser options a previous check cached
    for the recipe's interpreter and vLLM version, and env names from the cached pristine tree.
    True when the cached parser was there to check with."""
    version = recipe.target.vllm_version
    actions = (cached_actions(recipe.target.python, version)
               if recipe.target.python is not None else None)
    findings = [] if actions is None else argv_findings(argv_sources(recipe), actions)
    envs = cached_file(version, "vllm/envs.py")
    if envs is not None:
        findings += env_findings(recipe.env, known_env_vars(envs), version)
    _refuse(recipe, findings)
    return actions is not None
