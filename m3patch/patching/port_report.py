"""The port report (pure): one JSON document and its Markdown rendering, per patch its outcome
and per hunk where it landed or, for a conflict, the hunk, the old and the new upstream region
side by side and what changed between them."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from m3patch import __version__
from m3patch.patching.port import Conflict, HunkPort, PatchPort, PortPlan

REPORT_SCHEMA = 1
SIDE_WIDTH = 60


def _hunk(h: HunkPort) -> dict[str, Any]:
    out: dict[str, Any] = {"hunk": h.index, "outcome": h.outcome, "old-line": h.old_line,
                           "new-line": h.new_line, "offset": h.offset}
    if h.conflict is not None:
        c = h.conflict
        out["conflict"] = {"why": c.why, "patch-hunk": list(c.hunk),
                           "old-upstream": list(c.old_region), "new-upstream": list(c.new_region),
                           "new-upstream-line": c.new_line, "changed": list(c.changed)}
    return out


def _patch(p: PatchPort) -> dict[str, Any]:
    return {"id": p.id, "file": p.file, "outcome": p.outcome, "upstream": list(p.upstream),
            "drop-when": p.drop_when,
            "files": [{"path": f.path, "kind": f.kind, "hunks": [_hunk(h) for h in f.hunks]}
                      for f in p.files]}


def report_json(plan: PortPlan, header: Mapping[str, Any], status: str) -> dict[str, Any]:
    """`header`: command, date, source {series, dir, vllm}, target {root, vllm, commit}, out."""
    counts: dict[str, int] = {}
    for p in plan.patches:
        counts[p.outcome] = counts.get(p.outcome, 0) + 1
    return {"schema": REPORT_SCHEMA, "tool": f"m3patch {__version__}", **header,
            "status": status, "counts": counts, "patches": [_patch(p) for p in plan.patches]}


def _side_by_side(c: Conflict) -> list[str]:
    rows = max(len(c.old_region), len(c.new_region))
    out = [f"{'old upstream (what the hunk expects)':<{SIDE_WIDTH}} | "
           f"new upstream (from line {c.new_line})", f"{'-' * SIDE_WIDTH}-+-{'-' * SIDE_WIDTH}"]
    for i in range(rows):
        left = c.old_region[i] if i < len(c.old_region) else ""
        right = c.new_region[i] if i < len(c.new_region) else ""
        mark = " " if left == right else "!"
        out.append(f"{left[:SIDE_WIDTH]:<{SIDE_WIDTH}} {mark} {right[:SIDE_WIDTH]}")
    return out


def _conflict_md(path: str, h: HunkPort, c: Conflict) -> list[str]:
    return [f"#### conflict: {path} hunk {h.index} (old line {h.old_line})", "",
            f"Why: {c.why}.", "", "The patch's hunk:", "", "```diff", *c.hunk, "```", "",
            "Old and new upstream side by side (`!` = the line differs):", "", "```",
            *_side_by_side(c), "```", "", "What changed upstream:", "", "```diff",
            *(c.changed or ["(nothing: the region is the same, the context is ambiguous)"]),
            "```", ""]


def _where(h: HunkPort) -> str:
    """Where the hunk lands in the new file; for a conflict, where its closest lines are, or
    why there are none."""
    if h.new_line is not None:
        return f"new line {h.new_line}"
    c = h.conflict
    if c is None:
        return "no new line"
    if c.new_region:
        return f"no exact new line: {c.why}; closest new lines from line {c.new_line}"
    return f"no new line: {c.why}"


def _outcome_line(p: PatchPort) -> str:
    if p.outcome == "fully-upstream":
        ups = ", ".join(p.upstream) or "no upstream reference recorded"
        return (f"dropped: every hunk is already in the new vLLM (upstream: {ups}; "
                f"drop-when: {p.drop_when})")
    if p.outcome == "partly-upstream":
        return f"kept, regenerated; some hunks already upstream (drop-when: {p.drop_when})"
    if p.outcome == "conflict":
        return "CONFLICT: port by hand (see below)"
    return "kept, regenerated" + (" (hunks moved)" if p.outcome == "offset" else "")


def report_markdown(doc: Mapping[str, Any], plan: PortPlan) -> str:
    src, tgt = doc["source"], doc["target"]
    lines = [f"# Port of series {src['series']} (vLLM {src['vllm']}) to vLLM {tgt['vllm']}", "",
             f"- command: `{doc['command']}`", f"- date: {doc['date']}",
             f"- tool: {doc['tool']}", f"- new tree: {tgt['root']}",
             f"- status: **{doc['status']}**", "",
             "| # | patch | outcome | hunks (clean/offset/upstream/conflict) | result |",
             "|---|---|---|---|---|"]
    for n, p in enumerate(plan.patches, start=1):
        kinds = [h.outcome for f in p.files for h in f.hunks]
        tally = "/".join(str(kinds.count(k)) for k in ("clean", "offset", "upstream", "conflict"))
        lines.append(f"| {n} | {p.id} | {p.outcome} | {tally} | {_outcome_line(p)} |")
    lines += ["", "## Hunks", ""]
    for p in plan.patches:
        lines += [f"### {p.id} ({p.file}): {p.outcome}", ""]
        for f in p.files:
            for h in f.hunks:
                shift = f", offset {h.offset:+d}" if h.offset else ""
                lines.append(f"- {f.path} hunk {h.index} (old line {h.old_line}): "
                             f"{h.outcome}, {_where(h)}{shift}")
        lines.append("")
        for f in p.files:
            for h in f.hunks:
                if h.conflict is not None:
                    lines += _conflict_md(f.path, h, h.conflict)
    return "\n".join(lines).rstrip() + "\n"
