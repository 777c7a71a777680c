"""The recipe's marker gates: its own required / forbidden / warn markers, counts, waivers.

A `warn` marker never stops the run; it names a `fix` (the command that removes the cause, e.g.
a tuning run for a shape the series ships no table for), shown wherever the warning is reported.

Series markers come from the series manifest; the recipe adds its own, sets how many times a
marker must appear (`counts`) and may drop a series marker only by a reasoned waiver (`waive`).
Merging them with the series' markers is markers.merge_markers, at launch time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from m3patch.markers import MARKER_KINDS, REGEX_PREFIX, MarkerKind, MarkerSpec, regex_text
from m3patch.schema import (
    SchemaError,
    at_key,
    check_keys,
    expect_int,
    expect_list,
    expect_mapping,
    expect_str,
    expect_str_keys,
)


@dataclass(frozen=True)
class MarkerGates:
    markers: tuple[MarkerSpec, ...]              # the recipe's own: required, forbidden, warn
    counts: tuple[tuple[str, int], ...]          # expected count by marker id
    waivers: tuple[tuple[str, str], ...]         # series marker id -> reason


def _check_regex(text: str) -> None:
    """A `regex:PATTERN` text must compile here, not fail at the first log line."""
    if text.startswith(REGEX_PREFIX):
        with at_key("text"):
            try:
                regex_text(text[len(REGEX_PREFIX):])
            except ValueError as exc:
                raise SchemaError(str(exc)) from None


def _marker_list(raw: object, kind: MarkerKind, source: str) -> list[MarkerSpec]:
    out = []
    for index, item in enumerate(expect_list(raw)):
        with at_key(index):
            data = expect_mapping(item)
            optional = ("count",) if kind == "required" else ("fix",) if kind == "warn" else ()
            check_keys(data, required=("id", "text"), optional=optional)
            fix = None
            if "fix" in data:
                with at_key("fix"):
                    fix = expect_str(data["fix"])
            count = None
            if "count" in data:
                with at_key("count"):
                    count = expect_int(data["count"], minimum=1)
            text = expect_str(data["text"])
            _check_regex(text)
            out.append(MarkerSpec(expect_str(data["id"]), kind, text, source, count, fix=fix))
    return out


def markers(data: dict[str, Any], *, source: str) -> MarkerGates:
    """The `markers` section; `source` is the 'declared by' of the recipe's own markers.

    A waiver needs a reason: it is printed at every launch and in `recipe show`, so dropping a
    series marker is always visible (e.g. a backend choice that never reaches the patched path).
    """
    check_keys(data, optional=("required", "forbidden", "warn", "counts", "waive"))
    specs: list[MarkerSpec] = []
    for kind in MARKER_KINDS:
        with at_key(kind):
            specs += _marker_list(data.get(kind, []), kind, source)
    counts = []
    with at_key("counts"):
        for marker_id, value in expect_str_keys(data.get("counts", {})).items():
            with at_key(marker_id):
                counts.append((marker_id, expect_int(value, minimum=1)))
    waivers = []
    with at_key("waive"):
        for marker_id, reason in expect_str_keys(data.get("waive", {})).items():
            with at_key(marker_id):
                waivers.append((marker_id, expect_str(reason)))
    return MarkerGates(tuple(specs), tuple(counts), tuple(waivers))
