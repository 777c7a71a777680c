"""`m3patch revert`: back to the exact pinned pre-images (verified), ledger removed."""

from __future__ import annotations

import argparse

from m3patch.commands.common import add_tree_and_series_options, err, say, start_tree_command
from m3patch.patching.api import revert_series


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_and_series_options(parser)
    parser.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")


def run(args: argparse.Namespace) -> int:
    tree, series = start_tree_command(args)
    report = revert_series(tree, series, dry_run=args.dry_run)
    for note in report.notes:
        err(f"m3patch: {note}")
    for path in report.files_written:
        verb = "remove" if path in report.deleted else "restore"  # a file the series added
        say(f"would {verb} {path}" if args.dry_run else f"{verb}d {path}")
    say(report.summary())
    return 0
