"""Options shared by the tree commands (locate, apply, verify, status, revert, series)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from m3patch.patching.locate import VllmTree, find_vllm
from m3patch.patching.series import Series, find_series_dir, load_series


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--python", metavar="PATH",
                        help="interpreter whose vllm to patch (default: this one)")
    parser.add_argument("--vllm-root", metavar="DIR",
                        help="tree root containing vllm/ (or the vllm dir); env M3PATCH_VLLM_ROOT")


def add_series_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--series", metavar="DIR", type=Path,
                        help="series folder with series.yaml (default: $M3PATCH_SERIES, "
                             "else patches/vllm-<installed version>)")


def tree_from(args: argparse.Namespace) -> VllmTree:
    return find_vllm(args.python, args.vllm_root)


def series_dir(args: argparse.Namespace, tree: VllmTree | None) -> Path:
    """--series, else the default lookup for the tree's vLLM version (patching.series)."""
    return find_series_dir(args.series, None if tree is None else tree.version)


def tree_and_series(args: argparse.Namespace) -> tuple[VllmTree, Series]:
    tree = tree_from(args)
    return tree, load_series(series_dir(args, tree))


def say(line: str) -> None:
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
