"""`m3patch verify [--json]`: the files equal the pinned post-images, compile and parse."""

from __future__ import annotations

import argparse

from m3patch.commands.common import add_tree_and_series_options, err, say, start_tree_command
from m3patch.patching import report_json
from m3patch.patching.api import verify_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_and_series_options(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (docs/json-schema.md)")


def run(args: argparse.Namespace) -> int:
    fields = report_json.start("verify") if args.json else None
    tree, series = start_tree_command(args)
    report = verify_tree(tree, series)
    if fields is not None:
        report_json.attach(fields, tree, series.id)
        fields.update(report.to_json())
    for note in report.notes:
        err(f"m3patch: {note}")
    if not report.ok:
        err(f"m3patch: compiled with {report.compiler}")
    report.raise_for_failure()
    if fields is not None:
        report_json.finish(fields)
        return 0
    say(f"m3patch: {series.id}: {len(report.checked)} file(s) equal their pinned post-images")
    say(f"m3patch: compiled with {report.compiler}")
    return 0
