"""Post-images a series' lock pins, remembered by their sha256: a warm apply takes each file's
final image from here instead of reading every hunk and applying it again.

The lock pins every file's final hash, so the bytes that hash to it are the only right answer
whoever computed them: each image is checked against the pin before use, and an image that does
not hash to it is not used (the hunks are applied as without the memo). One pack per lock,
`~/.cache/m3patch/images/<key>.bin`, keyed by the lock's pins (patch hashes and every file's
chain of hashes); it is written only by an apply that computed every file's post-image from the
patches under that same lock, each step checked against its pin, so a pack stands for a lock
whose patches were seen to give its pins. A deleted file has no image: under a pack, a file the
lock deletes is deleted without its hunks being read again.

Layout: one line `M3PATCH-IMAGES 1`, one line of JSON (`{"key": KEY, "images": [[sha256,
length], ...]}`), then the images' bytes in that order. Read back as hostile input (a regular
file, no link, bounded; the header's shape and lengths checked); anything unexpected means no
pack. Written without fsync (a lost or torn pack is only a slower next run); a read-only command
never writes it (patching.memo).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from m3patch.errors import M3PatchError
from m3patch.fsio import STATE_MAX_BYTES, read_state, write_cache_bytes
from m3patch.patching import memo
from m3patch.patching.ledger import SHA256_RE, digest

if TYPE_CHECKING:
    from m3patch.patching.series_lock import SeriesLock

MAGIC = b"M3PATCH-IMAGES 1\n"
LIMIT = STATE_MAX_BYTES  # a series whose post-images exceed this is applied without a pack


def pack_key(lock: SeriesLock) -> str:
    """What the pack stands for: every patch's pinned hash and every file's pins, in order."""
    pins = [[p.id, p.sha256, [[f.path, f.pre, f.post] for f in p.files]] for p in lock.patches]
    return hashlib.sha256(json.dumps(pins, separators=(",", ":")).encode()).hexdigest()


def _path(key: str) -> Path:
    # deferred: pristine: only the cache location is needed
    from m3patch.patching.pristine import cache_root

    return cache_root() / "images" / f"{key}.bin"


class ImagePack:
    """The images of one pack; `image(sha256)` gives bytes that hash to it, or None."""

    def __init__(self, data: bytes, where: dict[str, tuple[int, int]]) -> None:
        self._data = data
        self._where = where

    def image(self, sha256: str) -> bytes | None:
        span = self._where.get(sha256)
        if span is None:
            return None
        data = self._data[span[0]:span[1]]
        return data if digest(data) == sha256 else None


def _spans(header: object, size: int, start: int, key: str) -> dict[str, tuple[int, int]] | None:
    if not isinstance(header, dict) or header.get("key") != key:
        return None
    images = header.get("images")
    if not isinstance(images, list):
        return None
    where: dict[str, tuple[int, int]] = {}
    at = start
    for item in images:
        if (not isinstance(item, list) or len(item) != 2 or not isinstance(item[0], str)
                or not SHA256_RE.match(item[0]) or not isinstance(item[1], int)
                or isinstance(item[1], bool) or item[1] < 0):
            return None
        where[item[0]] = (at, at + item[1])
        at += item[1]
    return where if at == size else None


def load(lock: SeriesLock) -> ImagePack | None:
    """The pack of this lock, or None (absent, unreadable, or not of the exact shape)."""
    key = pack_key(lock)
    try:
        data = read_state(_path(key), LIMIT)
    except (OSError, ValueError, M3PatchError):
        return None
    if not data.startswith(MAGIC):
        return None
    end = data.find(b"\n", len(MAGIC))
    if end < 0:
        return None
    try:
        header = json.loads(data[len(MAGIC):end])
    except (ValueError, RecursionError):
        return None
    where = _spans(header, len(data), end + 1, key)
    return None if where is None else ImagePack(data, where)


def save(lock: SeriesLock, images: Mapping[str, bytes]) -> None:
    """Remember these post-images (by sha256) as the pack of this lock; a pack that cannot be
    written is only a slower next run."""
    if not memo.writes_allowed() or not images:
        return
    order = sorted(images)
    header = {"key": pack_key(lock), "images": [[h, len(images[h])] for h in order]}
    body = [MAGIC, json.dumps(header, separators=(",", ":")).encode(), b"\n"]
    body += [images[h] for h in order]
    data = b"".join(body)
    if len(data) > LIMIT:
        return
    path = _path(str(header["key"]))
    with contextlib.suppress(M3PatchError, OSError):
        write_cache_bytes(path.parent.parent, path, data, durable=False)
