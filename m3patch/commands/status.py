"""`m3patch status [--json]`: per patch, per file and per hunk state; files win over the ledger."""

from __future__ import annotations

import argparse
import json

from m3patch.commands.common import add_series_option, add_tree_options, say, tree_and_series


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_options(parser)
    add_series_option(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    from m3patch.apply_api import tree_status
    from m3patch.output import table

    tree, series = tree_and_series(args)
    report = tree_status(tree, series)
    if args.json:
        say(json.dumps(report.to_json(), indent=2))
        return 0
    table(f"{series.id} on {tree.root} (vLLM {tree.version})", ["patch", "state", "can drop", "summary"],
          [[p["id"], p["state"], "yes" if p["can_drop"] else "no", p["summary"]]
           for p in report.patches])
    table("files", ["file", "state", "patches"],
          [[f["path"], f["state"], ",".join(f["patches"])] for f in report.files])
    for item in report.files:
        for line in item["diagnosis"]:
            say(f"{item['path']}: {line.strip()}")
    for note in report.notes:
        say(f"note: {note}")
    counts = [p["state"] for p in report.patches]
    say(f"m3patch: {counts.count('applied')} applied, {counts.count('pending')} pending, "
        f"{len(counts) - counts.count('applied') - counts.count('pending')} conflicts")
    return 0
