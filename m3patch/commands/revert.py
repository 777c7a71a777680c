"""`m3patch revert [--json]`: back to the exact pinned pre-images (verified), ledger removed."""

from __future__ import annotations

import argparse

from m3patch.commands.common import add_tree_and_series_options, err, say, start_tree_command
from m3patch.patching import memo, report_json
from m3patch.patching.api import revert_series
from m3patch.patching.states import Mode


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_and_series_options(parser)
    parser.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (docs/json-schema.md)")


def run(args: argparse.Namespace) -> int:
    if args.dry_run:  # "write nothing" covers m3patch's own memos too
        memo.forbid_writes()
    fields = report_json.start("revert", mode=str(Mode.REVERT)) if args.json else None
    tree, series = start_tree_command(args)
    if fields is not None:
        report_json.attach(fields, tree, series.id)  # the ledger before: revert removes it
    report = revert_series(tree, series, dry_run=args.dry_run)
    for note in report.notes:
        err(f"m3patch: {note}")
    if fields is not None:
        fields.update(report.to_json())
        report_json.finish(fields)
        return 0
    deleted = set(report.deleted)  # a file the series added is removed, not restored
    verbs = [("remove" if path in deleted else "restore", path) for path in report.files_written]
    if verbs:  # one write (see apply)
        say("\n".join(f"would {v} {p}" if args.dry_run else f"{v}d {p}" for v, p in verbs))
    say(report.summary())
    return 0
