"""Which file contents are known to compile with an interpreter: a memo keyed by content.

Whether bytes compile is a pure function of the bytes and the interpreter (its cache tag and
bytecode magic number), so `verify` compiles a given post-image once per interpreter rather than
on every run: a release-sized series has over a thousand .py files, and compiling them is most
of verify's time; a read-only command (`verify` itself) only reads the memo (patching.memo),
so the memo grows through apply and the serve/bench/ci path. Only successes are remembered (a
failure is compiled again, for its message). The tree's own interpreter, when it is not
m3patch's, has a memo of its own under the key it reports (cache tag and magic).
The memo is m3patch's own state read back as hostile input: anything but the exact shape
(schema, this interpreter's key, sha256 hex strings) is ignored as a whole and rebuilt.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from collections.abc import Iterable
from pathlib import Path

from m3patch.errors import M3PatchError, TreeIOError
from m3patch.fsio import path_is, read_json, write_cache_json
from m3patch.patching import memo
from m3patch.patching.ledger import SHA256_RE

SCHEMA = 1
LIMIT = 200_000  # entries kept; an older memo beyond it starts over


KEY_RE = re.compile(r"[a-z][a-z0-9_.-]{0,40}-[0-9a-f]{8}")  # cache tag - bytecode magic (hex)


def interpreter_key() -> str:
    return f"{sys.implementation.cache_tag}-{importlib.util.MAGIC_NUMBER.hex()}"


def memo_path(key: str | None = None) -> Path:
    """The memo of interpreter `key` (default: this one); a key that is not of KEY_RE's shape
    (another interpreter's answer is input too) is refused with ValueError."""
    # deferred: pristine: only the cache location is needed
    from m3patch.patching.pristine import cache_root

    key = interpreter_key() if key is None else key
    if not KEY_RE.fullmatch(key):
        msg = f"not an interpreter key: {key!r}"
        raise ValueError(msg)
    return cache_root() / "compiled" / f"{key}.json"


def known_good(key: str | None = None) -> set[str]:
    """The content hashes known to compile with interpreter `key` (default: this one); empty
    when the memo is absent or not valid."""
    key = interpreter_key() if key is None else key
    try:
        path = memo_path(key)
    except ValueError:
        return set()
    if not path_is(path, "file"):
        return set()
    try:
        body = read_json(path, error=TreeIOError, hint="", expect=dict)
    except M3PatchError:
        return set()
    good = body.get("ok")
    if (body.get("schema") != SCHEMA or body.get("interpreter") != key
            or not isinstance(good, list) or len(good) > LIMIT):
        return set()
    if not all(isinstance(h, str) and SHA256_RE.match(h) for h in good):
        return set()
    return set(good)


def remember(old: set[str], new: Iterable[str], key: str | None = None) -> None:
    """Add `new` to the memo of interpreter `key` (default: this one); a cache that cannot be
    written is only a slower next run."""
    fresh = set(new) - old
    if not fresh or not memo.writes_allowed():
        return
    key = interpreter_key() if key is None else key
    good = sorted(old | fresh) if len(old) + len(fresh) <= LIMIT else sorted(fresh)
    try:
        path = memo_path(key)
        write_cache_json(path.parent.parent, path,
                         {"schema": SCHEMA, "interpreter": key, "ok": good}, indent=None,
                         durable=False)
    except (M3PatchError, OSError, ValueError):
        return
