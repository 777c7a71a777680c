"""Pure hunk mechanics on lists of lines: exact probes, exact apply, offset apply. Never fuzz.

A hunk's position comes from its header. For an empty side (`@@ -10,0 +11,2 @@`) the number is
the line AFTER which lines go, so the 0-based index is the number itself, not number - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from m3patch.errors import PatchConflict
from m3patch.patching.diffs import FilePatch, Hunk, decode, encode, split_lines

PENDING, APPLIED, CONFLICT, AMBIGUOUS = "pending", "applied", "conflict", "ambiguous"


@dataclass(frozen=True)
class HunkState:
    index: int
    state: str  # pending | applied | conflict | ambiguous
    line: int  # 1-based line probed in the current file
    detail: str  # first differing line for a conflict, else ""
    offset: int = 0  # lines away from the header's position (offset mode only)
    # a conflict's first differing line: 1-based number, the hunk's line, the file's line (no
    # line break, a \r kept so a CRLF file shows); None for other states
    differs_at: int | None = None
    expected: str | None = None
    found: str | None = None

    def fields(self, patch_id: str) -> dict[str, object]:
        """The hunk's object in --json output (docs/json-schema.md)."""
        return {"patch": patch_id, "hunk": self.index, "state": self.state, "line": self.line,
                "offset": self.offset, "differs_at": self.differs_at,
                "expected": self.expected, "found": self.found}


def difference(lines: list[str], at: int, want: tuple[str, ...]) -> tuple[int, str, str] | None:
    """(1-based line, expected, found) where `want` first differs from `lines` at `at`."""
    for offset, expected in enumerate(want):
        index = at + offset
        found = (lines[index] if 0 <= index < len(lines)
                 else "<before line 1>" if index < 0 else "<end of file>")
        if found != expected:
            shown = expected.removesuffix("\n"), found.removesuffix("\n")
            # lines that differ only in their line break are shown with it
            return (index + 1, *((expected, found) if shown[0] == shown[1] else shown))
    return None


def to_lines(data: bytes | None) -> list[str]:
    return [] if data is None else split_lines(decode(data))


def to_bytes(lines: list[str]) -> bytes:
    return encode("".join(lines))


def apply_file(fp: FilePatch, data: bytes | None, patch_id: str) -> bytes | None:
    """One patch's effect on one file, exact; None = the file is deleted."""
    if fp.kind == "add" and data is not None:
        msg = f"{fp.path}: patch {patch_id} adds this file but it already exists"
        raise PatchConflict(msg, hint="m3patch status shows what is there")
    out = apply_exact(to_lines(data), fp.hunks, fp.path)
    if fp.kind == "delete":
        if out:
            msg = f"{fp.path}: patch {patch_id} deletes it, but lines remain after its hunks"
            raise PatchConflict(msg, hint="regenerate the patch from the pristine tree")
        return None
    return to_bytes(out)


def old_index(hunk: Hunk) -> int:
    return hunk.old_start if not hunk.old_lines else hunk.old_start - 1


def _matches(lines: list[str], at: int, want: tuple[str, ...]) -> bool:
    return at >= 0 and at + len(want) <= len(lines) and tuple(lines[at:at + len(want)]) == want


def first_difference(lines: list[str], at: int, want: tuple[str, ...], path: str) -> str:
    """'path:LINE: expected X, found Y' for the first line where `want` differs at `at`."""
    where = difference(lines, at, want)
    if where is None:
        return f"{path}:{at + 1}: lines match"
    line, expected, found = where
    return f"{path}:{line}: expected {expected!r}, found {found!r}"


def probe(lines: list[str], hunks: Sequence[Hunk], path: str) -> tuple[HunkState, ...]:
    """Per hunk: forward probe (old lines exactly at its position) and reverse (new lines)."""
    states: list[HunkState] = []
    shift = 0  # hunks already applied before this one move it by their size change
    for hunk in hunks:
        at = old_index(hunk) + shift
        forward = _matches(lines, at, hunk.old_lines)
        reverse = _matches(lines, at, hunk.new_lines)
        if forward and reverse:
            states.append(HunkState(hunk.index, AMBIGUOUS, at + 1, "both old and new lines match"))
        elif reverse:
            states.append(HunkState(hunk.index, APPLIED, at + 1, ""))
            shift += len(hunk.new_lines) - len(hunk.old_lines)
        elif forward:
            states.append(HunkState(hunk.index, PENDING, at + 1, ""))
        else:
            detail = first_difference(lines, at, hunk.old_lines, path)
            where = difference(lines, at, hunk.old_lines)
            line, expected, found = where if where is not None else (None, None, None)
            states.append(HunkState(hunk.index, CONFLICT, at + 1, detail, differs_at=line,
                                    expected=expected, found=found))
    return tuple(states)


def apply_exact(lines: list[str], hunks: Sequence[Hunk], path: str) -> list[str]:
    """Apply hunks at exactly their header positions; any mismatch is a PatchConflict."""
    out = list(lines)
    shift = 0
    for hunk in hunks:
        at = old_index(hunk) + shift
        if not _matches(out, at, hunk.old_lines):
            detail = first_difference(out, at, hunk.old_lines, path)
            msg = f"{path}: hunk {hunk.index} does not apply exactly: {detail}"
            raise PatchConflict(msg, hint="m3patch status --json shows every hunk")
        out[at:at + len(hunk.old_lines)] = hunk.new_lines
        shift += len(hunk.new_lines) - len(hunk.old_lines)
    return out


def find_all(lines: list[str], want: tuple[str, ...], start: int = 0) -> list[int]:
    if not want:
        return []
    first = want[0]
    return [i for i in range(start, len(lines) - len(want) + 1)
            if lines[i] == first and tuple(lines[i:i + len(want)]) == want]


def _locate_unique(lines: list[str], hunk: Hunk, want: tuple[str, ...], floor: int,
                   path: str) -> int:
    places = find_all(lines, want)
    if len(places) > 1:
        where = ", ".join(str(p + 1) for p in places[:5])
        msg = f"{path}: hunk {hunk.index} context matches in {len(places)} places (lines {where})"
        raise PatchConflict(msg, hint="add context lines to the hunk so it matches once")
    if not places or places[0] < floor:
        msg = f"{path}: hunk {hunk.index} context not found anywhere (no fuzz)"
        raise PatchConflict(msg, hint="port the hunk by hand and regenerate the patch")
    return places[0]


def apply_offset(lines: list[str], hunks: Sequence[Hunk],
                 path: str) -> tuple[list[str], tuple[HunkState, ...]]:
    """Porting mode: each hunk's exact old lines, found once anywhere after the previous hunk."""
    out = list(lines)
    states: list[HunkState] = []
    size_shift = 0  # what earlier hunks added or removed
    floor = 0
    for hunk in hunks:
        expected = old_index(hunk) + size_shift
        if not hunk.old_lines:
            at = expected if 0 <= expected <= len(out) else len(out)
        else:
            at = _locate_unique(out, hunk, hunk.old_lines, floor, path)
        out[at:at + len(hunk.old_lines)] = hunk.new_lines
        states.append(HunkState(hunk.index, PENDING, at + 1, "", at - expected))
        size_shift += len(hunk.new_lines) - len(hunk.old_lines)
        floor = at + len(hunk.new_lines)
    return out, tuple(states)


def already_in(lines: list[str], hunks: Sequence[Hunk]) -> bool:
    """True when every hunk's new lines occur exactly once and none of its old lines do:
    the change is already in this file (upstream took it), so the patch can be dropped."""
    for hunk in hunks:
        if len(find_all(lines, hunk.new_lines)) != 1:
            return False
        if hunk.old_lines and find_all(lines, hunk.old_lines):
            return False
    return bool(hunks)
