"""The one versioned JSON shape of `--json` on apply, verify, revert, status and locate.

Every object carries the same envelope (schema, command, tool_version, exit_code, ok, tree_root,
vllm_version, series_id, mode, ledger_sha256) and the command's own fields; on an error the
object also carries `error` {type, message, hint}, so stdout is never empty under --json.
State names here are stable slugs without spaces ("modified-after-apply"); the human output
keeps its words. docs/json-schema.md documents every field.
"""

from __future__ import annotations

import json
from typing import Any

from m3patch import __version__, errors_handler
from m3patch.errors import M3PatchError
from m3patch.patching.ledger import digest, ledger_path, read_ledger
from m3patch.patching.locate import VllmTree

SCHEMA = "m3patch.report/1"


def ledger_fields(tree: VllmTree) -> dict[str, Any]:
    """The ledger's digest and recorded mode, or nulls; a ledger that does not parse gives its
    digest and a null mode (status and verify name why in their notes)."""
    try:
        data = ledger_path(tree.root).read_bytes()
    except OSError:
        return {"ledger_sha256": None, "mode": None}
    try:
        ledger = read_ledger(tree.root)
    except M3PatchError:  # status and verify name why in their notes
        ledger = None
    return {"ledger_sha256": digest(data), "mode": None if ledger is None else str(ledger.mode)}


def start(command: str, mode: str | None = None) -> dict[str, Any]:
    """The envelope of `command`'s object, registered at once so an error from here on (no vLLM
    found, a bad series) still prints it on stdout with `error` and the exit code. The command
    fills in its tree and fields and calls `finish`."""
    fields: dict[str, Any] = {
        "schema": SCHEMA, "command": command, "tool_version": __version__,
        "exit_code": 0, "ok": True, "tree_root": None, "vllm_version": None,
        "series_id": None, "mode": mode, "ledger_sha256": None}
    errors_handler.report_json_on_error(fields)
    return fields


def attach(fields: dict[str, Any], tree: VllmTree, series_id: str | None) -> None:
    """The tree, the series and the ledger as they are now into `fields`; the mode is the
    ledger's unless the command set its own (apply, revert)."""
    fields.update(tree_root=str(tree.root), vllm_version=tree.version, series_id=series_id)
    ledger = ledger_fields(tree)
    fields["ledger_sha256"] = ledger["ledger_sha256"]
    if fields["mode"] is None:
        fields["mode"] = ledger["mode"]


def finish(fields: dict[str, Any]) -> None:
    """Print the object of a run that exits 0."""
    errors_handler.report_json_on_error(None)
    print(json.dumps(fields, indent=2), flush=True)
