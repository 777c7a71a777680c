"""`m3patch revert`: back to the exact pinned pre-images (verified), ledger removed."""

from __future__ import annotations

import argparse

from m3patch.commands.common import (
    add_series_option,
    add_tree_options,
    err,
    prepare_process,
    say,
    tree_and_series,
)
from m3patch.patching.api import revert_series


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_options(parser)
    add_series_option(parser)
    parser.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")


def run(args: argparse.Namespace) -> int:
    prepare_process()

    tree, series = tree_and_series(args)
    report = revert_series(tree, series, dry_run=args.dry_run)
    for note in report.notes:
        err(f"m3patch: {note}")
    for path in report.files_written:
        verb = "remove" if path in report.deleted else "restore"  # a file the series added
        say(f"would {verb} {path}" if args.dry_run else f"{verb}d {path}")
    say(report.summary())
    return 0
