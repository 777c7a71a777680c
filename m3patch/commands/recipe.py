"""`m3patch recipe validate FILE...` and `m3patch recipe show FILE`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3patch.bench.cells import AgenticCell, Cell
from m3patch.bench.spec import recipe_cells
from m3patch.cluster.network import IFNAME_VARS
from m3patch.cluster.node_plan import plan_set, role_recipes
from m3patch.commands.flags import add_python_flag
from m3patch.errors import M3PatchError
from m3patch.marker_lint.check import lint_all
from m3patch.marker_lint.lint import raise_on_errors
from m3patch.output import info, printable, show, table, warn
from m3patch.recipe.loader import Recipe, load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.recipe.server_groups import server_groups
from m3patch.serving.launch_plan import all_markers, plan_launch
from m3patch.serving.vllm_parser import check_launch, other_vllm_note

if TYPE_CHECKING:
    from m3patch.markers import MarkerSpec


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    validate = sub.add_parser("validate", help="check recipes (and their series' markers)")
    validate.add_argument("files", type=recipe_path, nargs="+", metavar="FILE")
    validate.add_argument("--no-lint-markers", dest="lint_markers", action="store_false",
                          help="skip the marker lint (it runs when the recipe's pristine vLLM "
                               "tree is cached; the first run on a tree reads it for minutes)")
    show = sub.add_parser("show", help="the resolved argv, env and markers of a recipe")
    show.add_argument("file", type=recipe_path, metavar="FILE",
                      help="recipe file, or a shipped recipe's name (e.g. mi300x_tp8)")
    add_python_flag(show, what="interpreter whose vLLM would serve (default: the recipe's "
                               "target.python, else this one)")


def _validate(files: list[Path], *, lint_markers: bool = True) -> int:
    """Every file checked; each invalid one named with why. What is fine is summarised once:
    one line for the whole run, not one per recipe (the demo validates every shipped recipe)."""
    first_error: M3PatchError | None = None
    valid = 0
    unlinted: dict[str, list[Path]] = {}  # vLLM version -> recipes whose tree is not cached
    for path in files:
        try:
            recipe = load_recipe(path)
            all_markers(recipe, None)
            if lint_markers and not _lint_markers(recipe):
                unlinted.setdefault(recipe.target.vllm_version, []).append(path)
            check_launches(recipe)
        except M3PatchError as exc:
            print(printable(f"m3patch: {path}: invalid:\n{exc}"), file=sys.stderr, flush=True)
            first_error = first_error or exc
            continue
        valid += 1
        if len(files) == 1:
            info(f"{path}: ok")
    if len(files) > 1:
        info(f"recipe validate: {valid} of {len(files)} recipe(s) ok")
    if unlinted:
        count = sum(len(p) for p in unlinted.values())
        versions = ", ".join(sorted(unlinted))
        example = next(iter(unlinted.values()))[0]
        info(f"markers not linted for {count} recipe(s): no cached pristine vLLM {versions} tree "
             f"(`m3patch markers lint --recipe {example}` fetches it; --no-lint-markers skips this)")
    return 0 if first_error is None else first_error.exit_code


def check_static(recipe: Recipe, env: Mapping[str, str] | None = None) -> None:
    """What `recipe validate` checks with no server, GPU or vLLM tree (the marker lint reads a
    tree): the series' markers merge with the recipe's, and every launch passes."""
    all_markers(recipe, None)
    check_launches(recipe, env)


def check_launches(recipe: Recipe, env: Mapping[str, str] | None = None) -> None:
    """The launch check `serve --dry-run` and every preflight make, on every server form the
    sweep starts, from the series' shipped spec (read-only: nothing is spawned)."""
    python = recipe.target.python or sys.executable
    for form in launch_forms(recipe):
        check_launch(form, python, env, spawn=False)


def launch_forms(recipe: Recipe) -> list[Recipe]:
    """Every launch the sweep makes: one per server group and, for a multi-node set, each
    group's launch on every role that runs vLLM (its vllm-args and env added)."""
    groups = [group.recipe for group in server_groups(recipe, recipe_cells(recipe))]
    if recipe.topology is None:
        return groups
    return [form for group in groups for form in (group, *role_recipes(group))]


def _lint_markers(recipe: Recipe) -> bool:
    """Marker lint when the recipe's pristine tree is cached (validate never downloads one);
    False when it is not cached (nothing linted)."""
    result = lint_all(None, None, [recipe], download=False)
    if not result.trees:
        return False
    for finding in result.findings:
        info(f"{recipe.path}: {finding.line()}")
    raise_on_errors(result.findings, hint=f"correct the marker text in {recipe.path}; check with "
                    f"`m3patch markers lint --recipe {recipe.path}`")
    return True


def show_plan(recipe_path: Path, python: str | None, port: int | None = None, *,
              check: bool = False, other_vllm: bool = False) -> None:
    """Print what `serve` would run; shared with `serve --dry-run`, which (`check`) first has
    the target interpreter's own vLLM parse it (LaunchRejected, exit 24, if it would not;
    VersionMismatch, 4, if it is not the series' target vLLM unless `other_vllm`)."""

    recipe = load_recipe(recipe_path)
    interpreter = python or recipe.target.python or sys.executable
    log = recipe.results_dir / "<run>" / "server.log"
    plan = plan_launch(recipe, interpreter, port or recipe.port, log, None)
    # Every server form the sweep starts (one per server group, on every role of a set) goes
    # through vLLM's parser.
    checked = None
    for form in launch_forms(recipe) if check else ():
        checked = check_launch(form, interpreter, plan.spec.env, other_vllm=other_vllm,
                               located=checked.tree if checked is not None else None)
    if not check:
        _warn_other_vllm(recipe, interpreter)
    show(f"# recipe {recipe.name} ({recipe.target.platform}, vLLM {recipe.target.vllm_version})")
    show(f"# series {recipe.series_dir} (applied and verified before start)")
    if checked is not None:
        show(f"# launch checked by {checked.checked_by}")
    if recipe.topology is not None:
        show("# a multi-node set: each node's own command, env and gate follow the sweep")
    else:
        show("\n".join(shell_lines(plan.env_overrides, plan.spec.argv)))
        show("\n".join(marker_lines(plan.markers)))
    if recipe.marker_waivers:
        table("series markers waived by this recipe", ["id", "reason"],
              [list(w) for w in recipe.marker_waivers])
    cells = recipe_cells(recipe)
    fixed = [cell for cell in cells if isinstance(cell, Cell)]
    if fixed:
        table(f"sweep (prompts {recipe.sweep.prompts_per_concurrency} x conc, warm-ups "
              f"{recipe.sweep.warmups_per_concurrency} x conc, range ratio "
              f"{recipe.sweep.range_ratio} ({recipe.sweep.length_convention}'s convention))",
              ["isl", "osl", "concurrency"], sweep_rows(fixed))
    agentic = [cell for cell in cells if isinstance(cell, AgenticCell)]
    if agentic:
        table(agentic_title(recipe), ["kv-offload", "concurrency", "cell"],
              [[c.kv_offload.label, c.concurrency, c.cell_id] for c in agentic])
    groups = server_groups(recipe, cells)
    if len(groups) > 1:
        by_id = {cell.cell_id: cell for cell in cells}
        table("server groups (one server started and gated per group)",
              ["group", "cells (isl/osl: concurrencies)", "server differs from the recipe's by"],
              [[g.index, group_cells([by_id[c] for c in g.cell_ids]),
                argv_difference(recipe, g.recipe)] for g in groups])
    if recipe.topology is not None:
        show("\n".join(topology_lines(recipe, interpreter)))


def topology_lines(recipe: Recipe, python: str) -> list[str]:
    """Every node of the set: its `serve --role/--rank` command, argv, env and gate."""
    assert recipe.topology is not None
    topo = recipe.topology
    net = topo.network
    out = [f"topology: {len(topo.nodes())} node(s); head {topo.head}; rendezvous "
           "RUN/nodes/<set-id>/*.json" + (f"; DP size {topo.dp_size}, RPC port {topo.rpc_port}"
                                          if topo.is_dp else ""),
           f"network: head address {topo.address!r} (topology.address), resolved to an IP on the "
           "head at start; every other node takes that IP from the head's record",
           f"network: node address {net.address!r} (auto: VLLM_HOST_IP if exported, else the "
           f"source address of the route to the head); interface {net.interface!r} (auto: the "
           f"one holding the node's address) -> {', '.join(IFNAME_VARS)}"]
    out += [f"network: env {k}={shlex.quote(v)}" for k, v in net.env]
    for plan in plan_set(recipe, python, recipe.results_dir / "<run>"):
        role = plan.role
        workers = (f"local DP {role.local_dp}, {role.local_dp * recipe.parallelism.tp} worker(s) "
                   "per node" if role.runs_vllm else "no vLLM")
        out += [f"# node {plan.node} (role {role.name}: {role.kind}, {role.nodes} node(s), {workers})",
                f"#   run there: m3patch serve {recipe.path} --role {plan.node.role} "
                f"--rank {plan.node.rank} --run-dir RUN",
                *shell_lines(plan.plan.env_overrides, plan.argv)]
        out += ["  " + line for line in marker_lines(plan.plan.markers)]
    return out


def shell_lines(env: Iterable[tuple[str, str]], argv: Sequence[str], width: int = 100
                ) -> list[str]:
    """`env K=V ... argv` as one shell command over lines a terminal shows whole: words joined
    up to `width`, an option kept with its value, every line but the last ending in ` \\`."""
    words = ["env", *(f"{k}={shlex.quote(v)}" for k, v in env), "\n" + shlex.quote(argv[0])]
    rest = [shlex.quote(arg) for arg in argv[1:]]
    while rest:  # an option and the value after it stay one unit
        take = 2 if rest[0].startswith("-") and len(rest) > 1 and not rest[1].startswith("-") \
            else 1
        words.append(" ".join(rest[:take]))
        rest = rest[take:]
    lines, line = [], ""
    for word in words:  # the interpreter starts a line of its own ("\n")
        if word.startswith("\n") or (line and len(line) + 1 + len(word) > width):
            word = word.removeprefix("\n")
            lines.append(line)
            line = "   " + word
        else:
            line = f"{line} {word}" if line else word
    return [*(f"{text} \\" for text in lines), line]


def marker_lines(markers: Iterable[MarkerSpec]) -> list[str]:
    """The markers under a line per source that declared them (a series' manifest path is long
    and shared by most), one line per marker, then its text whole on a line of its own (quoted,
    so a trailing blank shows): texts are copied into recipes and greps, so no table column may
    cut them."""
    out = ["markers (required by readiness; forbidden at any time):"]
    by_source: dict[str, list[MarkerSpec]] = {}
    for m in markers:
        by_source.setdefault(m.declared_by, []).append(m)
    for source, group in by_source.items():
        out.append(f"  declared by {source}:")
        for m in group:
            count = "any count" if m.count is None else f"count {m.count}"
            out += [f"    {m.kind:<9} {m.id} ({count})", f"      {m.text!r}"]
    return out


def agentic_title(recipe: Recipe) -> str:
    """The agentic scenario in one line: trace, stop condition, AIPerf scenario, DRAM budget."""
    scenario = recipe.sweep.agentic
    assert scenario is not None
    stop = (f"{scenario.duration_s} s" if scenario.duration_s is not None
            else f"{scenario.request_count} requests")
    dram = scenario.dram_budget_gb(recipe.parallelism.tp)
    return (f"agentic-coding sweep (AIPerf; trace {scenario.trace.label}; {stop} per cell"
            + (f"; scenario {scenario.aiperf_scenario}" if scenario.aiperf_scenario else "")
            + (f"; DRAM offload budget {dram} GB" if dram else "") + ")")


def _options(argv: Iterable[str]) -> dict[str, str | None]:
    """`--key value` / `--flag` tokens as a mapping (the form flatten_vllm_args writes)."""
    out: dict[str, str | None] = {}
    key = None
    for token in argv:
        if token.startswith("--"):
            key = token
            out[key] = None
        elif key is not None:
            out[key] = token if out[key] is None else f"{out[key]} {token}"
    return out


def argv_difference(recipe: Recipe, variant: Recipe) -> str:
    """What a server group changes: options set or changed, options dropped, env set."""
    base, mine = _options(recipe.vllm_args), _options(variant.vllm_args)
    changed = [k if v is None else f"{k} {shlex.quote(v)}" for k, v in mine.items()
               if k not in base or base[k] != v]
    changed += [f"(no {k})" for k in base if k not in mine]
    env = dict(recipe.env)
    changed += [f"env {k}={shlex.quote(v)}" for k, v in variant.env if env.get(k) != v]
    return " ".join(changed) or "nothing (the recipe's server)"


def group_cells(cells: list[Cell | AgenticCell]) -> str:
    """A server group's cells in a few words: isl/osl with their concurrencies, or agentic ids."""
    fixed = [cell for cell in cells if isinstance(cell, Cell)]
    parts = [f"{isl}/{osl}: c{concs}" for isl, osl, concs in sweep_rows(fixed)]
    parts += [cell.cell_id for cell in cells if isinstance(cell, AgenticCell)]
    return "; ".join(parts)


def _warn_other_vllm(recipe: Recipe, interpreter: str) -> None:
    """`recipe show` checks no launch, but a command it prints for an interpreter that serve
    and bench would refuse (exit 4) must not pass for one that runs."""
    note = other_vllm_note(recipe, interpreter)
    if note is not None:
        warn(f"{note}; `m3patch serve` and `bench` refuse it (exit 4): pass --python with a "
             f"vLLM {recipe.target.vllm_version} interpreter")


def sweep_rows(cells: Iterable[Cell]) -> list[list[Any]]:
    """isl, osl and the concurrencies the bench runs for each shape."""
    shapes: dict[tuple[int, int], list[str]] = {}
    for cell in cells:
        shapes.setdefault((cell.seq.isl, cell.seq.osl), []).append(str(cell.concurrency))
    return [[isl, osl, ",".join(concs)] for (isl, osl), concs in shapes.items()]


def run(args: argparse.Namespace) -> int:
    if args.action == "validate":
        return _validate(args.files, lint_markers=args.lint_markers)
    show_plan(args.file, args.python)
    return 0
