"""One tree's texts, kept between runs: parsing vLLM's ~3,200 files takes half a minute, so
the extracted sources are cached under the m3patch cache, keyed by every .py file's path and
content (sha256). A cache file is read back as hostile input: anything malformed is ignored and
rebuilt, never trusted."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from m3patch.errors import M3PatchError, TreeIOError
from m3patch.fsio import read_state, write_cache_json
from m3patch.marker_lint.sources import ANY, Source, file_sources
from m3patch.patching.pristine import cache_root

CACHE_SCHEMA = 4
# in-process memo: (root, every file's path, size, mtime, inode) -> texts; loading the cache
# file costs seconds, and `recipe validate` / `series lock` may run many times in one process
_MEMO: dict[str, list[Source]] = {}
_MEMO_MAX = 4


def tree_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "vllm").rglob("*.py") if p.is_file() and not p.is_symlink())


def file_digests(root: Path, files: list[Path]) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(_read(p)).hexdigest() for p in files}


def tree_key(digests: dict[str, str]) -> str:
    """The tree's content: every file's path and sha256 (so a hard-linked or copied tree with
    the same files shares the cache, and a tree with one file changed misses it)."""
    h = hashlib.sha256()
    for rel, sha in sorted(digests.items()):
        h.update(f"{rel}\0{sha}\n".encode())
    return h.hexdigest()


def _encode(sources: list[Source]) -> list[list[object]]:
    return [[s.path, s.line, list(s.template), s.log,
             None if s.platforms is None else list(s.platforms)] for s in sources]


def _decode(raw: object) -> list[Source] | None:
    if not isinstance(raw, list):
        return None
    out: list[Source] = []
    for row in raw:
        if not (isinstance(row, list) and len(row) == 5 and isinstance(row[0], str)
                and type(row[1]) is int and isinstance(row[2], list)
                and isinstance(row[3], bool) and (row[4] is None or (
                    isinstance(row[4], list) and all(isinstance(p, str) for p in row[4])))):
            return None
        template = tuple(row[2])
        if not all(p is None or isinstance(p, str) or (type(p) is int and p == ANY)
                   for p in template):
            return None
        platforms = None if row[4] is None else tuple(row[4])
        out.append(Source(row[0], row[1], template, row[3], platforms))
    return out


def _read_cache(path: Path, key: str | None) -> tuple[dict[str, str], dict[str, list[Source]]] | None:
    """(per file digest, per file texts), or None when absent or not trustworthy; `key=None`
    accepts any tree's cache (a base to reuse unchanged files from)."""
    try:  # a cache is hostile input: no link, FIFO or device, bounded, any depth refused
        body = json.loads(read_state(path))
    except (OSError, ValueError, RecursionError):
        return None
    if not isinstance(body, dict) or body.get("schema") != CACHE_SCHEMA or (
            key is not None and body.get("key") != key):
        return None
    files, digests = body.get("files"), body.get("digests")
    if not isinstance(files, dict) or not isinstance(digests, dict) or set(files) != set(digests):
        return None
    out: dict[str, list[Source]] = {}
    for rel, raw in files.items():
        decoded = _decode(raw)
        if decoded is None or any(s.path != rel for s in decoded) or not isinstance(
                digests[rel], str):
            return None
        out[rel] = decoded
    return {str(k): str(v) for k, v in digests.items()}, out


def _reusable(folder: Path, digests: dict[str, str]) -> dict[str, list[Source]]:
    """Texts of unchanged files from the cached tree sharing the most files with this one
    (a scratch copy with a few files edited need not re-read 3,000 files)."""
    best: dict[str, list[Source]] = {}
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        found = _read_cache(path, None)
        if found is None:
            continue
        old_digests, texts = found
        same = {rel: texts[rel] for rel, sha in digests.items() if old_digests.get(rel) == sha}
        if len(same) > len(best):
            best = same
    return best


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        msg = f"{path}: cannot read: {exc.strerror}"
        raise TreeIOError(msg, hint="check the tree's permissions") from None


def _listing_key(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256(str(root.resolve()).encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ino}\n".encode())
    return h.hexdigest()


def tree_sources(root: Path, *, use_cache: bool = True) -> list[Source]:
    """Every text of the tree's .py files (cached per tree content)."""
    files = tree_files(root)
    if not files:
        msg = f"{root}: no vllm/*.py files to read markers from"
        raise TreeIOError(msg, hint="pass --tree ROOT (the folder that contains vllm/)")
    listing = _listing_key(root, files)
    if use_cache and listing in _MEMO:
        return _MEMO[listing]
    sources = _load_or_read(root, files, use_cache=use_cache)
    if use_cache:
        if len(_MEMO) >= _MEMO_MAX:
            _MEMO.pop(next(iter(_MEMO)))
        _MEMO[listing] = sources
    return sources


def _load_or_read(root: Path, files: list[Path], *, use_cache: bool) -> list[Source]:
    digests = file_digests(root, files)
    key = tree_key(digests)
    folder = cache_root() / "marker-sources"
    found = _read_cache(folder / f"{key}.json", key) if use_cache else None
    if found is not None:
        return [s for sources in found[1].values() for s in sources]
    per_file = _reusable(folder, digests) if use_cache else {}
    fresh = len(per_file) == 0
    for path in files:
        rel = path.relative_to(root).as_posix()
        if rel not in per_file:
            per_file[rel] = file_sources(rel, _read(path))
    if use_cache and fresh:  # only whole reads are stored: edited scratch copies would pile up
        with contextlib.suppress(M3PatchError, OSError):  # an unwritable cache costs time only
            write_cache_json(folder.parent, folder / f"{key}.json",
                             {"schema": CACHE_SCHEMA, "key": key, "root": str(root),
                              "digests": digests,
                              "files": {r: _encode(v) for r, v in per_file.items()}}, indent=0)
    return [s for sources in per_file.values() for s in sources]
