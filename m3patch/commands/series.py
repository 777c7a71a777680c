"""`m3patch series lock|show|list`: generate the pins of a series; show what it contains; list
the series that ship with m3patch and which one fits the located vLLM.

`lock` applies every patch, in order and exactly, to a pristine tree in memory and writes
series.lock.json: target, sha256 of each .patch, and of every file's pre- and post-image.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from m3patch.commands.common import add_tree_options, prepare_process, say, series_dir, tree_from
from m3patch.errors import UsageError, VersionMismatch, VllmNotFound
from m3patch.patching.locate import ENV_ROOT, VllmTree, check_target, tree_at
from m3patch.patching.pristine import pristine_tree
from m3patch.patching.series import MANIFEST, load_series
from m3patch.patching.series_lock import lock_series
from m3patch.shipped import shipped_dir


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
    listing = sub.add_parser("list", help="the series shipped with m3patch; which fits the "
                                          "located vLLM")
    add_tree_options(listing)


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


def _located(args: argparse.Namespace) -> tuple[VllmTree | None, str]:
    """The tree to match against, or why there is none: not finding one is only a note unless
    the user named the tree (then it is the usual locate error)."""
    try:
        tree = tree_from(args)
    except VllmNotFound as exc:
        if args.python or args.vllm_root or os.environ.get(ENV_ROOT):
            raise
        return None, (f"located: no vLLM ({str(exc).splitlines()[0]}); "
                      f"pass --python PATH or --vllm-root DIR")
    return tree, f"located: vLLM {tree.version} at {tree.root}"


def _fit(tree: VllmTree, version: str, commit: str | None) -> str | None:
    """The version policy's note when the series fits the tree (as apply judges it), else None."""
    try:
        return check_target(tree, version, commit)
    except VersionMismatch:
        return None


def _list(args: argparse.Namespace) -> int:
    folder = shipped_dir("patches")
    if folder is None:
        msg = "this m3patch ships no series (no patches/ in the checkout, no m3patch/_shipped/)"
        raise UsageError(msg, hint="reinstall m3patch from a wheel or sdist, or pass --series DIR")
    tree, located = _located(args)
    say(f"shipped series in {folder}:")
    fits = []
    for directory in sorted(p for p in folder.iterdir() if (p / MANIFEST).is_file()):
        series = load_series(directory)
        commit = f" commit {series.target_commit}" if series.target_commit else ""
        note = _fit(tree, series.target_version, series.target_commit) if tree else None
        if note is not None:
            fits.append(directory)
        say(f"  {directory.name:16} vLLM {series.target_version}{commit}; "
            f"{len(series.patches)} patch(es); lock {'present' if series.lock else 'MISSING'}"
            f"{'  <- fits the located vLLM' if note is not None else ''}")
    if tree is not None:
        located += " -> " + (", ".join(d.name for d in fits) if fits else
                             "no shipped series fits it (pass --series DIR)")
    say(located)
    return 0


def run(args: argparse.Namespace) -> int:
    prepare_process()
    if args.action == "list":
        return _list(args)
    if args.action == "lock":
        return _lock(args)
    if args.action == "show":
        return _show(args)
    msg = f"unknown series action {args.action!r}"
    raise UsageError(msg, hint="m3patch series --help")
