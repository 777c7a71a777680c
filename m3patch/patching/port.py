"""Porting a series to another vLLM (pure): each patch in order, against the new tree as the
earlier ported patches left it, hunk by hunk. Never fuzz.

Per hunk: `clean` (its old lines are exactly where its header says, after the earlier hunks'
shift), `offset` (found exactly once elsewhere, after the previous hunk), `upstream` (its new
lines are there, exactly once, and its old lines nowhere: the new vLLM already has the change,
so the hunk is dropped), or `conflict` (none of these, or the context matches in several
places). Per patch: clean, offset, partly-upstream, fully-upstream (the patch is dropped) or
conflict. A conflict carries the hunk, the old upstream region (the hunk's old lines), the
closest region of the new file and what changed between those two.

The regenerated patches are unified diffs (3 lines of context, `a/` `b/` names, `/dev/null` for a
new file; files in the patch's own order) of each file's pre-image on the new tree against its
post-image. A conflict's `new_line` is the new vLLM's line (before this patch's hunks).
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

from m3patch.patching import hunks as hk
from m3patch.patching.diffs import FilePatch, Hunk, PatchFile

HunkOutcome = Literal["clean", "offset", "upstream", "conflict"]
PatchOutcome = Literal["clean", "offset", "partly-upstream", "fully-upstream", "conflict"]
CONTEXT_LINES = 3
_RANGES = re.compile(r"@@ -(?P<old>\d+)(?P<old_len>,\d+)? \+(?P<new>\d+)(?P<new_len>,\d+)? @@"
                     r"(?P<rest>.*)$")
REGION_PAD = 2  # lines shown around a conflict's new upstream region


@dataclass(frozen=True)
class Conflict:
    why: str
    hunk: tuple[str, ...]  # the patch's hunk as diff lines (" ", "-", "+")
    old_region: tuple[str, ...]  # what the hunk expects (the old vLLM as the series left it)
    new_region: tuple[str, ...]  # the closest lines of the new file
    new_line: int  # 1-based first line of new_region
    changed: tuple[str, ...]  # unified diff old_region -> new_region


@dataclass(frozen=True)
class HunkPort:
    index: int
    outcome: HunkOutcome
    old_line: int  # 1-based line the header names (old vLLM)
    new_line: int | None  # 1-based line of the new vLLM's file (before this patch); None: conflict
    offset: int = 0
    conflict: Conflict | None = None


@dataclass(frozen=True)
class FilePort:
    path: str
    kind: str
    hunks: tuple[HunkPort, ...]
    pre: bytes | None  # the new tree's file as the earlier patches left it
    post: bytes | None  # after this patch's placed hunks (None: deleted or absent)

    @property
    def changed(self) -> bool:
        return self.pre != self.post


@dataclass(frozen=True)
class PatchPort:
    id: str
    file: str
    outcome: PatchOutcome
    files: tuple[FilePort, ...]
    upstream: tuple[str, ...] = ()
    drop_when: str = ""
    diff: str = ""  # regenerated unified diff ("" when dropped or in conflict)


@dataclass(frozen=True)
class PortPlan:
    patches: tuple[PatchPort, ...]
    contents: dict[str, bytes | None] = field(default_factory=dict)  # the new tree, ported

    @property
    def conflicts(self) -> tuple[PatchPort, ...]:
        return tuple(p for p in self.patches if p.outcome == "conflict")

    @property
    def kept(self) -> tuple[PatchPort, ...]:
        return tuple(p for p in self.patches if p.outcome not in ("fully-upstream", "conflict"))


def hunk_lines(hunk: Hunk) -> tuple[str, ...]:
    """The hunk as diff lines, via difflib so context and changes interleave as in the patch."""
    out: list[str] = []
    matcher = difflib.SequenceMatcher(a=hunk.old_lines, b=hunk.new_lines, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out += [" " + line.rstrip("\n") for line in hunk.old_lines[i1:i2]]
            continue
        out += ["-" + line.rstrip("\n") for line in hunk.old_lines[i1:i2]]
        out += ["+" + line.rstrip("\n") for line in hunk.new_lines[j1:j2]]
    return tuple(out)


def closest_region(lines: list[str], want: tuple[str, ...], expected: int) -> int:
    """Start of the window of `lines` sharing most lines with `want` (ties: nearest `expected`)."""
    if not lines or not want:
        return max(0, min(expected, len(lines)))
    wanted = set(want)
    best, best_key = 0, (-1, 0)
    for start in range(max(1, len(lines) - len(want) + 1)):
        if lines[start] not in wanted and start != expected:
            continue
        score = sum(1 for k, line in enumerate(want)
                    if start + k < len(lines) and lines[start + k] == line)
        key = (score, -abs(start - expected))
        if key > best_key:
            best, best_key = start, key
    return best


def renumber(header: str, old_first: int, new_first: int) -> str:
    """A `@@ -a,b +c,d @@` header of a diff between two excerpts, its line numbers made the
    files' own: the excerpts start at file lines `old_first` and `new_first` (1-based)."""
    match = _RANGES.match(header)
    if match is None:
        return header
    old, new = int(match["old"]) + old_first - 1, int(match["new"]) + new_first - 1
    return f"@@ -{old}{match['old_len'] or ''} +{new}{match['new_len'] or ''} @@{match['rest']}"


def region_diff(old: Sequence[str], old_first: int, new: Sequence[str],
                new_first: int) -> tuple[str, ...]:
    """What changed from the `old` to the `new` excerpt, numbered by the files' lines."""
    lines = [line.rstrip("\n") for line in difflib.unified_diff(
        list(old), list(new), "old upstream", "new upstream", n=1)][2:]
    return tuple(renumber(line, old_first, new_first) if line.startswith("@@") else line
                 for line in lines)


def _conflict(lines: list[str], hunk: Hunk, expected: int, why: str, placed: int = 0) -> Conflict:
    """`placed`: lines the earlier placed hunks of this file added, so the reported line is
    the new vLLM's own line number."""
    start = closest_region(lines, hunk.old_lines, expected)
    end = min(len(lines), start + len(hunk.old_lines))
    new_region = tuple(lines[start:end])
    new_line = start + 1 - placed
    changed = region_diff(hunk.old_lines, hk.old_index(hunk) + 1, new_region, new_line)
    return Conflict(why, hunk_lines(hunk), tuple(x.rstrip("\n") for x in hunk.old_lines),
                    tuple(x.rstrip("\n") for x in new_region), new_line, changed)


def _place(lines: list[str], hunk: Hunk, expected: int, floor: int) -> tuple[HunkOutcome, int, str]:
    """(outcome, 0-based index where the hunk's old lines start, why for a conflict)."""
    if not hunk.old_lines:  # a pure insertion: only its position can say where it goes
        return ("clean", expected, "") if 0 <= expected <= len(lines) else (
            "conflict", expected, "insertion point is past the end of the new file")
    if expected >= floor and tuple(lines[expected:expected + len(hunk.old_lines)]) == hunk.old_lines:
        return "clean", expected, ""
    places = [p for p in hk.find_all(lines, hunk.old_lines) if p >= floor]
    if len(places) == 1:
        return "offset", places[0], ""
    if len(places) > 1:
        where = ", ".join(str(p + 1) for p in places[:5])
        return "conflict", expected, f"context matches in {len(places)} places (lines {where})"
    return "conflict", expected, "the hunk's old lines are not in the new file (no fuzz)"


def _upstream_at(lines: list[str], hunk: Hunk) -> int | None:
    """Where the hunk's change already is: new lines exactly once, old lines nowhere."""
    if not hunk.new_lines or (hunk.old_lines and hk.find_all(lines, hunk.old_lines)):
        return None
    places = hk.find_all(lines, hunk.new_lines)
    return places[0] if len(places) == 1 else None


def port_file(fp: FilePatch, data: bytes | None) -> FilePort:
    """Place every hunk of one file diff on the new file; conflicts leave the file unchanged."""
    if fp.kind == "add":
        return _port_added(fp, data)
    lines = hk.to_lines(data)
    out = list(lines)
    results: list[HunkPort] = []
    shift = floor = placed = 0
    for hunk in fp.hunks:
        expected = hk.old_index(hunk) + shift
        outcome, at, why = _place(out, hunk, expected, floor)
        if outcome == "conflict":
            up = _upstream_at(out, hunk)
            if up is not None:
                results.append(HunkPort(hunk.index, "upstream", hunk.old_start, up - placed + 1,
                                        up - expected))
                shift += len(hunk.new_lines) - len(hunk.old_lines)
                floor = up + len(hunk.new_lines)
                continue
            results.append(HunkPort(hunk.index, "conflict", hunk.old_start, None,
                                    conflict=_conflict(out, hunk, expected, why, placed)))
            continue
        out[at:at + len(hunk.old_lines)] = hunk.new_lines
        # the new vLLM's own line (before this patch's earlier hunks moved it), as for conflicts
        results.append(HunkPort(hunk.index, outcome, hunk.old_start, at - placed + 1, at - expected))
        shift += len(hunk.new_lines) - len(hunk.old_lines)
        placed += len(hunk.new_lines) - len(hunk.old_lines)
        floor = at + len(hunk.new_lines)
    if any(r.outcome == "conflict" for r in results):
        return FilePort(fp.path, fp.kind, tuple(results), data, data)
    post: bytes | None = hk.to_bytes(out)
    if fp.kind == "delete" and not out:
        post = None
    return FilePort(fp.path, fp.kind, tuple(results), data, post)


def _port_added(fp: FilePatch, data: bytes | None) -> FilePort:
    new_lines = fp.hunks[0].new_lines if fp.hunks else ()
    new = hk.to_bytes(list(new_lines))
    if data is None:
        return FilePort(fp.path, fp.kind, (HunkPort(1, "clean", 0, 1),), None, new)
    if data == new:
        return FilePort(fp.path, fp.kind, (HunkPort(1, "upstream", 0, 1),), data, data)
    existing = hk.to_lines(data)
    changed = tuple(line.rstrip("\n") for line in difflib.unified_diff(
        list(new_lines), existing, "the patch's file", "new upstream", n=1))[2:]
    conflict = Conflict("the patch adds this file, but the new vLLM has a different one there",
                        tuple("+" + x.rstrip("\n") for x in new_lines), (),
                        tuple(x.rstrip("\n") for x in existing[:len(new_lines) + REGION_PAD]), 1,
                        changed)
    return FilePort(fp.path, fp.kind, (HunkPort(1, "conflict", 0, None, conflict=conflict),),
                    data, data)


def patch_outcome(files: Sequence[FilePort]) -> PatchOutcome:
    kinds = {h.outcome for f in files for h in f.hunks}
    if "conflict" in kinds:
        return "conflict"
    if kinds == {"upstream"}:
        return "fully-upstream"
    if "upstream" in kinds:
        return "partly-upstream"
    return "offset" if "offset" in kinds else "clean"


def file_diff(path: str, pre: bytes | None, post: bytes | None) -> str:
    """A clean unified diff of one file (what scripts/maintain/make_patch.py writes)."""
    old = hk.to_lines(pre)
    new = hk.to_lines(post)
    old_name = f"a/{path}" if pre is not None else "/dev/null"
    new_name = f"b/{path}" if post is not None else "/dev/null"
    return "".join(difflib.unified_diff(old, new, old_name, new_name, n=CONTEXT_LINES))


def plan_port(patches: Sequence[tuple[PatchFile, str, tuple[str, ...], str]],
              tree: Mapping[str, bytes | None]) -> PortPlan:
    """Port (patch, id, upstream, drop-when) in order on `tree` (the new vLLM's files that the
    patches touch; absent = None)."""
    current = dict(tree)
    ported: list[PatchPort] = []
    for patch, patch_id, upstream, drop_when in patches:
        files = tuple(port_file(fp, current.get(fp.path)) for fp in patch.files)
        outcome = patch_outcome(files)
        diff = ""
        if outcome not in ("conflict", "fully-upstream"):
            for f in files:
                current[f.path] = f.post
            diff = "".join(file_diff(f.path, f.pre, f.post) for f in files if f.changed)
        name = patch.name.rsplit("/", 1)[-1]  # the .patch file name inside the series folder
        ported.append(PatchPort(patch_id, name, outcome, files, upstream, drop_when, diff))
    return PortPlan(tuple(ported), current)
