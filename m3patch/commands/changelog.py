"""`m3patch changelog check`: validate perf-changelog.yaml, append-only against a base ref.

    m3patch changelog check [--base REF] [--head REF] [--pr N] [--file PATH] [--repo OWNER/NAME]
                            [--json | --json-file FILE]

Without --head the work-tree file is checked; refs are read with `git show REF:path`. Without
--base only the schema, layout and references are checked (every entry counts as new). PR links
are https://github.com/OWNER/NAME/pull/N, the repo from --repo, $GITHUB_REPOSITORY, the
github.com `upstream` remote (a fork clone's origin is the fork), the github.com `origin` remote,
else m3patch/m3patch. Exit 16 on a rule violation, 2 on a bad invocation or unknown ref. With
GITHUB_ACTIONS=true each problem is one `::error file=,line=` annotation (none repeated on stderr).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from m3patch.changelog import CheckInput, check, raise_for_errors
from m3patch.changelog.findings import errors_of, github_annotation
from m3patch.changelog.sources import (
    GitRefReader,
    WorkTreeReader,
    build_catalog,
    git_toplevel,
    resolve_repo,
    verify_ref,
)
from m3patch.commands.flags import add_json_flags, json_file, json_stdout
from m3patch.errors import UsageError
from m3patch.fsio import read_state, write_output_json
from m3patch.output import info

DEFAULT_FILE = "perf-changelog.yaml"
CHANGELOG_MAX_BYTES = 64 << 20  # years of entries are a few MiB; past this it is no changelog


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    check = sub.add_parser("check", help="validate the schema and the append-only rules")
    check.add_argument("--base", metavar="REF", help="git ref the file must only append to")
    check.add_argument("--head", metavar="REF", help="git ref to check (default: the work tree)")
    check.add_argument("--pr", type=int, metavar="N", help="this PR's number (its pr-link)")
    check.add_argument("--file", type=Path, help=f"the changelog (default: <repo>/{DEFAULT_FILE})")
    check.add_argument("--repo", metavar="OWNER/NAME", help="GitHub repository of PR links (default: $GITHUB_REPOSITORY,"
                       " else the github.com upstream remote, else origin, else m3patch/m3patch)")
    add_json_flags(check, report="the report (findings, new entries, new_recipes)",
                   file_alias=True)


def run(args: argparse.Namespace) -> int:
    if args.pr is not None and args.pr < 1:
        msg = f"--pr must be a PR number (1 or more), got {args.pr}"
        raise UsageError(msg, hint="m3patch changelog check --pr 2508  (or drop --pr)")
    root, path = _locate(args)
    rel = _relative(path, root)
    for ref in (args.base, args.head):
        if ref is not None:
            verify_ref(_need_git(root), ref)
    head = _read_head(root, rel, path, args.head)
    base = _read_base(root, rel, args.base)
    reader = GitRefReader(_need_git(root), args.head) if args.head else WorkTreeReader(root or path.parent)
    inp = CheckInput(
        path=rel, head=head, base=base, compare=args.base is not None,
        base_label=args.base or "the base", repo=resolve_repo(args.repo, root), pr=args.pr,
    )
    report = check(inp, build_catalog(reader))
    target = json_file(args)
    if target is not None:
        _write_json(target, report.to_json())
    if json_stdout(args):  # stdout is the object's alone
        print(json.dumps(report.to_json(), indent=2), flush=True)
    annotate = os.environ.get("GITHUB_ACTIONS") == "true"
    if annotate:  # one annotation per problem, pinned to its line (stderr when stdout is JSON)
        for finding in errors_of(report.findings):
            print(github_annotation(finding, rel), flush=True,
                  file=sys.stderr if json_stdout(args) else sys.stdout)
    raise_for_errors(report.findings, rel, annotated=annotate)
    for finding in report.findings:
        info(f"{rel}: {finding.message}")
    return 0


def _locate(args: argparse.Namespace) -> tuple[Path | None, Path]:
    start = args.file.parent if args.file is not None else Path.cwd()
    root = git_toplevel(start.resolve() if start.exists() else Path.cwd())
    if args.file is not None:
        return root, args.file.resolve()
    return root, (root or Path.cwd()) / DEFAULT_FILE


def _need_git(root: Path | None) -> Path:
    if root is None:
        msg = "--base/--head need a git repository, and the changelog is not inside one"
        raise UsageError(msg, hint="run from the repository, or pass --file inside it")
    return root


def _relative(path: Path, root: Path | None) -> str:
    if root is not None and path.is_relative_to(root.resolve()):
        return path.relative_to(root.resolve()).as_posix()
    return path.name if root is None else str(path)


def _read_head(root: Path | None, rel: str, path: Path, head_ref: str | None) -> bytes:

    if head_ref is None:
        try:
            return read_state(path, CHANGELOG_MAX_BYTES, links=True)  # a FIFO would block forever
        except OSError as exc:
            msg = f"{path}: cannot read the changelog: {exc.strerror or exc}"
            raise UsageError(msg, hint="pass --file PATH of a regular file, or create "
                             "perf-changelog.yaml") from None
    data = GitRefReader(_need_git(root), head_ref).read(rel)
    if data is None:
        msg = f"{rel} does not exist at {head_ref}"
        raise UsageError(msg, hint=f"git show {head_ref}:{rel}  (check --file and --head)")
    return data


def _read_base(root: Path | None, rel: str, base_ref: str | None) -> bytes | None:
    if base_ref is None:
        return None
    return GitRefReader(_need_git(root), base_ref).read(rel)  # absent at base: a new file


def _write_json(path: Path, data: dict[str, object]) -> None:
    write_output_json(path, data, flag="--json-file")
