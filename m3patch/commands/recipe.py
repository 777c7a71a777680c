"""`m3patch recipe validate FILE...` and `m3patch recipe show FILE`."""

from __future__ import annotations

import argparse
import shlex
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from m3patch.bench.spec import recipe_cells
from m3patch.cluster.node_plan import plan_set
from m3patch.errors import M3PatchError
from m3patch.marker_lint.check import lint_all
from m3patch.marker_lint.lint import raise_on_errors
from m3patch.output import info, table
from m3patch.recipe.loader import Recipe, load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.recipe.regions import server_groups
from m3patch.serving.launch_plan import all_markers, plan_launch
from m3patch.serving.vllm_parser import check_launch

if TYPE_CHECKING:
    from m3patch.bench.cells import Cell
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
    show.add_argument("--python", help="the interpreter to launch with (default: the recipe's)")


def _validate(files: list[Path], *, lint_markers: bool = True) -> int:

    first_error: M3PatchError | None = None
    for path in files:
        try:
            recipe = load_recipe(path)
            all_markers(recipe, None)
            if lint_markers:
                _lint_markers(recipe)
            # The launch check `serve --dry-run` and every preflight make, on every server form
            # the sweep starts, from the series' shipped spec (read-only: nothing is spawned).
            python = recipe.target.python or sys.executable
            for group in server_groups(recipe, recipe_cells(recipe)):
                check_launch(group.recipe, python, spawn=False)
        except M3PatchError as exc:
            print(f"m3patch: {path}: invalid:\n{exc}", file=sys.stderr)
            first_error = first_error or exc
            continue
        info(f"{path}: ok")
    return 0 if first_error is None else first_error.exit_code


def _lint_markers(recipe: Recipe) -> None:
    """Marker lint when the recipe's pristine tree is cached (validate never downloads one)."""
    result = lint_all(None, None, [recipe], download=False)
    if not result.trees:
        info(f"{recipe.path}: markers not linted (no cached vLLM {recipe.target.vllm_version} "
             f"tree; `m3patch markers lint --recipe {recipe.path}` fetches it)")
        return
    for finding in result.findings:
        info(f"{recipe.path}: {finding.line()}")
    raise_on_errors(result.findings, hint=f"correct the marker text in {recipe.path}; check with "
                    f"`m3patch markers lint --recipe {recipe.path}`")


def show_plan(recipe_path: Path, python: str | None, port: int | None = None, *,
              check: bool = False, other_vllm: bool = False) -> None:
    """Print what `serve` would run; shared with `serve --dry-run`, which (`check`) first has
    the target interpreter's own vLLM parse it (LaunchRejected, exit 24, if it would not;
    VersionMismatch, 4, if it is not the series' target vLLM unless `other_vllm`)."""

    recipe = load_recipe(recipe_path)
    interpreter = python or recipe.target.python or sys.executable
    log = recipe.results_dir / "<run>" / "server.log"
    plan = plan_launch(recipe, interpreter, port or recipe.port, log, None)
    # Every server form the sweep starts (one per server group) goes through vLLM's parser.
    checked = None
    for group in server_groups(recipe, recipe_cells(recipe)) if check else ():
        checked = check_launch(group.recipe, interpreter, plan.spec.env, other_vllm=other_vllm,
                               located=checked.tree if checked is not None else None)
    print(f"# recipe {recipe.name} ({recipe.target.platform}, vLLM {recipe.target.vllm_version})")
    print(f"# series {recipe.series_dir} (applied and verified before start)")
    if recipe.topology is not None:
        print("# a multi-node set: the single-server base below; each node's own command follows it")
    if checked is not None:
        print(f"# launch checked by {checked.checked_by}")
    print("env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.env_overrides) + " \\")
    print("  " + shlex.join(plan.spec.argv))
    print("\n".join(marker_lines(plan.markers)))
    if recipe.marker_waivers:
        table("series markers waived by this recipe", ["id", "reason"],
              [list(w) for w in recipe.marker_waivers])
    table(f"sweep (prompts {recipe.sweep.prompts_per_concurrency} x conc, warm-ups "
          f"{recipe.sweep.warmups_per_concurrency} x conc, range ratio {recipe.sweep.range_ratio} "
          f"({recipe.sweep.length_convention}'s convention))",
          ["isl", "osl", "concurrency"], sweep_rows(recipe_cells(recipe)))
    groups = server_groups(recipe, recipe_cells(recipe))
    if len(groups) > 1:
        base = set(recipe.vllm_args)
        table("server groups (one server started and gated per group)", ["group", "cells", "argv"],
              [[g.index, " ".join(g.cell_ids), shlex.join(g.recipe.vllm_args)
                if set(g.recipe.vllm_args) != base else "(the recipe's)"] for g in groups])
    if recipe.topology is not None:
        print("\n".join(topology_lines(recipe, interpreter)))


def topology_lines(recipe: Recipe, python: str) -> list[str]:
    """Every node of the set: its `serve --role/--rank` command, argv, env and gate."""
    assert recipe.topology is not None
    topo = recipe.topology
    out = [f"topology: {len(topo.nodes())} node(s); head {topo.head}; rendezvous RUN/nodes/*.json"
           + (f"; DP size {topo.dp_size}, address {topo.address}:{topo.rpc_port}" if topo.is_dp else "")]
    for plan in plan_set(recipe, python, recipe.results_dir / "<run>"):
        role = plan.role
        workers = (f"local DP {role.local_dp}, {role.local_dp * recipe.parallelism.tp} worker(s) "
                   "per node" if role.runs_vllm else "no vLLM")
        out += [f"# node {plan.node} (role {role.name}: {role.kind}, {role.nodes} node(s), {workers})",
                f"#   run there: m3patch serve {recipe.path} --role {plan.node.role} "
                f"--rank {plan.node.rank} --run-dir RUN",
                "env " + " ".join(f"{k}={shlex.quote(v)}" for k, v in plan.plan.env_overrides) + " \\",
                "  " + shlex.join(plan.argv)]
        out += ["  " + line for line in marker_lines(plan.plan.markers)]
    return out


def marker_lines(markers: Iterable[MarkerSpec]) -> list[str]:
    """One line per marker, then its text whole on a line of its own (quoted, so a trailing
    blank shows): texts are copied into recipes and greps, so no table column may cut them."""
    out = ["markers (required by readiness; forbidden at any time):"]
    for m in markers:
        count = "any count" if m.count is None else f"count {m.count}"
        out += [f"  {m.kind:<9} {m.id} ({count}; declared by {m.declared_by})", f"    {m.text!r}"]
    return out


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
