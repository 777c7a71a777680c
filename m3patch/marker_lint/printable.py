"""Can a template print a marker? Exact, with wildcards: the marker must be a substring of
some expansion of the template (a value wildcard takes text without whitespace: one
interpolated name, path or number) AND share at least `MIN_LITERAL` consecutive characters
(all of it, when shorter) with the template's literal text. Without those two rules every
`"Using %s backend."` would "print" every `Using ... backend` marker; with them,
`Using 'EMULATION' MxFp8 MoE backend` is printable by `"Using '%s' MxFp8 MoE backend."` and by
`"... backend (user-requested)."`, and `Using EMULATION MxFp8 backend` by neither.
"""

from __future__ import annotations

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


def can_print(template: Template, marker: str) -> bool:
    """Simulate the template as an automaton started at every position (the marker may begin
    anywhere in the line) that may stop anywhere; per position keep the best literal run."""
    items = _flat(template)
    need = min(MIN_LITERAL, len(marker))
    if need == 0:
        return True
    # state: index of the next item -> score (consecutive literal chars so far, `need` = anchored)
    states: dict[int, int] = {}
    for i in range(len(items) + 1):
        states[i] = 0
    for ch in marker:
        nxt: dict[int, int] = {}
        for i, score in _closure(items, states).items():
            if i >= len(items):
                continue
            item = items[i]
            if item is None and ch.isspace():  # one value: no whitespace inside
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


def regex_literals(pattern: str) -> str | None:
    """The longest run of plain characters a `regex:` marker always needs; None for a pattern
    with alternatives (`|`) or no run a lint could check. A character before `*`, `?` or `{`
    is optional, so it ends the run without joining it."""
    if "|" in pattern:
        return None
    runs: list[str] = []
    run = ""
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "\\" and i + 1 < len(pattern):
            escaped = pattern[i + 1]
            if escaped.isalnum():  # \d, \w, \b ...: a class, not a literal
                runs.append(run)
                run = ""
            else:
                run += escaped
            i += 2
            continue
        if ch in "*?{":
            runs.append(run[:-1])
            run = ""
        elif ch in ".^$+[]()":
            runs.append(run)
            run = ""
            if ch == "[":  # skip the class
                end = pattern.find("]", i + 2)
                i = len(pattern) if end < 0 else end
        else:
            run += ch
        i += 1
    runs.append(run)
    best = max(runs, key=len)
    return best or None
