"""`m3patch locate`: which vLLM tree would be patched, without importing vLLM."""

from __future__ import annotations

import argparse

from m3patch.commands.common import add_tree_options, prepare_process, say, tree_from
from m3patch.patching import report_json


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_options(parser)
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (docs/json-schema.md)")


def run(args: argparse.Namespace) -> int:
    report = report_json.start("locate") if args.json else None
    prepare_process()
    tree = tree_from(args)
    fields = {"root": str(tree.root), "package_dir": str(tree.package_dir),
              "version": tree.version, "commit": tree.commit,
              "distribution": tree.distribution, "python": tree.python}
    if report is not None:
        report_json.attach(report, tree, None)
        report.update(fields)
        report_json.finish(report)
    else:
        for key, value in fields.items():
            say(f"{key:13} {value if value is not None else '-'}")
    return 0
