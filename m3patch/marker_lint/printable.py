"""Can a template print a marker? Exact, with wildcards: the marker must be a substring of
some expansion of the template (a value wildcard takes text without whitespace: one
interpolated name, path or number) AND share at least `MIN_LITERAL` consecutive characters
(all of it, when shorter) with the template's literal text. Without those two rules every
`"Using %s backend."` would "print" every `Using ... backend` marker; with them,
`Using 'EMULATION' MxFp8 MoE backend` is printable by `"Using '%s' MxFp8 MoE backend."` and by
`"... backend (user-requested)."`, and `Using EMULATION MxFp8 backend` by neither.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from m3patch.marker_lint.sources import ANY, Template

MIN_LITERAL = 8


Item = str | int | None  # one literal char, ANY, or a value wildcard (None)


def _flat(template: Template) -> list[Item]:
    out: list[Item] = []
    for piece in template:
        if isinstance(piece, str):
            out.extend(piece)
        else:
            out.append(piece)
    return out


def can_print(template: Template, marker: str, literal_edges: tuple[int, int] = (0, 0)) -> bool:
    """Simulate the template as an automaton started at every position (the marker may begin
    anywhere in the line) that may stop anywhere; per position keep the best literal run.
    `literal_edges`: how many of the marker's first and last characters only the template's
    literal text may print (a wildcard may not)."""
    items = _flat(template)
    lead, trail = literal_edges
    need = min(MIN_LITERAL, len(marker))
    if need == 0:
        return True
    # state: index of the next item -> score (consecutive literal chars so far, `need` = anchored)
    states: dict[int, int] = {}
    for i in range(len(items) + 1):
        states[i] = 0
    for at, ch in enumerate(marker):
        pinned = at < lead or at >= len(marker) - trail
        nxt: dict[int, int] = {}
        for i, score in _closure(items, states).items():
            if i >= len(items):
                continue
            item = items[i]
            if item is None and ch.isspace():  # one value: no whitespace inside
                continue
            if pinned and not isinstance(item, str):
                continue
            if item is None or item == ANY:  # a wildcard eats the char and stays; a run breaks
                new_score = score if score >= need else 0
                if nxt.get(i, -1) < new_score:
                    nxt[i] = new_score
            elif item == ch:
                new_score = score if score >= need else score + 1
                if nxt.get(i + 1, -1) < new_score:
                    nxt[i + 1] = new_score
        if not nxt:
            return False
        states = nxt
    return any(score >= need for score in states.values())


def _closure(items: list[Item], states: dict[int, int]) -> dict[int, int]:
    """A wildcard may also match nothing: from a wildcard, the next item is reachable."""
    out = dict(states)
    for i in sorted(states):
        j, score = i, states[i]
        while j < len(items) and not isinstance(items[j], str):
            j += 1
            if out.get(j, -1) < score:
                out[j] = score
    return out


def anchors(marker: str) -> tuple[str, ...]:
    """Windows of the marker one of which a candidate template's literal text must contain."""
    need = min(MIN_LITERAL, len(marker))
    return tuple({marker[i:i + need] for i in range(len(marker) - need + 1)})


@dataclass(frozen=True)
class RegexRun:
    r"""The longest run of plain characters a `regex:` marker always needs, and whether the
    pattern goes on before (`open_start`) and after it (`open_end`): there a class such as `\w+`
    may glue onto the run's edge word, so that edge is part of a word, not the marker's cut."""

    text: str
    open_start: bool
    open_end: bool

    def edge_fragments(self) -> tuple[int, int]:
        """How many word characters at each open edge belong to a word the regex goes on."""
        lead = len(_LEAD_WORD.match(self.text).group()) if self.open_start else 0  # type: ignore[union-attr]
        trail = len(_TRAIL_WORD.search(self.text).group()) if self.open_end else 0  # type: ignore[union-attr]
        return lead, trail


_LEAD_WORD = re.compile(r"[A-Za-z0-9_]*")
_TRAIL_WORD = re.compile(r"[A-Za-z0-9_]*\Z")


def regex_literals(pattern: str) -> str | None:
    """The longest run of plain characters a `regex:` marker always needs (see `regex_run`)."""
    run = regex_run(pattern)
    return None if run is None else run.text


def regex_run(pattern: str) -> RegexRun | None:
    """The longest run of plain characters a `regex:` marker always needs; None for a pattern
    with alternatives (`|`) or no run a lint could check. A character before `*`, `?` or `{`
    is optional, so it ends the run without joining it."""
    if "|" in pattern:
        return None
    runs: list[tuple[str, int, int]] = []  # text, where it starts and ends in the pattern
    run, begun = "", 0
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped.isalnum():  # \d, \w, \b ...: a class, not a literal
                runs.append((run, begun, i))
                run, begun = "", i + 2
            else:
                run += escaped
            i += 2
            continue
        if ch in "*?{":
            runs.append((run[:-1], begun, i - 1))
            run, begun = "", i + 1
        elif ch in ".^$+[]()":
            runs.append((run, begun, i))
            if ch == "[":  # skip the class
                end = pattern.find("]", i + 2)
                i = len(pattern) if end < 0 else end
            run, begun = "", i + 1
        else:
            run += ch
        i += 1
    runs.append((run, begun, len(pattern)))
    best, start, end = max(runs, key=lambda r: len(r[0]))
    if not best:
        return None
    return RegexRun(best, pattern[:start] not in ("", "^"), pattern[end:] not in ("", "$"))
