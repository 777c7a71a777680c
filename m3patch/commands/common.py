"""Options shared by the tree commands (locate, apply, verify, status, revert, series)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from m3patch.errors import UsageError
from m3patch.patching.locate import VllmTree, find_vllm
from m3patch.patching.series import Series, load_series

ENV_SERIES = "M3PATCH_SERIES"
REPO_PATCHES = Path(__file__).resolve().parents[2] / "patches"


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


def base_version(version: str) -> str:
    head = version.split("+", 1)[0]
    parts = []
    for part in head.split("."):
        if not part.isdigit():
            break
        parts.append(part)
    return ".".join(parts)


def series_dir(args: argparse.Namespace, tree: VllmTree | None) -> Path:
    """--series, then $M3PATCH_SERIES, then patches/vllm-<base> here or in the m3patch checkout."""
    if args.series is not None:
        return Path(args.series)
    if os.environ.get(ENV_SERIES):
        return Path(os.environ[ENV_SERIES])
    if tree is None:
        msg = "no series given"
        raise UsageError(msg, hint="pass --series patches/vllm-<version>")
    name = f"vllm-{base_version(tree.version)}"
    for candidate in (Path("patches") / name, REPO_PATCHES / name):
        if (candidate / "series.yaml").is_file():
            return candidate
    msg = f"no series for vLLM {tree.version} (looked for patches/{name}/series.yaml)"
    raise UsageError(msg, hint="pass --series DIR, or write the series for this version")


def tree_and_series(args: argparse.Namespace) -> tuple[VllmTree, Series]:
    tree = tree_from(args)
    return tree, load_series(series_dir(args, tree))


def say(line: str) -> None:
    print(line, flush=True)


def err(line: str) -> None:
    print(line, file=sys.stderr, flush=True)
