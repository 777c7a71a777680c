"""`m3patch status [--json]`: per patch, per file and per hunk state; files win over the ledger.

Exit 0 when every file is pristine or applied (the series may be partly applied, patch by patch);
exit 5 (PatchConflict) when any file is partially applied, drifted, modified after apply, missing
or already upstream, i.e. a state that neither `apply` nor `revert` takes as it is, or when a
killed run's transaction is pending (status only reports it: apply or revert recovers it). The report is printed either way.
"""

from __future__ import annotations

import argparse
from collections import Counter
from typing import TYPE_CHECKING

from m3patch.commands.common import add_tree_and_series_options, say, start_tree_command
from m3patch.errors import PatchConflict
from m3patch.output import table
from m3patch.patching import report_json
from m3patch.patching.api import tree_status
from m3patch.patching.engine import ALL_UP_TO, MORE_HINT, SHOWN_FILES
from m3patch.patching.snapshot import unpinned_message

if TYPE_CHECKING:
    from m3patch.patching.status import StatusReport


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = ("exit 0: every file pristine or applied; exit 5: a file is partially "
                     "applied, drifted, modified after apply, missing or upstreamed "
                     "(see docs/exit-codes.md)")
    add_tree_and_series_options(parser)
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    fields = report_json.start("status") if args.json else None
    tree, series = start_tree_command(args)
    report = tree_status(tree, series)
    if fields is not None:
        report_json.attach(fields, tree, series.id)
        fields.update(report.to_json())
    else:
        _print_tables(report, f"{series.id} on {tree.root} (vLLM {tree.version})")
    if report.interrupted:
        from m3patch.patching.writer import pending_edit  # only a tree with a journal needs it

        edited = pending_edit(tree.root)
        if edited is not None:  # apply and revert would refuse it too: say how to go on
            raise edited
        msg = "an interrupted transaction is pending in vllm/.m3patch/journal.json"
        raise PatchConflict(msg, hint="m3patch apply (or m3patch revert) completes or rolls it back")
    if report.unpinned:  # apply refuses such a tree too: the way back is the other series'
        msg, hint = unpinned_message(tree, series, report.unpinned)
        raise PatchConflict(msg, hint=hint)
    if report.conflicts:
        named = ", ".join(report.conflicts[:SHOWN_FILES])
        more = len(report.conflicts) - SHOWN_FILES
        msg = (f"{len(report.conflicts)} file(s) that neither apply nor revert can take: {named}"
               + (f" and {more} more (`m3patch status --json` lists them)" if more > 0 else ""))
        raise PatchConflict(msg, hint="restore them with `pip install --force-reinstall --no-deps "
                            f"vllm=={series.target_version}`, then `m3patch apply`")
    if fields is not None:
        report_json.finish(fields)
    return 0


def _print_tables(report: StatusReport, title: str) -> None:
    table(title, ["patch", "state", "can drop", "summary"],
          [[p["id"], p["state"], "yes" if p["can_drop"] else "no", p["summary"]]
           for p in report.patches])
    table("files", ["file", "state", "patches"],
          [[f["path"], f["state"], ",".join(f["patches"])] for f in report.files])
    lines = [f"{item['path']}: {line.strip()}" for item in report.files
             for line in item["diagnosis"]]
    for line in lines[:ALL_UP_TO]:
        say(line)
    if len(lines) > ALL_UP_TO:
        say(f"... {len(lines) - ALL_UP_TO} more diagnosis line(s): {MORE_HINT}")
    for note in report.notes:
        say(f"note: {note}")
    counts = Counter(str(p["state"]) for p in report.patches)
    partial = f", {counts['partially applied']} partially applied" if counts[
        "partially applied"] else ""
    say(f"m3patch: {counts['applied']} applied, {counts['pending']} pending{partial}, "
        f"{counts['conflict'] + counts['upstreamed']} in conflict")
