"""The InferenceX row contract, read from docs/inferencex-fields.md (the table between the
`contract:begin` / `contract:end` markers), and the check of an aggregate row against it.

The doc is the one list: a field added to it is checked on every row the tests see, recorded
or from a real run, without touching this file.
"""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "inferencex-fields.md"
_ROW = re.compile(r"^\| `([^`]+)`(?P<rest>[^|]*)\| (?P<type>[^|]+?) \| (?P<by>[WR ]+) \|$")
_FAMILY = re.compile(r"`([^`]+)`")
DECODE = re.compile(r"_(tpot|itl|intvty)$")


def contract() -> dict[str, str]:
    """{field: type} for every field the doc's contract table lists (families expanded)."""
    text = DOC.read_text()
    table = text.split("<!-- contract:begin -->", 1)[1].split("<!-- contract:end -->", 1)[0]
    fields: dict[str, str] = {}
    for line in table.splitlines():
        match = _ROW.match(line)
        if match is None:
            continue
        name, kind = match.group(1), match.group("type")
        fields.update(dict.fromkeys(_expand(name, match.group("rest")), kind))
    return fields


def _expand(name: str, rest: str) -> list[str]:
    """`<S>_<M> for S in a, b and M in c, d` -> a_c, a_d, b_c, b_d."""
    if "<" not in name:
        return [name]
    values: dict[str, list[str]] = {}
    for var, items in re.findall(r"\b([A-Z]) in ([^A-Z]+?)(?= and [A-Z] in|$)", rest.strip()):
        values[var] = [v.strip() for v in items.replace(" and ", ", ").split(",") if v.strip()]
    out = [name]
    for var, items in values.items():
        out = [n.replace(f"<{var}>", item) for n in out for item in items]
    return out


def problems(row: dict[str, object]) -> list[str]:
    """Every contract field the row lacks or holds with another type than InferenceX's."""
    found = []
    for field, kind in contract().items():
        if field not in row:
            found.append(f"{field}: missing")
            continue
        value = row[field]
        if value is None and DECODE.search(field) and row.get("decode_na"):
            figure = row.get(f"inferencex_{field}")
            if figure is not None and not _is(figure, "number"):
                found.append(f"inferencex_{field}: {figure!r} is not a number")
            continue
        if not _is(value, kind):
            found.append(f"{field}: {value!r} is not {kind}")
    return found


def _is(value: object, kind: str) -> bool:
    if kind == "str":
        return isinstance(value, str) and value != ""
    if kind == "int":
        return isinstance(value, int) and not isinstance(value, bool)
    if kind == "bool":
        return isinstance(value, bool)
    if kind == "number":
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind == '"true" or "false"':
        return value in ("true", "false")
    raise AssertionError(f"unknown contract type {kind!r} in {DOC}")
