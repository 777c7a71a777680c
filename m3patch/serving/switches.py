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
from m3patch.tool_env import CHECKOUT_ENV, KNOWN_ENV, PREFIX, TOOL_ENV


def _value_finding(where: str, switch: Switch, value: str) -> list[str]:
    given = value.strip().lower()
    if not value or given in switch.values:  # empty is the patch's default
        return []
    if not given:  # one patch strips before its default, another after (and then raises)
        return [f"{where}: {value!r} is blanks only, not a value of {switch.name} "
                f"({'|'.join(switch.values)}, read by patch {switch.patch}); leave it empty "
                "or unset for the patch's default."]
    return [f"{where}: {value!r} is not a value of {switch.name} ({'|'.join(switch.values)}, "
            f"read by patch {switch.patch}; it would raise when the model loads)."
            f"{suggest(given, switch.values)}"]


def _name_finding(where: str, name: str, switches: Mapping[str, Switch]) -> str:
    if name in TOOL_ENV:
        return (f"{where}: {name} is read by m3patch, not by the server; set it in the shell "
                "that runs m3patch, not in the recipe's env")
    if name in CHECKOUT_ENV:
        return (f"{where}: {name} is read by the scripts of m3patch's checkout, not by the "
                "server; set it in the shell that runs them, not in the recipe's env")
    known = ", ".join(sorted(switches)) or "none"
    return f"{where}: the series has no switch {name} (its switches: {known}).{suggest(name, switches)}"


def recipe_switch_findings(recipe_env: tuple[tuple[str, str], ...],
                           switches: Mapping[str, Switch]) -> list[str]:
    """The recipe's `M3PATCH_*` env entries: every name must be a series switch."""
    out: list[str] = []
    for name, value in recipe_env:
        if not name.startswith(PREFIX):
            continue
        if name in switches:
            out += _value_finding(f"env.{name}", switches[name], value)
        else:
            out.append(_name_finding(f"env.{name}", name, switches))
    return out


def shell_switch_findings(recipe_env: tuple[tuple[str, str], ...], process_env: Mapping[str, str],
                          switches: Mapping[str, Switch]) -> list[tuple[str, str]]:
    """(variable, finding) for the shell's `M3PATCH_*` names the server would inherit (the
    recipe's own entries win over them): a switch's value, or a near miss of a switch."""
    out: list[tuple[str, str]] = []
    set_by_recipe = {name for name, _ in recipe_env}
    for name, value in sorted(process_env.items()):
        if not name.startswith(PREFIX) or name in set_by_recipe or name in KNOWN_ENV:
            continue
        where = f"environment variable {name} (the server inherits it)"
        if name in switches:
            out += [(name, line) for line in _value_finding(where, switches[name], value)]
        elif suggest(name, switches):  # a near miss of a switch: the gate would silently stay auto
            out.append((name, _name_finding(where, name, switches)))
    return out


def switch_findings(recipe_env: tuple[tuple[str, str], ...], process_env: Mapping[str, str],
                    switches: Mapping[str, Switch]) -> list[str]:
    """The recipe's `M3PATCH_*` env entries, then the shell's, by where they come from."""
    shell = shell_switch_findings(recipe_env, process_env, switches)
    return recipe_switch_findings(recipe_env, switches) + [line for _, line in shell]
