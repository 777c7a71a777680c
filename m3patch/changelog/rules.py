"""Append-only rules: how the head file may differ from the base (pure, text in, findings out).

Allowed: appending whole entries after the base's bytes (a base that lacks its final newline
may gain it: the append starts with "\\n"), or, on its own, repairing malformed historical
`pr-link:` lines (XXX, .../pull/N/changes, another repo) into this repo's PR URLs.
Everything else (edit, deletion, reorder, insertion, a repair mixed with new entries) is
rejected naming the head line. A byte-prefix test rather than a `git diff` scan, because the
diff shows a base without its final newline as a deleted last line (InferenceX #1753, #1717).
"""

from __future__ import annotations

import difflib
import re
from bisect import bisect_right
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from m3patch.changelog.entries import ChangelogEntry
from m3patch.changelog.findings import Finding, error
from m3patch.changelog.text import entry_starts, split_lines

PLACEHOLDER = "XXX"
PR_LINK_PREFIX = "  pr-link:"


@dataclass(frozen=True)
class Change:
    """kind: new-file | unchanged | append | repair | rejected. Entries below after_line are new."""

    kind: str
    after_line: int
    findings: tuple[Finding, ...] = ()
    repaired_lines: tuple[int, ...] = ()


def classify(base: str | None, head: str, *, base_label: str) -> Change:
    if base is None:
        return Change("new-file", 0)
    base_lines, head_lines = split_lines(base), split_lines(head)
    if head.startswith(base):
        return _prefix_change(base, head, base_lines, head_lines)
    if head_lines[: len(base_lines)] == base_lines:
        # Only the final newline differs (the head lacks it: text.ending_findings reports that).
        return Change("append", len(base_lines))
    pairs = zip(base_lines, head_lines, strict=False)  # the common prefix; lengths may differ
    diffs = [i for i, (b, h) in enumerate(pairs) if b != h]
    if diffs and all(_is_pr_link(base_lines[i]) and _is_pr_link(head_lines[i]) for i in diffs):
        if len(head_lines) == len(base_lines):
            repaired = tuple(i + 1 for i in diffs)
            return Change("repair", len(base_lines), repaired_lines=repaired)
        if len(head_lines) > len(base_lines):
            return Change("rejected", len(base_lines), (_mixed(diffs[0], len(base_lines)),))
    return Change("rejected", len(base_lines), (_violation(base_lines, head_lines, base_label),))


def _prefix_change(base: str, head: str, base_lines: list[str], head_lines: list[str]) -> Change:
    suffix = head[len(base) :]
    after = len(base_lines)
    if not suffix:
        return Change("unchanged", after)
    if base and not base.endswith("\n") and not suffix.startswith("\n"):
        msg = f"line {after} was extended: {head_lines[after - 1]!r}; existing lines are immutable"
        return Change("rejected", after, (error("append-only", msg, after, _FIX_IMMUTABLE),))
    body = suffix.lstrip("\n")
    if body and not (body.startswith("- ") or body.startswith("-\n")):
        first = next(n for n in range(after + 1, len(head_lines) + 1) if head_lines[n - 1].strip())
        msg = (f"line {first} {head_lines[first - 1]!r} continues the last existing entry;"
               " new entries start with '- ' at column 0")
        return Change("rejected", after, (error("append-only", msg, first, _FIX_IMMUTABLE),))
    return Change("append", after)


_FIX_IMMUTABLE = (
    "restore the existing entries from the base (git checkout BASE -- perf-changelog.yaml), then "
    "append your entry at the end; to undo a change, append an entry describing the revert"
)


def _is_pr_link(line: str) -> bool:
    return line.startswith(PR_LINK_PREFIX)


def _mixed(first_diff: int, base_count: int) -> Finding:
    msg = (f"line {first_diff + 1} repairs a historical pr-link, and lines from {base_count + 1} add"
           " new entries; a pr-link repair must be its own change")
    return error("pr-link-repair", msg, first_diff + 1, "split the repair and the new entries")


def _violation(base_lines: list[str], head_lines: list[str], base_label: str) -> Finding:
    fix = _FIX_IMMUTABLE.replace("BASE", base_label)
    reorder = _reorder(base_lines, head_lines)
    if reorder is not None:
        return error("append-only", reorder[1], reorder[0], fix)
    deleted = _deleted_entry(base_lines, head_lines)
    if deleted is not None:
        return error("append-only", deleted[1], deleted[0], fix)
    matcher = difflib.SequenceMatcher(None, base_lines, head_lines, autojunk=False)
    tag, i1, i2, j1, _ = next(op for op in matcher.get_opcodes() if op[0] != "equal")
    if tag == "delete":
        line = min(j1 + 1, len(head_lines))
        shown = head_lines[line - 1] if head_lines else ""
        msg = (f"base lines {i1 + 1}-{i2} deleted (first: {base_lines[i1]!r});"
               f" head line {line} is {shown!r}")
    elif tag == "insert":
        line = j1 + 1
        msg = (f"line {line} {head_lines[j1]!r} was inserted among existing entries;"
               " new entries go at the end of the file")
    else:
        line = j1 + 1
        msg = f"line {line} edited: {head_lines[j1]!r} (base line {i1 + 1}: {base_lines[i1]!r})"
    return error("append-only", msg, line, fix)


def _blocks(lines: list[str]) -> list[tuple[int, tuple[str, ...]]]:
    """(start line, entry lines without trailing blanks) for each entry."""
    starts = entry_starts(lines)
    ends = [s - 1 for s in starts[1:]] + [len(lines)]
    out = []
    for start, end in zip(starts, ends, strict=True):
        block = list(lines[start - 1 : end])
        while block and not block[-1].strip():
            block.pop()
        out.append((start, tuple(block)))
    return out


def _deleted_entry(base_lines: list[str], head_lines: list[str]) -> tuple[int, str] | None:
    """(head line, message) naming the first base entry missing from a head with fewer entries."""
    base_blocks, head_blocks = _blocks(base_lines), _blocks(head_lines)
    if len(head_blocks) >= len(base_blocks):
        return None
    index = next(
        (i for i, (_, b) in enumerate(base_blocks) if i >= len(head_blocks) or head_blocks[i][1] != b),
        len(head_blocks),
    )
    base_start, block = base_blocks[index]
    other = head_blocks[index][1] if index < len(head_blocks) else ()
    offset = next((k for k, text in enumerate(block) if k >= len(other) or other[k] != text), 0)
    line = head_blocks[index][0] + offset if index < len(head_blocks) else len(head_lines)
    shown = head_lines[line - 1] if head_lines else ""
    msg = (f"entries were deleted (base has {len(base_blocks)}, head has {len(head_blocks)}):"
           f" base entry {index + 1} (base line {base_start}) is gone, its line"
           f" {block[offset]!r} missing; head line {line} is {shown!r}")
    return line, msg


def _reorder(base_lines: list[str], head_lines: list[str]) -> tuple[int, str] | None:
    """(head line, message) when every base entry is still present but not in base order."""
    base_blocks, head_blocks = _blocks(base_lines), _blocks(head_lines)
    base_texts = [b for _, b in base_blocks]
    if not base_texts or Counter(base_texts) - Counter(b for _, b in head_blocks):
        return None
    for index, (line, block) in enumerate(head_blocks[: len(base_texts)]):
        if block != base_texts[index]:
            if block not in base_texts:
                msg = (f"line {line} starts a new entry inserted before existing entry"
                       f" {index + 1}; new entries go at the end of the file")
                return line, msg
            msg = (f"entries reordered: line {line} {block[0]!r} starts entry {index + 1}, which"
                   f" was entry {base_texts.index(block) + 1} in the base; existing entries keep"
                   " their order")
            return line, msg
    return None


def repaired_links(
    change: Change, base_data: Any, head_data: Any, starts: list[int], base_label: str,
) -> tuple[dict[int, tuple[str, str]], list[Finding]]:
    """Each repaired line's (base, head) pr-link as YAML reads them (quotes and comments are no
    part of a link). The lines only look like `pr-link:` lines: a repair is accepted only where
    the parsed entries differ in nothing but their pr-link (a look-alike line inside a
    multi-line description is an edit of that description)."""
    if not (isinstance(base_data, list) and isinstance(head_data, list)
            and len(base_data) == len(head_data) == len(starts)):
        return {}, []  # parse_entries reports the head; a base that does not parse is no repair
    values = {}
    for line in change.repaired_lines:
        index = bisect_right(starts, line) - 1
        old, new = base_data[index], head_data[index]
        if _without_link(old) != _without_link(new):
            msg = (f"line {line} edited: it is not the pr-link of the entry at line"
                   f" {starts[index]} but part of another key; existing entries are immutable")
            return {}, [error("append-only", msg, line, _FIX_IMMUTABLE.replace("BASE", base_label))]
        values[line] = (_link_text(old), _link_text(new))
    return values, []


def _without_link(entry: object) -> object:
    return {k: v for k, v in entry.items() if k != "pr-link"} if isinstance(entry, dict) else entry


def _link_text(entry: object) -> str:
    value = entry.get("pr-link") if isinstance(entry, dict) else None
    return value.strip() if isinstance(value, str) else ""


def pr_link_findings(
    head_lines: list[str], new: list[ChangelogEntry], repaired: Mapping[int, tuple[str, str]],
    repo: str, pr: int | None,
) -> list[Finding]:
    """New entries link their own PR (or XXX); repaired links must be canonical PR URLs. Values
    are the parsed ones; the raw lines only locate them."""
    canonical = re.compile(rf"https://github\.com/{re.escape(repo)}/pull/(\d+)")
    findings: list[Finding] = []
    for entry in new:
        value, line = entry.pr_link, _key_line(head_lines, entry.line, "pr-link")
        match = canonical.fullmatch(value)
        if value == PLACEHOLDER or (match and (pr is None or int(match.group(1)) == pr)):
            continue
        want = f"https://github.com/{repo}/pull/{pr if pr is not None else 'N'}"
        msg = (f"the new entry at line {entry.line} has pr-link {value!r}; expected {want} or"
               f" {PLACEHOLDER}")
        findings.append(error("pr-link", msg, line, f"set '  pr-link: {want}'"))
    for line, (before, value) in repaired.items():
        if canonical.fullmatch(before):
            msg = f"pr-link {before!r} was already a PR URL; only malformed links may be repaired"
            findings.append(error("pr-link-repair", msg, line, "restore the base's pr-link line"))
        elif not canonical.fullmatch(value):
            msg = f"repaired pr-link {value!r} is not a PR URL of {repo}"
            fix = f"set '  pr-link: https://github.com/{repo}/pull/N'"
            findings.append(error("pr-link-repair", msg, line, fix))
    return findings


def _key_line(lines: list[str], start: int, key: str) -> int:
    """The line of `key:` inside the entry starting at `start` (the entry line if not found)."""
    for number in range(start, len(lines) + 1):
        text = lines[number - 1]
        if number > start and text.startswith("- "):
            break
        if text.startswith((f"  {key}:", f"- {key}:")):
            return number
    return start
