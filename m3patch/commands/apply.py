"""`m3patch apply`: the series as one transaction; exact, idempotent, fail-closed."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING, Any

from m3patch.commands.common import add_tree_and_series_options, err, say, start_tree_command
from m3patch.patching import memo, report_json
from m3patch.patching.api import Mode, apply_series, ensure_series, verify_tree

if TYPE_CHECKING:
    from m3patch.patching.api import ApplyReport, VerifyReport
    from m3patch.patching.locate import VllmTree
    from m3patch.patching.series import Series


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tree_and_series_options(parser)
    parser.add_argument("--verify", action="store_true", help="verify the tree afterwards")
    parser.add_argument("--dry-run", action="store_true", help="plan and report, write nothing")
    parser.add_argument("--only", nargs="+", metavar="ID", help="apply only these patch ids")
    parser.add_argument("--offset", action="store_true",
                        help="porting mode: exact hunks at reported offsets on an unpinned tree")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object on stdout (docs/json-schema.md)")


def run(args: argparse.Namespace) -> int:
    if args.dry_run:  # "write nothing" covers m3patch's own memos too
        memo.forbid_writes()
    mode = Mode.OFFSET if args.offset else Mode.STRICT
    fields = report_json.start("apply", mode=str(mode)) if args.json else None
    tree, series = start_tree_command(args)
    if fields is not None:
        report_json.attach(fields, tree, series.id)
    plain = not (args.dry_run or args.only or args.offset)
    if args.verify and plain:  # the same path serve, bench and ci take
        ensured = ensure_series(tree, series)
        report, verify = ensured.report, ensured.verify
    else:
        report = apply_series(tree, series, dry_run=args.dry_run, only=args.only,
                              mode=mode)
        verify = None
    if fields is not None:
        report_json.attach(fields, tree, series.id)  # the ledger this run wrote
        fields.update(report.to_json())
    for note in report.notes:
        err(f"m3patch: {note}")
    for line in report.offsets:
        err(f"m3patch: offset: {line}")
    if fields is not None:
        return _finish_json(fields, args, tree, series, report, verify)
    deleted = set(report.deleted)
    lines = [f"{_verb(path in deleted, args.dry_run)} {path}" for path in report.files_written]
    if lines:  # one write: a release-sized series is a thousand lines, and an unbuffered
        say("\n".join(lines))  # stdout (PYTHONUNBUFFERED, common in images) writes each alone
    if not report.applied:
        say(f"m3patch: series {series.id} already applied to {tree.root}")
    if args.verify and not args.dry_run:
        if verify is None:
            verify = verify_tree(tree, series, contents=report.contents)
            verify.raise_for_failure()
        say(f"m3patch: verified {len(verify.checked)} file(s); compiled with {verify.compiler}")
    say(report.summary())
    return 0


def _verb(deleted: bool, dry_run: bool) -> str:
    if deleted:
        return "would delete" if dry_run else "deleted"
    return "would write" if dry_run else "wrote"


def _finish_json(fields: dict[str, Any], args: argparse.Namespace, tree: VllmTree,
                 series: Series, report: ApplyReport, verify: VerifyReport | None) -> int:
    if args.verify and not args.dry_run:
        if verify is None:
            verify = verify_tree(tree, series, contents=report.contents)
        fields["verify"] = verify.to_json()
        verify.raise_for_failure()
    report_json.finish(fields)
    return 0
