"""Backend markers on server-log lines: the one marker type, matching, counting and the verdict.

A marker is a substring (or `regex:PATTERN`) searched in each log line. Required markers must
have appeared by readiness (exactly `count` times where one is given); a forbidden marker fails
the run whenever it appears; a `warn` marker never stops the run but, when it appears, is
reported (run summary, serve.json, the results' provenance, ci.json) with its `fix`. `MarkerSpec` is the shared vocabulary: the series manifest loader
and the recipe loader both build it, serving and `markers check` consume it. `MarkerChecker` is
fed raw chunks of the server's output as they arrive, so a line split across two writes (or a
UTF-8 character split across two reads) is matched once it is whole. No I/O here: the supervisor
feeds it, `markers check` feeds a file.

What m3patch's own stop causes never counts against the run: when the supervisor starts stopping
the server it writes `STOP_MARK` as a line of its own into the server log (and feeds the same
bytes to the live checker), and every marker after that line is only tallied in `after_stop`.
A saved log is judged the same way, up to the mark. The live checker honours only the mark the
supervisor writes (`mark_stop`): a server printing the same text does not end its own judging.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Literal

from m3patch.errors import MarkerForbidden, MarkerMissing, UsageError
from m3patch.schema import suggest

MarkerKind = Literal["required", "forbidden", "warn"]
MARKER_KINDS: tuple[MarkerKind, ...] = ("required", "forbidden", "warn")
REGEX_PREFIX = "regex:"
SHOWN_LINE_CHARS = 300
STOP_MARK = ("[m3patch] stop: m3patch is stopping the server (SIGINT to its process group); "
             "markers below this line are not judged")


@dataclass(frozen=True)
class MarkerSpec:
    """One marker, with who declared it (a patch of a series, or a recipe) for the message.

    `text` is a substring, or `regex:PATTERN`. `platforms` narrows a series marker to the
    platforms it applies to (empty: every platform); recipe markers are for their own platform.
    """

    id: str
    kind: MarkerKind
    text: str
    declared_by: str
    count: int | None = None
    platforms: tuple[str, ...] = ()
    fix: str | None = None  # warn markers: what removes the warning (shown with it)

    @property
    def regex(self) -> str | None:
        """The pattern of a `regex:` marker; None for a plain substring."""
        return self.text[len(REGEX_PREFIX):] if self.text.startswith(REGEX_PREFIX) else None

    def matches(self, line: str) -> bool:
        pattern = self.regex
        if pattern is not None:
            return re.search(pattern, line) is not None
        return self.text in line

    def describe(self) -> str:
        return f"{self.kind} marker {self.id!r} ({self.text!r}, declared by {self.declared_by})"


@dataclass(frozen=True)
class MarkerHit:
    marker: MarkerSpec
    line_no: int
    line: str

    def where(self, log_name: str) -> str:
        shown = self.line if len(self.line) <= SHOWN_LINE_CHARS else self.line[:SHOWN_LINE_CHARS] + "..."
        return f"{log_name}:{self.line_no}: {shown}"


@dataclass(frozen=True)
class MarkerWarning:
    """A warn marker that appeared: how often, where first, and the fix the recipe gave."""

    marker: MarkerSpec
    count: int
    first: MarkerHit

    def line(self, log_name: str) -> str:
        fix = f"; fix: {self.marker.fix}" if self.marker.fix else ""
        return (f"warning {self.marker.id!r} ({self.count}x, declared by "
                f"{self.marker.declared_by}) at {self.first.where(log_name)}{fix}")

    def to_json(self, log_name: str) -> dict[str, object]:
        return {"id": self.marker.id, "text": self.marker.text, "count": self.count,
                "first": self.first.where(log_name), "fix": self.marker.fix,
                "declared_by": self.marker.declared_by}


@dataclass
class MarkerChecker:
    """Streaming matcher: `feed()` raw output chunks; it keeps counts and first hits."""

    specs: tuple[MarkerSpec, ...]
    log_name: str = "server.log"
    counts: dict[str, int] = field(default_factory=dict)
    first_hit: dict[str, MarkerHit] = field(default_factory=dict)
    lines_seen: int = 0
    on_line: Callable[[str], None] | None = None  # e.g. the live view; called per whole line
    marks_in_stream: bool = True  # a saved log: its STOP_MARK line ends judging (live: False)
    stopped_at: int | None = None  # the line number of the stop mark, once seen
    after_stop: dict[str, int] = field(default_factory=dict)  # markers seen after it: not judged
    _partial: str = ""
    _decoder: codecs.IncrementalDecoder = field(
        default_factory=lambda: codecs.getincrementaldecoder("utf-8")(errors="replace")
    )

    def feed(self, chunk: bytes) -> list[MarkerHit]:
        """Match every line completed by this chunk; return the forbidden hits among them."""
        text = self._partial + self._decoder.decode(chunk)
        *whole, self._partial = text.split("\n")
        return self._match_lines(whole)

    def finish(self) -> list[MarkerHit]:
        """The stream ended: match the last line even without its newline."""
        rest = self._partial + self._decoder.decode(b"", final=True)
        self._partial = ""
        return self._match_lines([rest] if rest else [])

    def mark_stop(self) -> bytes:
        """m3patch starts stopping the server: the bytes to append to the log (the stop mark on
        a line of its own), already fed here, so the live verdict equals a saved log's."""
        if self.stopped_at is not None:
            return b""
        rest = self._partial + self._decoder.decode(b"", final=True)
        self._partial = ""
        self._match_lines([rest] if rest else [])  # the log's half line ends before the mark
        self._match_lines([STOP_MARK], trusted_mark=True)
        return f"{chr(10) if rest else ''}{STOP_MARK}\n".encode()

    def _match_lines(self, lines: Iterable[str], *, trusted_mark: bool = False) -> list[MarkerHit]:
        forbidden: list[MarkerHit] = []
        for raw in lines:
            self.lines_seen += 1
            line = raw.rstrip("\r")
            if self.on_line is not None:
                self.on_line(line)
            if (line == STOP_MARK and self.stopped_at is None
                    and (trusted_mark or self.marks_in_stream)):
                self.stopped_at = self.lines_seen
                continue
            for spec in self.specs:
                if not spec.matches(line):
                    continue
                if self.stopped_at is not None:
                    self.after_stop[spec.id] = self.after_stop.get(spec.id, 0) + 1
                    continue
                hit = MarkerHit(spec, self.lines_seen, line)
                self.counts[spec.id] = self.counts.get(spec.id, 0) + 1
                self.first_hit.setdefault(spec.id, hit)
                if spec.kind == "forbidden":
                    forbidden.append(hit)
        return forbidden

    def forbidden_hits(self) -> list[MarkerHit]:
        return [self.first_hit[s.id] for s in self.specs
                if s.kind == "forbidden" and s.id in self.first_hit]

    def missing(self) -> list[tuple[MarkerSpec, int]]:
        """Required markers absent, or present a different number of times than expected."""
        out: list[tuple[MarkerSpec, int]] = []
        for spec in self.specs:
            if spec.kind != "required":
                continue
            seen = self.counts.get(spec.id, 0)
            if seen == 0 or (spec.count is not None and seen != spec.count):
                out.append((spec, seen))
        return out

    def warnings(self) -> list[MarkerWarning]:
        """The warn markers that appeared, in declaration order (they never stop the run)."""
        return [MarkerWarning(s, self.counts[s.id], self.first_hit[s.id]) for s in self.specs
                if s.kind == "warn" and s.id in self.first_hit]

    def raise_if_forbidden(self, *, hint: str) -> None:
        hits = self.forbidden_hits()
        if hits:
            raise forbidden_error(hits[0], self.log_name, hint=hint)

    def raise_if_missing(self, *, hint: str) -> None:
        missing = self.missing()
        if missing:
            raise missing_error(missing, self.log_name, hint=hint)


def as_kind(value: str) -> MarkerKind:
    """A validated kind string as the `MarkerKind` literal (loaders check the choice first)."""
    for kind in MARKER_KINDS:
        if value == kind:
            return kind
    msg = f"unknown marker kind {value!r}"
    raise ValueError(msg)


def regex_text(pattern: str) -> str:
    """The `text` of a regex marker; an invalid pattern is a ValueError naming it."""
    try:
        re.compile(pattern)
    except re.error as exc:
        msg = f"invalid regex {pattern!r}: {exc}"
        raise ValueError(msg) from None
    return REGEX_PREFIX + pattern


def forbidden_error(hit: MarkerHit, log_name: str, *, hint: str) -> MarkerForbidden:
    msg = f"{hit.marker.describe()} appeared at {hit.where(log_name)}"
    return MarkerForbidden(msg, hint=hint)


def missing_error(
    missing: list[tuple[MarkerSpec, int]], log_name: str, *, hint: str
) -> MarkerMissing:
    parts = []
    for spec, seen in missing:
        if seen == 0:
            parts.append(f"{spec.describe()} never appeared")
        else:
            parts.append(f"{spec.describe()} appeared {seen} times, expected {spec.count}")
    msg = f"{log_name}: " + "; ".join(parts)
    return MarkerMissing(msg, hint=hint)


def judge_log(data: bytes, specs: tuple[MarkerSpec, ...], *, log_name: str) -> MarkerChecker:
    """A saved log through the checker, judged up to its last stop mark: the supervisor writes
    one, after everything the server printed before the stop, so an earlier copy of the text
    (printed by the server itself) does not end the judging."""
    checker = MarkerChecker(specs, log_name=log_name, marks_in_stream=False)
    mark = STOP_MARK.encode()
    cut = max(data.rfind(b"\n" + mark + b"\n"), data.rfind(b"\n" + mark + b"\r\n"))
    if data.startswith(mark + b"\n") and cut < 0:
        cut = -1  # the mark as the log's first line
    elif cut < 0:
        cut = len(data) - 1
    checker.feed(data[:cut + 1])
    checker.marks_in_stream = True
    checker.feed(data[cut + 1:])
    checker.finish()
    return checker


def check_log_bytes(data: bytes, specs: tuple[MarkerSpec, ...], *, log_name: str,
                    hint: str) -> MarkerChecker:
    """Whole-log verdict (forbidden first, then required); returns the checker for counts."""
    checker = judge_log(data, specs, log_name=log_name)
    checker.raise_if_forbidden(hint=hint)
    checker.raise_if_missing(hint=hint)
    return checker


def merge_markers(
    series: tuple[MarkerSpec, ...], recipe: tuple[MarkerSpec, ...], counts: dict[str, int],
    waivers: dict[str, str] | None = None,
) -> tuple[MarkerSpec, ...]:
    """Series markers first, with the recipe's expected counts applied by id, then the recipe's.

    A recipe adds and never silently removes: an id given twice keeps both specs (both must
    hold); a series marker is dropped only by an explicit waiver with a reason, and the
    provenance markers can never be waived.
    """
    waivers = waivers or {}
    known = {s.id for s in (*series, *recipe)}
    for marker_id in counts:
        if marker_id not in known:
            msg = f"markers.counts names {marker_id!r}, which no patch or recipe declares"
            raise UsageError(msg, hint=f"use one of: {', '.join(sorted(known))}")
    series_ids = {s.id for s in series}
    for marker_id in waivers:
        if marker_id not in series_ids:
            msg = (f"markers.waive names {marker_id!r}, which is not a marker of the series for "
                   f"this platform.{suggest(marker_id, series_ids)}")
            raise UsageError(msg, hint="waive only series markers; recipe markers can be deleted")
        if marker_id.startswith("provenance"):
            msg = f"markers.waive: {marker_id!r} proves the server runs the patched tree"
            raise UsageError(msg, hint=f"remove {marker_id!r} from markers.waive")
    merged = [replace(s, count=counts.get(s.id, s.count)) for s in series if s.id not in waivers]
    return (*merged, *recipe)
