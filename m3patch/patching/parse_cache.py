"""Parsed patches, remembered by the sha256 of their bytes: a release-sized series (thousands of
hunks) parses in seconds with unidiff, and the same pinned bytes always give the same model.

`parsed(data, name, sha256)` is `diffs.parse_patch` with a memo under
`~/.cache/m3patch/parsed/<sha256>.json`, stamped with the parser's fingerprint. Callers pass the hash the series lock pins and the
bytes were just checked against (series_lock.pinned), so the key names exactly these bytes. The
memo is read back as hostile input: the shape is checked field by field, every path goes through
`check_rel_path` again, and anything unexpected means the patch is parsed afresh and the entry
rewritten. A memo that cannot be written is only a slower next run; a read-only command never writes it
(patching.memo).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, overload

from m3patch.errors import M3PatchError, TreeIOError
from m3patch.fsio import path_is, read_json, write_cache_json
from m3patch.patching import memo
from m3patch.patching.diffs import (
    FilePatch,
    Hunk,
    PatchFile,
    check_rel_path,
    parse_patch,
    split_lines,
)
from m3patch.patching.ledger import SHA256_RE

SCHEMA = 2  # 2: each hunk side one string
KINDS = ("modify", "add", "delete")
_PARSER: list[str] = []  # the parser's fingerprint, once per process


def parser_fingerprint() -> str:
    """What decides a parse: the reading code (diffs.py's bytes) and unidiff's version; an entry
    another version of either made is parsed afresh, so a fix to the reading reaches every user."""
    if not _PARSER:
        import hashlib

        import unidiff

        from m3patch.patching import diffs

        code = hashlib.sha256(Path(diffs.__file__).read_bytes()).hexdigest()[:16]
        _PARSER.append(f"{code}-unidiff-{unidiff.VERSION}")
    return _PARSER[0]


def _root() -> Path:
    # deferred: pristine: only the cache location is needed
    from m3patch.patching.pristine import cache_root

    return cache_root()


def _path(sha256: str) -> Path:
    return _root() / "parsed" / f"{sha256}.json"


def _to_json(patch: PatchFile, sha256: str) -> dict[str, Any]:
    return {"schema": SCHEMA, "parser": parser_fingerprint(), "sha256": sha256, "files": [
        [f.path, f.kind, f.new_mode, [[h.index, h.old_start, h.new_start, h.header,
                                        "".join(h.old_lines), "".join(h.new_lines)]
                                       for h in f.hunks]]
        for f in patch.files]}


class StoredHunks(Sequence[Hunk]):
    """A memo entry's hunks, checked when read and made into Hunk objects on first use: a warm
    apply whose post-images come from the image memo never looks at them.

    A hunk side is stored joined: within a side only the last line can lack its newline, so
    splitting after each newline gives the lines back exactly (and a one-string side is fast
    to check). Whatever a tampered memo holds, each applied result is still checked against
    the post-image hash the lock pins."""

    __slots__ = ("_hunks", "_raw")

    def __init__(self, raw: list[tuple[int, int, int, str, str, str]]) -> None:
        self._raw: list[tuple[int, int, int, str, str, str]] | None = raw
        self._hunks: tuple[Hunk, ...] | None = None

    def _all(self) -> tuple[Hunk, ...]:
        if self._hunks is None:
            raw = self._raw or []
            self._hunks = tuple(Hunk(i, old, tuple(split_lines(a)), new, tuple(split_lines(b)), h)
                                for i, old, new, h, a, b in raw)
            self._raw = None
        return self._hunks

    @overload
    def __getitem__(self, index: int) -> Hunk: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Hunk, ...]: ...
    def __getitem__(self, index: int | slice) -> Hunk | tuple[Hunk, ...]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._raw) if self._raw is not None else len(self._all())

    def __iter__(self) -> Iterator[Hunk]:
        return iter(self._all())

    def __eq__(self, other: object) -> bool:
        if isinstance(other, (tuple, StoredHunks)):
            return self._all() == tuple(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self._all())

    def __repr__(self) -> str:
        return repr(self._all())


def _int(raw: object) -> int:
    if not isinstance(raw, int) or isinstance(raw, bool) or raw < 0:
        msg = "int"
        raise TypeError(msg)
    return raw


def _hunk(raw: object) -> tuple[int, int, int, str, str, str]:
    if (not isinstance(raw, list) or len(raw) != 6 or not isinstance(raw[3], str)
            or not isinstance(raw[4], str) or not isinstance(raw[5], str)):
        msg = "hunk"
        raise TypeError(msg)
    for text in raw[3:]:
        if not text.isascii():  # O(1) for ASCII: only other text pays for the check
            # a parse stores bytes decoded with surrogateescape; text that cannot go back to
            # bytes (a lone surrogate outside U+DC80-U+DCFF) is a forged memo, not a parse
            text.encode("utf-8", "surrogateescape")
    return _int(raw[0]), _int(raw[1]), _int(raw[2]), raw[3], raw[4], raw[5]


def _file(raw: object, name: str) -> FilePatch:
    if not isinstance(raw, list) or len(raw) != 4 or raw[1] not in KINDS:
        msg = "file"
        raise TypeError(msg)
    path, kind, mode, hunks = raw
    if not isinstance(path, str) or check_rel_path(path, name) != path or not isinstance(hunks, list):
        msg = "path"
        raise TypeError(msg)
    return FilePatch(path, kind, StoredHunks([_hunk(h) for h in hunks]),
                     None if mode is None else _int(mode))


def _from_json(body: dict[str, Any], name: str, sha256: str) -> PatchFile | None:
    if (body.get("schema") != SCHEMA or body.get("sha256") != sha256
            or body.get("parser") != parser_fingerprint()):
        return None
    raw = body.get("files")
    try:
        if not isinstance(raw, list) or not raw:
            return None
        files = tuple(_file(f, name) for f in raw)
    except (TypeError, ValueError, M3PatchError):
        return None
    if len({f.path for f in files}) != len(files):
        return None
    return PatchFile(name, files)


def parsed(data: bytes, name: str, sha256: str) -> PatchFile:
    """The patch's model: from the memo when it holds these bytes' parse, else parsed (and
    remembered). `sha256` must be the digest of `data` (the caller checked it against the lock)."""
    if not SHA256_RE.match(sha256):
        return parse_patch(data, name)
    path = _path(sha256)
    if path_is(path, "file"):
        try:
            body = read_json(path, error=TreeIOError, hint="", expect=dict)
        except M3PatchError:
            body = {}
        cached = _from_json(body, name, sha256)
        if cached is not None:
            return cached
    patch = parse_patch(data, name)
    if memo.writes_allowed():
        with contextlib.suppress(M3PatchError, OSError):
            write_cache_json(_root(), path, _to_json(patch, sha256), indent=None, durable=False)
    return patch
