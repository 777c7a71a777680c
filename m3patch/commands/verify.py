"""`m3patch verify`: the files equal the pinned post-images, compile and parse."""

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
from m3patch.patching.api import verify_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_options(parser)
    add_series_option(parser)


def run(args: argparse.Namespace) -> int:
    prepare_process()

    tree, series = tree_and_series(args)
    report = verify_tree(tree, series)
    for note in report.notes:
        err(f"m3patch: {note}")
    if not report.ok:
        err(f"m3patch: compiled with {report.compiler}")
    report.raise_for_failure()
    say(f"m3patch: {series.id}: {len(report.checked)} file(s) equal their pinned post-images")
    say(f"m3patch: compiled with {report.compiler}")
    return 0
