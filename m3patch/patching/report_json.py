"""The one versioned JSON shape of `--json` on apply, verify, revert, status and locate, and of
the run reports of serve, bench and ci (their steps, recipe and run folder in the same envelope).

Every object carries the same envelope (schema, command, tool_version, exit_code, ok, tree_root,
vllm_version, series_id, mode, ledger_sha256) and the command's own fields; on an error the
object also carries `error` {type, message, hint}, so stdout is never empty under --json.
State names here are stable slugs without spaces ("modified-after-apply"); the human output
keeps its words. docs/json-schema.md documents every field.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from m3patch import __version__, errors_handler
from m3patch.errors import M3PatchError, raise_if_interrupted
from m3patch.fsio import read_state
from m3patch.patching.ledger import digest, ledger_path, read_ledger
from m3patch.patching.locate import VllmTree, find_vllm

SCHEMA = "m3patch.report/1"


def ledger_fields(tree: VllmTree) -> dict[str, Any]:
    """The ledger's digest and recorded mode, or nulls; a ledger that does not parse gives its
    digest and a null mode (status and verify name why in their notes)."""
    try:
        data = read_state(ledger_path(tree.root))  # never a FIFO, a link or /dev/zero
    except OSError:
        return {"ledger_sha256": None, "mode": None}
    try:
        ledger = read_ledger(tree.root)
    except M3PatchError:  # status and verify name why in their notes
        ledger = None
    return {"ledger_sha256": digest(data), "mode": None if ledger is None else str(ledger.mode)}


def envelope(command: str, mode: str | None = None) -> dict[str, Any]:
    """The envelope's fields, nothing known yet about the tree."""
    return {"schema": SCHEMA, "command": command, "tool_version": __version__,
            "exit_code": 0, "ok": True, "tree_root": None, "vllm_version": None,
            "series_id": None, "mode": mode, "ledger_sha256": None}


def start(command: str, mode: str | None = None) -> dict[str, Any]:
    """The envelope of `command`'s object, registered at once so an error from here on (no vLLM
    found, a bad series) still prints it on stdout with `error` and the exit code. The command
    fills in its tree and fields and calls `finish`."""
    fields = envelope(command, mode)
    errors_handler.report_json_on_error(fields)
    return fields


def attach_run(fields: dict[str, Any], *, recipe: Path, run_dir: Path | None,
               python: str | None, ledger_sha256: str | None,
               steps: Sequence[dict[str, Any]]) -> None:
    """A run's report (serve, bench, ci): the recipe, the run folder, the steps, and, when the
    run prepared a tree (apply-verify ran), that tree with the ledger digest the server was
    verified against. An external server or a resumed run without a server: tree fields null."""
    fields.update(recipe=str(recipe), run_dir=None if run_dir is None else str(run_dir),
                  steps=list(steps))
    if ledger_sha256 is None:
        return
    try:
        tree = find_vllm(python=python)
        ledger = read_ledger(tree.root)
    except M3PatchError:  # the tree moved since it was verified: the digest still stands
        fields["ledger_sha256"] = ledger_sha256
        return
    attach(fields, tree, None if ledger is None else ledger.series)
    fields["ledger_sha256"] = ledger_sha256


def attach(fields: dict[str, Any], tree: VllmTree, series_id: str | None) -> None:
    """The tree, the series and the ledger as they are now into `fields`; the mode is the
    ledger's unless the command set its own (apply, revert)."""
    fields.update(tree_root=str(tree.root), vllm_version=tree.version, series_id=series_id)
    ledger = ledger_fields(tree)
    fields["ledger_sha256"] = ledger["ledger_sha256"]
    if fields["mode"] is None:
        fields["mode"] = ledger["mode"]


def finish(fields: dict[str, Any]) -> None:
    """Print the object of a run that exits 0; a stop signal that a best-effort step swallowed
    is raised instead, so the one object printed is Interrupted's (130)."""
    raise_if_interrupted()
    errors_handler.report_json_on_error(None)
    print(json.dumps(fields, indent=2), flush=True)
