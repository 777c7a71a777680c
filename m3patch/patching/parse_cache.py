"""Parsed patches, remembered by the sha256 of their bytes: a release-sized series (thousands of
hunks) parses in seconds with unidiff, and the same pinned bytes always give the same model.

`parsed(data, name, sha256)` is `diffs.parse_patch` with a memo under
`~/.cache/m3patch/parsed/<sha256>.json`, stamped with the parser's fingerprint. Callers pass the
hash the series lock pins and the bytes were just checked against (series_lock.pinned), so the
key names exactly these bytes. An entry is a header line (each file's path, kind, mode and hunk
count) and then the hunks: a warm apply takes its post-images from the image memo and needs only
the header, so the hunks (nearly all of a release-sized entry) are decoded on first use. The
memo is read back as hostile input: the header is checked field by field and every path goes
through `check_rel_path` again when read, the hunks when first used; anything unexpected means
the patch is parsed afresh (and, for a header, the entry rewritten). A memo that cannot be
written is only a slower next run; a read-only command never writes it (patching.memo).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import overload

from m3patch.errors import M3PatchError, TreeIOError
from m3patch.fsio import json_bytes, parse_json, path_is, read_state, write_cache_bytes
from m3patch.patching import memo
from m3patch.patching.diffs import (
    FileKind,
    FilePatch,
    Hunk,
    PatchFile,
    check_rel_path,
    parse_patch,
    split_lines,
)
from m3patch.patching.ledger import SHA256_RE

SCHEMA = 3  # 3: a header line, then the hunks (2: each hunk side one string)
KINDS = ("modify", "add", "delete")
PARSED_MODES = (None, 0o644, 0o755)  # what diffs.parse_patch gives a file's new_mode
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


def _to_bytes(patch: PatchFile, sha256: str) -> bytes:
    """A header line (what a warm apply reads: each file's path, kind, mode and hunk count),
    then the hunks (one list per file), read only when something uses them."""
    head = {"schema": SCHEMA, "parser": parser_fingerprint(), "sha256": sha256,
            "files": [[f.path, f.kind, f.new_mode, len(f.hunks)] for f in patch.files]}
    body = [[[h.index, h.old_start, h.new_start, h.header, "".join(h.old_lines),
              "".join(h.new_lines)] for h in f.hunks] for f in patch.files]
    return json_bytes(head, indent=None) + json_bytes(body, indent=None)


HunkRow = tuple[int, int, int, str, str, str]


class _Body:
    """One memo entry's hunks, decoded and checked on first use (most of a release-sized
    entry's bytes; a warm apply whose post-images come from the image memo never needs them).
    A body that is not what the header announced, or not a parse's at all (a torn or forged
    entry), is replaced by a fresh parse of the patch's own bytes, which the lock pinned."""

    __slots__ = ("_data", "_files", "_lock", "_name", "_raw", "counts", "paths")

    def __init__(self, raw: bytes, data: bytes, name: str, head: list[tuple[str, int]]) -> None:
        self._raw: bytes | None = raw  # the header line's end onward
        self._data, self._name = data, name
        self.paths = [path for path, _ in head]
        self.counts = [count for _, count in head]
        self._files: list[tuple[Hunk, ...]] | None = None
        self._lock = threading.Lock()  # classify reads hunks on several threads (folder_shares)

    def hunks(self, index: int) -> tuple[Hunk, ...]:
        with self._lock:
            if self._files is None:
                rows = self._stored()
                self._files = self._parsed() if rows is None else [
                    tuple(_make(row) for row in file) for file in rows]
                self._raw = None
            return self._files[index]

    def _stored(self) -> list[list[HunkRow]] | None:
        try:
            files = parse_json(self._raw or b"", self._name, error=TreeIOError, hint="",
                               expect=list)
            if len(files) != len(self.counts):
                return None
            rows = [[_hunk(h) for h in file] if isinstance(file, list) else None
                    for file in files]
        except (TypeError, ValueError, M3PatchError):
            return None
        if [None if file is None else len(file) for file in rows] != self.counts:
            return None
        return rows  # type: ignore[return-value]  # no None left: every count matched

    def _parsed(self) -> list[tuple[Hunk, ...]]:
        by_path = {f.path: tuple(f.hunks) for f in parse_patch(self._data, self._name).files}
        # the header's paths are the lock's (load_patches), and the lock's are this parse's
        return [by_path.get(path, ()) for path in self.paths]


def _make(row: HunkRow) -> Hunk:
    index, old, new, header, a, b = row
    return Hunk(index, old, tuple(split_lines(a)), new, tuple(split_lines(b)), header)


class StoredHunks(Sequence[Hunk]):
    """A memo entry's hunks for one file, read from the entry's body on first use.

    A hunk side is stored joined: within a side only the last line can lack its newline, so
    splitting after each newline gives the lines back exactly (and a one-string side is fast
    to check). Whatever a tampered memo holds, each applied result is still checked against
    the post-image hash the lock pins."""

    __slots__ = ("_body", "_index")

    def __init__(self, body: _Body, index: int) -> None:
        self._body, self._index = body, index

    def _all(self) -> tuple[Hunk, ...]:
        return self._body.hunks(self._index)

    @overload
    def __getitem__(self, index: int) -> Hunk: ...
    @overload
    def __getitem__(self, index: slice) -> tuple[Hunk, ...]: ...
    def __getitem__(self, index: int | slice) -> Hunk | tuple[Hunk, ...]:
        return self._all()[index]

    def __len__(self) -> int:
        return len(self._all())

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


def _hunk(raw: object) -> HunkRow:
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


def _head_file(raw: object, name: str) -> tuple[str, FileKind, int | None, int]:
    if not isinstance(raw, list) or len(raw) != 4 or raw[1] not in KINDS:
        msg = "file"
        raise TypeError(msg)
    path, kind, mode, count = raw
    if not isinstance(path, str) or check_rel_path(path, name) != path:
        msg = "path"
        raise TypeError(msg)
    if mode not in PARSED_MODES or isinstance(mode, bool):  # a setuid or world-writable mode
        msg = "mode"  # is no parse's: the parser refuses every mode but git's 644 and 755
        raise TypeError(msg)
    return path, kind, mode, _int(count)


def _from_bytes(raw: bytes, data: bytes, name: str, sha256: str) -> PatchFile | None:
    """The entry's patch model, its hunks left in the body; None for anything but this
    parser's entry for these bytes."""
    line, newline, rest = raw.partition(b"\n")
    try:
        head = parse_json(line, name, error=TreeIOError, hint="", expect=dict)
        files = head.get("files")
        if (not newline or head.get("schema") != SCHEMA or head.get("sha256") != sha256
                or head.get("parser") != parser_fingerprint()
                or not isinstance(files, list) or not files):
            return None
        rows = [_head_file(f, name) for f in files]
    except (TypeError, ValueError, M3PatchError):
        return None
    if len({path for path, *_ in rows}) != len(rows):
        return None
    body = _Body(rest, data, name, [(path, count) for path, _, _, count in rows])
    return PatchFile(name, tuple(FilePatch(path, kind, StoredHunks(body, index), mode)
                                 for index, (path, kind, mode, _) in enumerate(rows)))


def parsed(data: bytes, name: str, sha256: str, *, fresh: bool = False) -> PatchFile:
    """The patch's model: from the memo when it holds these bytes' parse, else parsed (and
    remembered). `sha256` must be the digest of `data` (the caller checked it against the lock).
    `fresh`: parse the bytes whatever the memo holds, and remember that parse (the retry of a
    run whose stored hunks did not give the pinned images)."""
    if not SHA256_RE.match(sha256):
        return parse_patch(data, name)
    path = _path(sha256)
    if not fresh and path_is(path, "file"):
        try:
            raw = read_state(path)
        except (OSError, M3PatchError):
            raw = b""
        cached = _from_bytes(raw, data, name, sha256)
        if cached is not None:
            return cached
    patch = parse_patch(data, name)
    if memo.writes_allowed():
        with contextlib.suppress(M3PatchError, OSError):
            write_cache_bytes(_root(), path, _to_bytes(patch, sha256), durable=False)
    return patch


def from_memo(patch: PatchFile) -> bool:
    """Whether any of the patch's hunks came from a memo entry (not from parsing its bytes)."""
    return any(isinstance(f.hunks, StoredHunks) for f in patch.files)
