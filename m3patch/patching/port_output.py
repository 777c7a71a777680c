"""`series port` effects: read the source series and the new tree, plan (port.py), and write
the ported series folder, proven first, or an incomplete folder with the report alone.

A complete folder holds the regenerated patches, series.yaml (new target, `ported-from`), a
fresh series.lock.json pinned on NEW_ROOT and the report (port-report.md/.json). It is staged
beside OUT and renamed into place only after the staged series applied, verified and compiled
on a scratch copy of NEW_ROOT and its markers passed the lint. Any conflict (or a failed proof)
leaves OUT with the report and an INCOMPLETE file, never a series.yaml that would load.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from m3patch.errors import M3PatchError, PortConflict, TreeIOError, UsageError
from m3patch.fsio import owned_dir, write_bytes_atomic, write_json_atomic
from m3patch.patching.api import apply_series, verify_tree
from m3patch.patching.diffs import parse_patch, safe_target
from m3patch.patching.locate import VllmTree, tree_at
from m3patch.patching.port import PortPlan, plan_port
from m3patch.patching.port_report import report_json, report_markdown
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import MANIFEST, Series, base_version, load_series
from m3patch.patching.series_lock import lock_series
from m3patch.yamlio import load_yaml_file

REPORT_MD, REPORT_JSON, INCOMPLETE = "port-report.md", "port-report.json", "INCOMPLETE"


@dataclass(frozen=True)
class PortResult:
    plan: PortPlan
    doc: dict[str, Any]
    markdown: str
    series_id: str
    written: Path | None  # the complete folder; None for a dry run or an incomplete port


def new_series_id(series: Series, version: str) -> str:
    """`vllm-<src>` becomes `vllm-<new>`; any other id gets `-on-<new>`."""
    base = base_version(version)
    if series.id == f"vllm-{base_version(series.target_version)}":
        return f"vllm-{base}"
    return f"{series.id}-on-{base}"


def read_plan(series: Series, tree: VllmTree) -> PortPlan:
    parsed = []
    paths: set[str] = set()
    for entry in series.patches:
        path = series.patch_path(entry)
        patch = parse_patch(path.read_bytes(), str(path))
        parsed.append((patch, entry.id, entry.upstream, entry.drop_when))
        paths.update(fp.path for fp in patch.files)
    files: dict[str, bytes | None] = {}
    for rel in sorted(paths):
        target = safe_target(tree.root, rel)
        files[rel] = target.read_bytes() if target.is_file() else None
    return plan_port(parsed, files)


def _header(command: str, series: Series, tree: VllmTree, out: Path | None) -> dict[str, Any]:
    now = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    return {"command": command, "date": now,
            "source": {"series": series.id, "dir": str(series.directory),
                       "vllm": series.target_version},
            "target": {"root": str(tree.root), "vllm": tree.version, "commit": tree.commit},
            "out": None if out is None else str(out)}


def manifest(series: Series, plan: PortPlan, new_id: str, tree: VllmTree) -> dict[str, Any]:
    """series.yaml of the port: the source's entries for the kept patches, new id and target,
    the provenance marker's `series=<id> ` following the id, and the `ported-from` record."""
    raw = load_yaml_file(series.directory / MANIFEST)
    kept = {p.id for p in plan.kept}
    old_tag, new_tag = f"series={series.id} ", f"series={new_id} "
    patches = []
    for entry in raw["patches"]:
        if entry["id"] not in kept:
            continue
        for marker in entry.get("markers", []):
            for key in ("text", "regex"):
                if isinstance(marker.get(key), str):
                    marker[key] = marker[key].replace(old_tag, new_tag)
        patches.append(entry)
    return {"schema": 1, "id": new_id, "target": {"vllm-version": base_version(tree.version)},
            "patches": patches,
            "ported-from": {"series": series.id, "vllm-version": series.target_version,
                            "patches": [{"id": p.id, "outcome": p.outcome} for p in plan.patches]}}


def _write_report(folder: Path, doc: dict[str, Any], markdown: str) -> None:
    write_json_atomic(folder / REPORT_JSON, doc)
    write_bytes_atomic(folder / REPORT_MD, markdown.encode("utf-8"))


def _stage(series: Series, plan: PortPlan, new_id: str, tree: VllmTree, staging: Path) -> Series:
    for patch in plan.kept:
        write_bytes_atomic(staging / patch.file, patch.diff.encode("utf-8"))
    text = yaml.safe_dump(manifest(series, plan, new_id, tree), sort_keys=False,
                          allow_unicode=True, width=100)
    write_bytes_atomic(staging / MANIFEST, text.encode("utf-8"))
    lock_series(load_series(staging, with_lock=False), tree)
    return load_series(staging)


MarkerLint = Callable[[Series, Path], None]  # raises when a marker cannot be printed


def prove(ported: Series, new_root: Path, lint: MarkerLint) -> None:
    """Apply, verify (hashes + compile) on a scratch copy of NEW_ROOT; lint the markers (the
    lint lives above patching/, so the command passes it in)."""
    with tempfile.TemporaryDirectory(prefix="m3patch-port-proof-") as scratch:
        copy = copy_tree(new_root, Path(scratch) / "tree")
        tree = tree_at(copy)
        report = apply_series(tree, ported)
        verify_tree(tree, ported, contents=report.contents).raise_for_failure()
    lint(ported, new_root)


def _out_error(out: Path, exc: OSError, what: str) -> TreeIOError:
    msg = f"{out}: {what} ({exc.strerror or exc})"
    return TreeIOError(msg, hint=f"pass --out a new folder in a folder you can write (check "
                                 f"`ls -ld {out.parent}`), or make {out.parent} writable")


def _incomplete(out: Path, doc: dict[str, Any], markdown: str, why: str) -> None:
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise _out_error(out, exc, "the port's output folder cannot be made") from None
    _write_report(out, doc, markdown)
    write_bytes_atomic(out / INCOMPLETE, (why.rstrip() + "\n").encode("utf-8"))


def _clear_incomplete(out: Path) -> None:
    """An --out holding exactly what an incomplete port writes (INCOMPLETE and the report) is
    this tool's own leftover: removed, so the port can be re-run into the same folder. A folder
    with anything else is left alone (and refused)."""
    if not out.is_dir() or out.is_symlink():
        return
    names = {entry.name for entry in out.iterdir()}
    if INCOMPLETE not in names or not names <= {INCOMPLETE, REPORT_MD, REPORT_JSON}:
        return
    for name in names:
        path = out / name
        if path.is_file() and not path.is_symlink():
            path.unlink()


def port_series(src: Path, new_root: Path, out: Path | None, *, command: str, lint: MarkerLint,
                series_id: str | None = None) -> PortResult:
    """Plan the port; with `out`, write it (complete and proven, or incomplete + PortConflict).
    `out=None` is the dry run: nothing is written."""
    series = load_series(src, with_lock=False)
    tree = tree_at(new_root)
    plan = read_plan(series, tree)
    new_id = series_id or new_series_id(series, tree.version)
    status = "conflict" if plan.conflicts else "dry-run" if out is None else "complete"
    doc = report_json(plan, _header(command, series, tree, out), status)
    markdown = report_markdown(doc, plan)
    if out is None:
        return PortResult(plan, doc, markdown, new_id, None)
    try:
        _prepare_out(out)
    except OSError as exc:
        raise _out_error(out, exc, "the port's output folder cannot be made or written") from None
    if plan.conflicts:
        hunks = [f"{p.id}: {f.path} hunk {h.index}" for p in plan.conflicts for f in p.files
                 for h in f.hunks if h.outcome == "conflict"]
        _incomplete(out, doc, markdown, "conflicts: " + "; ".join(hunks))
        msg = (f"{len(hunks)} hunk(s) conflict on vLLM {tree.version}: " + "; ".join(hunks)
               + f"; {out} holds the report only (no series.yaml)")
        raise PortConflict(msg, hint=(
            f"copy the source series ({series.directory}) to a folder of your own, edit those "
            f"hunks there to match vLLM {tree.version} (the report {out / REPORT_MD} shows each "
            f"beside the new lines), then `m3patch series port COPY --tree {tree.root} --out "
            f"{out}`: the same --out, whose report this run replaces"))
    staging = out.with_name(f".{out.name}.tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        ported = _stage(series, plan, new_id, tree, staging)
        prove(ported, tree.root, lint)
    except M3PatchError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        doc = {**doc, "status": "proof-failed", "proof-error": str(exc)}
        with contextlib.suppress(TreeIOError):  # the error that stopped the port is the one told
            _incomplete(out, doc, report_markdown(doc, plan), f"the proof failed: {exc}")
        raise
    _write_report(staging, doc, markdown)
    _move_into_place(staging, out)
    return PortResult(plan, doc, markdown, new_id, out)


def _prepare_out(out: Path) -> None:
    """--out is new or empty (or an earlier incomplete port's), and this user can write it: it
    is made now (empty) and a probe folder made and removed in it, so a folder that cannot be
    written is refused before any work. Raises OSError."""
    if out.is_symlink():  # renamed over at the end: never a link (UnsafeState, exit 34)
        owned_dir(out)
    _clear_incomplete(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        msg = f"{out}: exists and is not empty"
        raise UsageError(msg, hint="pass a new --out folder (the port never overwrites; it "
                         "replaces only the report of an earlier incomplete port)")
    out.mkdir(parents=True, exist_ok=True)
    probe = out / f".m3patch-probe{os.getpid()}"
    probe.mkdir()
    probe.rmdir()


def _move_into_place(staging: Path, out: Path) -> None:
    """The proven folder replaces the empty --out; on failure the staged one is removed."""
    try:
        if out.exists():
            out.rmdir()
        staging.rename(out)
    except OSError as exc:
        shutil.rmtree(staging, ignore_errors=True)
        raise _out_error(out, exc, f"the ported series (staged in {staging}) cannot be moved "
                                   "into place") from None
