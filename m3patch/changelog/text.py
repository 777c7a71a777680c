"""Byte- and line-level rules for perf-changelog.yaml (pure: text in, findings out).

YAML parsing forgives things that break the append-only check later: a CR or a missing final
newline turns the next append into a "deleted line" in `git diff` (the InferenceX #1753
incident), so the raw text is held to a stricter layout than YAML needs.
"""

from __future__ import annotations

from m3patch.changelog.findings import Finding, error

_BAD_CHARS = {"\x00": "NUL byte", "\r": "carriage return (CR)", "\t": "tab"}
FIX_LAYOUT = "keep one blank line between entries and end the file with one newline"


def decode(raw: bytes) -> tuple[str | None, list[Finding]]:
    try:
        return raw.decode("utf-8"), []
    except UnicodeDecodeError as exc:
        line = raw[: exc.start].count(b"\n") + 1
        return None, [error("encoding", f"not UTF-8 (byte {exc.start})", line)]


def split_lines(text: str) -> list[str]:
    """Lines split on LF only (str.splitlines also splits on form feeds and U+2028)."""
    lines = text.split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    return lines


def character_findings(lines: list[str]) -> list[Finding]:
    """One finding per forbidden character kind, at its first occurrence."""
    found: list[Finding] = []
    for char, name in _BAD_CHARS.items():
        for number, line in enumerate(lines, start=1):
            column = line.find(char)
            if column >= 0:
                msg = f"{name} at column {column + 1}; tabs, CR and NUL are not allowed"
                found.append(error("characters", msg, number, "use spaces and LF line endings"))
                break
    return found


def ending_findings(text: str, lines: list[str]) -> list[Finding]:
    if not text.strip():
        return [error("empty", "the file has no entries", None, "add an entry: - config-keys: ...")]
    if not text.endswith("\n"):
        msg = "the file does not end with a newline (the next append would rewrite this line)"
        return [error("final-newline", msg, len(lines), "add one newline at the end of the file")]
    if text.endswith("\n\n"):
        last_text = max(i for i, line in enumerate(lines, start=1) if line.strip())
        msg = "blank line(s) at the end of the file; it must end with exactly one newline"
        return [error("final-newline", msg, last_text + 1, FIX_LAYOUT)]
    return []


def entry_starts(lines: list[str]) -> list[int]:
    """1-based line numbers of top-level list items (each entry starts with '- ' at column 0)."""
    return [n for n, line in enumerate(lines, start=1) if line.startswith("- ") or line == "-"]


def layout_findings(lines: list[str], starts: list[int], after_line: int) -> list[Finding]:
    """Exactly one blank line between entries, none inside one; only lines > after_line count."""
    found: list[Finding] = []
    for index, start in enumerate(starts):
        end = starts[index + 1] - 1 if index + 1 < len(starts) else len(lines)
        found += _block_findings(lines, start, end, is_last=index + 1 == len(starts))
    return [f for f in found if f.line is not None and f.line > after_line]


def _block_findings(lines: list[str], start: int, end: int, *, is_last: bool) -> list[Finding]:
    block = lines[start - 1 : end]
    trailing = len(block) - len("\n".join(block).rstrip().split("\n"))
    found: list[Finding] = []
    for offset, line in enumerate(block[: len(block) - trailing]):
        if not line.strip():
            msg = "blank line inside an entry; entries are separated by exactly one blank line"
            found.append(error("layout", msg, start + offset, FIX_LAYOUT))
    if is_last:
        return found  # blank lines at the end of the file are ending_findings' job
    if trailing == 0:
        msg = f"entry at line {end + 1} must be preceded by exactly one blank line"
        found.append(error("layout", msg, end + 1, FIX_LAYOUT))
    elif trailing > 1:
        msg = f"{trailing} blank lines between entries; use exactly one"
        found.append(error("layout", msg, end - trailing + 2, FIX_LAYOUT))
    return found
