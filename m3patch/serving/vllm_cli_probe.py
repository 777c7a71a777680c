"""Run by the TARGET interpreter (never imported by m3patch): vLLM's own `vllm serve` parser.

`m3patch.serving.vllm_parser` passes this file's text to `python -c` with a JSON request on
stdin: {"argv": [...], "spec": bool} (the arguments after `vllm serve`). It builds the parser
exactly as `vllm serve` does (`make_arg_parser` on a `FlexibleArgumentParser`), dumps its
actions (every option string the parser accepts, hidden ones included) and the vLLM files it was
built from, and parses the argv without abbreviations, turning argparse's exit into a message;
with "spec", also each JSON option's config-class keys (the series' launch spec). `import vllm`
failing for want of vllm itself is "no_vllm"; failing for any other reason is "import_error".
Nothing here starts an engine or touches a device: only the CLI modules are imported. It depends
on the standard library and vLLM only, and prints one line `M3PATCH_PROBE_JSON: {...}` on stdout
(vLLM may log to stdout too).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import json
import sys
from typing import Any

RESULT_PREFIX = "M3PATCH_PROBE_JSON: "
# Where `make_arg_parser` (the serve parser) lives, newest first: 0.33 moved it to common/.
PARSER_MODULES = ("vllm.entrypoints.common.cli_args", "vllm.entrypoints.launchers.cli_args",
                  "vllm.entrypoints.openai.cli_args")


class ParseRefused(Exception):
    pass


def _serve_parser() -> tuple[Any, Any]:
    from vllm.utils.argparse_utils import FlexibleArgumentParser  # type: ignore[import-not-found]

    for name in PARSER_MODULES:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError:
            continue
        parser = module.make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))
        return parser, getattr(module, "validate_parsed_serve_args", None)
    msg = f"no make_arg_parser in {', '.join(PARSER_MODULES)}"
    raise ImportError(msg)


def _action(action: argparse.Action, registered: list[str]) -> dict[str, Any]:
    choices = action.choices
    return {
        # Every string the parser accepts for it: vLLM hides some from `option_strings` (0.33's
        # EnableDisableAction keeps `--no-enable-x` registered but shows `--disable-x` only).
        "options": sorted(set(action.option_strings) | set(registered)), "dest": action.dest,
        "takes_value": action.nargs != 0,
        "negatable": isinstance(action, argparse.BooleanOptionalAction),
        "choices": None if choices is None else [str(c) for c in choices],
    }


def _config_classes() -> dict[str, Any]:
    """dest -> the config dataclass a JSON option's keys must name (`speculative_config` ->
    SpeculativeConfig): vLLM builds that class from the dict only when the engine starts."""
    import vllm.config as config  # type: ignore[import-not-found]

    return {name.lower(): getattr(config, name) for name in dir(config)
            if name.endswith("Config")}


def _unknown_keys(namespace: argparse.Namespace, actions: list[argparse.Action],
                  argv: list[str]) -> list[dict[str, Any]]:
    given = {a.split("=", 1)[0].replace("_", "-") for a in argv if a.startswith("--")}
    classes = _config_classes()
    out = []
    for action in actions:
        value = getattr(namespace, action.dest, None)
        option = next((o for o in action.option_strings if o in given), None)
        cls = classes.get(action.dest.replace("_", ""))
        if option is None or not isinstance(value, dict) or cls is None:
            continue
        if not dataclasses.is_dataclass(cls):
            continue
        known = sorted(f.name for f in dataclasses.fields(cls))
        for key in value:
            if key not in known:
                out.append({"option": option, "key": key, "known": known})
    return out


def _parse(parser: Any, validate: Any, argv: list[str]) -> tuple[str | None, argparse.Namespace | None]:
    def refuse(message: str) -> Any:
        raise ParseRefused(message)

    parser.allow_abbrev = False  # vLLM allows prefixes; a recipe must spell the option out
    parser.error = refuse
    try:
        namespace = parser.parse_args(argv)
        if validate is not None:
            validate(namespace)
    except (ParseRefused, ValueError, TypeError) as exc:  # vLLM's validators raise the latter
        return str(exc), None
    return None, namespace


def _json_keys(actions: list[argparse.Action]) -> dict[str, list[str]]:
    """For the shipped spec: each JSON option's config-class keys (first option string)."""
    classes = _config_classes()
    out = {}
    for action in actions:
        cls = classes.get(action.dest.replace("_", ""))
        if cls is not None and dataclasses.is_dataclass(cls):
            out[action.option_strings[0]] = sorted(f.name for f in dataclasses.fields(cls))
    return out


def _vllm_files(init_file: str) -> list[str]:
    """The tree's files this answer came from (paths below the package): the caller keys its
    cache on their contents, so a series that patches none of them keeps the answer."""
    from pathlib import Path

    package = Path(init_file).resolve().parent
    out = set()
    for module in list(sys.modules.values()):
        path = getattr(module, "__file__", None)
        if isinstance(path, str):
            real = Path(path).resolve()
            if package in real.parents:
                out.add(real.relative_to(package).as_posix())
    return sorted(out)


def _say(result: dict[str, Any]) -> None:
    sys.stdout.write("\n" + RESULT_PREFIX + json.dumps(result) + "\n")
    sys.stdout.flush()


def main() -> None:
    request = json.loads(sys.stdin.read())
    try:
        import vllm
    except ModuleNotFoundError as exc:
        if exc.name != "vllm":  # vLLM is there but one of its imports is missing: not "no vLLM"
            _say({"import_error": f"{type(exc).__name__}: {exc}"})
            return
        _say({"no_vllm": str(exc)})  # the caller checks with the series' spec and says why
        return
    except Exception as exc:  # any failure importing vLLM is the answer
        _say({"import_error": f"{type(exc).__name__}: {exc}"})
        return
    parser, validate = _serve_parser()
    actions = [a for a in parser._actions if a.option_strings]
    result: dict[str, Any] = {
        "vllm_version": getattr(vllm, "__version__", "unknown"),
        "vllm_file": vllm.__file__,
        "actions": [_action(a, [o for o, r in parser._option_string_actions.items() if r is a])
                    for a in actions],
    }
    argv = request.get("argv")
    if argv is not None:
        error, namespace = _parse(parser, validate, argv)
        result["parse_error"] = error
        result["unknown_keys"] = [] if namespace is None else _unknown_keys(namespace, actions, argv)
    if request.get("spec"):
        result["json_keys"] = _json_keys(actions)
    result["vllm_files"] = _vllm_files(vllm.__file__)
    _say(result)


if __name__ == "__main__":
    main()
