"""One tree's texts, kept between runs: parsing vLLM's ~3,200 files takes half a minute, so
the extracted sources are cached under the m3patch cache, keyed by every .py file's path, size
and mtime. A cache file is read back as hostile input: anything malformed is ignored and
rebuilt, never trusted."""

from __future__ import annotations

import contextlib
import hashlib
import json
from pathlib import Path

from m3patch.errors import M3PatchError, TreeIOError
from m3patch.fsio import write_json_atomic
from m3patch.marker_lint.sources import ANY, Source, file_sources
from m3patch.patching.pristine import cache_root

CACHE_SCHEMA = 2


def tree_files(root: Path) -> list[Path]:
    return sorted(p for p in (root / "vllm").rglob("*.py") if p.is_file() and not p.is_symlink())


def tree_key(root: Path, files: list[Path]) -> str:
    h = hashlib.sha256()
    for path in files:
        st = path.stat()
        h.update(f"{path.relative_to(root).as_posix()}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
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
                and isinstance(row[1], int) and isinstance(row[2], list)
                and isinstance(row[3], bool) and (row[4] is None or isinstance(row[4], list))):
            return None
        template = tuple(row[2])
        if not all(p is None or isinstance(p, str) or (type(p) is int and p == ANY)
                   for p in template):
            return None
        platforms = None if row[4] is None else tuple(str(p) for p in row[4])
        out.append(Source(row[0], row[1], template, row[3], platforms))
    return out


def _read_cache(path: Path, key: str) -> list[Source] | None:
    try:
        body = json.loads(path.read_bytes())
    except (OSError, ValueError):
        return None
    if not isinstance(body, dict) or body.get("schema") != CACHE_SCHEMA or body.get("key") != key:
        return None
    return _decode(body.get("sources"))


def tree_sources(root: Path, *, use_cache: bool = True) -> list[Source]:
    """Every text of the tree's .py files (cached per tree state)."""
    files = tree_files(root)
    if not files:
        msg = f"{root}: no vllm/*.py files to read markers from"
        raise TreeIOError(msg, hint="pass --tree ROOT (the folder that contains vllm/)")
    key = tree_key(root, files)
    cache = cache_root() / "marker-sources" / f"{key}.json"
    if use_cache:
        cached = _read_cache(cache, key)
        if cached is not None:
            return cached
    sources: list[Source] = []
    for path in files:
        try:
            data = path.read_bytes()
        except OSError as exc:
            msg = f"{path}: cannot read: {exc.strerror}"
            raise TreeIOError(msg, hint="check the tree's permissions") from None
        sources.extend(file_sources(path.relative_to(root).as_posix(), data))
    if use_cache:
        with contextlib.suppress(M3PatchError, OSError):  # an unwritable cache only costs time
            write_json_atomic(cache, {"schema": CACHE_SCHEMA, "key": key, "root": str(root),
                                      "sources": _encode(sources)}, indent=0)
    return sources
