"""`m3patch verify`: the files equal the pinned post-images, compile and parse."""

from __future__ import annotations

import argparse

from m3patch.commands.common import add_tree_and_series_options, err, say, start_tree_command
from m3patch.patching.api import verify_tree


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_and_series_options(parser)


def run(args: argparse.Namespace) -> int:
    tree, series = start_tree_command(args)
    report = verify_tree(tree, series)
    for note in report.notes:
        err(f"m3patch: {note}")
    if not report.ok:
        err(f"m3patch: compiled with {report.compiler}")
    report.raise_for_failure()
    say(f"m3patch: {series.id}: {len(report.checked)} file(s) equal their pinned post-images")
    say(f"m3patch: compiled with {report.compiler}")
    return 0
