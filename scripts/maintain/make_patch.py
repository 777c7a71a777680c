"""Maintainer tool: write one series patch as a unified diff of an edited tree against a base.

    python scripts/maintain/make_patch.py --base BASE_ROOT --edited EDITED_ROOT -o patches/vllm-0.33.0/NNNN-x.patch \
        vllm/path/one.py vllm/path/new_file.py ...

BASE_ROOT is the tree the patch applies to (the pristine tree from `python -m m3patch.patching.pristine 0.33.0`,
or a copy with the earlier patches of the series applied); EDITED_ROOT holds the edited files (it may
hold only those). Paths are relative to the roots and must start with `vllm/`. A file missing from
BASE_ROOT becomes a new-file hunk (`--- /dev/null`). Output is deterministic: paths sorted, no
timestamps, 3 lines of context, LF line endings; the same inputs give the same bytes.
"""

from __future__ import annotations

import argparse
import difflib
import sys
from pathlib import Path

CONTEXT_LINES = 3


def _read_lines(path: Path) -> list[str]:
    text = path.read_text(encoding="utf-8")
    if "\r" in text:
        raise SystemExit(f"make_patch: {path} has CR line endings; the series is LF only")
    if text and not text.endswith("\n"):
        raise SystemExit(f"make_patch: {path} does not end with a newline")
    return text.splitlines(keepends=True)


def file_diff(base_root: Path, edited_root: Path, rel: str) -> str:
    """Unified diff for one path; empty when the file is unchanged."""
    if not rel.startswith("vllm/") or ".." in Path(rel).parts:
        raise SystemExit(f"make_patch: {rel}: patches may only touch paths under vllm/")
    edited = edited_root / rel
    if not edited.is_file():
        raise SystemExit(f"make_patch: {edited} does not exist (deleting files is not supported)")
    base = base_root / rel
    old = _read_lines(base) if base.is_file() else []
    old_name = f"a/{rel}" if base.is_file() else "/dev/null"
    lines = difflib.unified_diff(old, _read_lines(edited), old_name, f"b/{rel}", n=CONTEXT_LINES)
    return "".join(lines)


def make_patch(base_root: Path, edited_root: Path, paths: list[str]) -> str:
    chunks = [file_diff(base_root, edited_root, rel) for rel in sorted(set(paths))]
    unchanged = [rel for rel, chunk in zip(sorted(set(paths)), chunks, strict=True) if not chunk]
    if unchanged:
        raise SystemExit(f"make_patch: no change in {', '.join(unchanged)}")
    return "".join(chunks)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", type=Path, required=True, help="root containing the base vllm/")
    parser.add_argument("--edited", type=Path, required=True, help="root containing edited files")
    parser.add_argument("-o", "--output", type=Path, help="patch file to write (default stdout)")
    parser.add_argument("paths", nargs="+", help="paths relative to the roots, vllm/...")
    args = parser.parse_args(argv)
    text = make_patch(args.base, args.edited, args.paths)
    if args.output is None:
        sys.stdout.write(text)
        return 0
    tmp = args.output.with_name(args.output.name + ".tmp")
    tmp.write_text(text, encoding="utf-8", newline="\n")
    tmp.replace(args.output)  # atomic: a reader never sees half a patch
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
