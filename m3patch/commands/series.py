"""`m3patch series lock|show`: pin a series on a pristine tree; show what it contains."""

from __future__ import annotations

import argparse
from pathlib import Path

from m3patch.commands.common import prepare_process, say, series_dir
from m3patch.errors import UsageError
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import pristine_tree
from m3patch.patching.series import load_series
from m3patch.patching.series_lock import lock_series


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    lock = sub.add_parser("lock", help="compute series.lock.json from a pristine tree")
    lock.add_argument("--series", metavar="DIR", type=Path, required=True)
    source = lock.add_mutually_exclusive_group(required=True)
    source.add_argument("--tree", metavar="DIR", help="pristine tree root (containing vllm/)")
    source.add_argument("--pristine", action="store_true",
                        help="use the cached PyPI wheel of the target version")
    show = sub.add_parser("show", help="list the patches and markers of a series")
    show.add_argument("--series", metavar="DIR", type=Path, required=True)


def _lock(args: argparse.Namespace) -> int:
    series = load_series(series_dir(args, None), with_lock=False)
    root = pristine_tree(series.target_version) if args.pristine else Path(args.tree)
    written = lock_series(series, tree_at(root))
    say(f"m3patch: wrote {written.path}: {written.patches} patch(es), {written.files} file(s)")
    return 0


def _show(args: argparse.Namespace) -> int:
    series = load_series(series_dir(args, None))
    say(f"{series.id}: vLLM {series.target_version}"
        f"{' commit ' + series.target_commit if series.target_commit else ''}"
        f", lock {'present' if series.lock else 'MISSING'}")
    for index, patch in enumerate(series.patches, start=1):
        gate = ",".join(patch.platforms) or "all platforms"
        say(f"{index:3}. {patch.id} ({patch.file}; {gate}): {patch.summary}")
        say(f"     drop when: {patch.drop_when}")
        for marker in patch.markers:
            say(f"     {marker.kind} marker {marker.id}: {marker.text!r}")
    return 0


def run(args: argparse.Namespace) -> int:
    prepare_process()
    if args.action == "lock":
        return _lock(args)
    if args.action == "show":
        return _show(args)
    msg = f"unknown series action {args.action!r}"
    raise UsageError(msg, hint="m3patch series --help")
