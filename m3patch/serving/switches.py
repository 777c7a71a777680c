"""m3patch's own switches: the `M3PATCH_*` variables a recipe or the shell hands the server.

A series' patches read their gates in the server process (`M3PATCH_MXFP8_MOE=block_fp8`); a bad
value raises only when the model loads on the GPU, minutes into a launch. The series declares
each switch and its values (series.yaml `switches:`), so the launch check refuses a bad one
before any node is used, naming the recipe key, or the shell variable the server would inherit.

Pure.
"""

from __future__ import annotations

from collections.abc import Mapping

from m3patch.patching.series import Switch
from m3patch.schema import suggest

PREFIX = "M3PATCH_"
# Variables m3patch itself reads (never the server): in a recipe's env they do nothing.
TOOL_ENV = frozenset({
    "M3PATCH_CACHE", "M3PATCH_SERIES", "M3PATCH_VLLM_ROOT", "M3PATCH_CPU_VENV",
    "M3PATCH_LOCK_TIMEOUT", "M3PATCH_VLLM_PARSER_TIMEOUT", "M3PATCH_LM_EVAL_PYTHON",
    "M3PATCH_LM_EVAL_VENV", "M3PATCH_SITE_HOOK", "M3PATCH_HEAD_ADDR", "M3PATCH_CMD",
    "M3PATCH_RUN_DIR", "M3PATCH_DEBUG_TRACEBACK", "M3PATCH_CRASH_DIR", "M3PATCH_FAULT",
    "M3PATCH_PYTHON", "M3PATCH_TUNE_VLLM_SOURCE", "M3PATCH_PRISTINE_SOURCE",
})


def _value_finding(where: str, switch: Switch, value: str) -> list[str]:
    given = value.strip().lower()
    if not given or given in switch.values:  # unset or empty is the patch's default
        return []
    return [f"{where}: {value!r} is not a value of {switch.name} ({'|'.join(switch.values)}, "
            f"read by patch {switch.patch}; it would raise when the model loads)."
            f"{suggest(given, switch.values)}"]


def _name_finding(where: str, name: str, switches: Mapping[str, Switch]) -> str:
    if name in TOOL_ENV:
        return (f"{where}: {name} is read by m3patch, not by the server; set it in the shell "
                "that runs m3patch, not in the recipe's env")
    known = ", ".join(sorted(switches)) or "none"
    return f"{where}: the series has no switch {name} (its switches: {known}).{suggest(name, switches)}"


def switch_findings(recipe_env: tuple[tuple[str, str], ...], process_env: Mapping[str, str],
                    switches: Mapping[str, Switch]) -> list[str]:
    """The recipe's `M3PATCH_*` env entries (every name must be a series switch) and the
    shell's (a switch's value, or a name that is a near miss of one), by where they come from."""
    out: list[str] = []
    set_by_recipe = {name for name, _ in recipe_env}
    for name, value in recipe_env:
        if not name.startswith(PREFIX):
            continue
        if name in switches:
            out += _value_finding(f"env.{name}", switches[name], value)
        else:
            out.append(_name_finding(f"env.{name}", name, switches))
    for name, value in sorted(process_env.items()):
        if not name.startswith(PREFIX) or name in set_by_recipe or name in TOOL_ENV:
            continue
        where = f"environment variable {name} (the server inherits it)"
        if name in switches:
            out += _value_finding(where, switches[name], value)
        elif suggest(name, switches):  # a near miss of a switch: the gate would silently stay auto
            out.append(_name_finding(where, name, switches))
    return out
