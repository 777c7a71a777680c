"""`m3patch markers check LOG --recipe FILE`: the serve-time marker gate, on a saved log."""

from __future__ import annotations

import argparse
from pathlib import Path

from m3patch.errors import UsageError
from m3patch.markers import MarkerChecker, check_log_bytes
from m3patch.output import table, warn
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.serving.launch_plan import all_markers


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="check a server log against a recipe's markers")
    check.add_argument("log", type=Path, help="a saved server log (e.g. RUN_DIR/server.log)")
    check.add_argument("--recipe", type=recipe_path, required=True, help="the recipe the run used")


def run(args: argparse.Namespace) -> int:

    recipe = load_recipe(args.recipe)
    specs = all_markers(recipe, None)
    try:
        data = args.log.read_bytes()
    except OSError as exc:
        msg = f"{args.log}: cannot read the log: {exc.strerror}"
        raise UsageError(msg, hint="pass the server.log of a run folder") from None
    summary = MarkerChecker(specs, log_name=str(args.log))
    summary.feed(data)
    summary.finish()
    rows = [[m.id, m.kind, m.text, m.count if m.count is not None else "any",
             summary.counts.get(m.id, 0), m.declared_by] for m in specs]
    table(f"markers in {args.log}", ["id", "kind", "text", "expected", "seen", "declared by"], rows)
    check_log_bytes(data, specs, log_name=str(args.log),
                    hint=f"fix the launch of {recipe.path}, then `m3patch serve {recipe.path}`")
    for found in summary.warnings():  # reported, never a failure (exit 0)
        warn(found.line(str(args.log)))
    return 0
