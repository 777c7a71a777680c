"""The ledger: a versioned record, inside the vLLM tree, of what m3patch last applied.

`<root>/vllm/.m3patch/ledger.json`. It is a record, not the truth: status and verify classify
files by content hash and only compare with the ledger to say when it is stale.
"""

from __future__ import annotations

import errno
import hashlib
import json
import re
import time
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath

from m3patch import __version__
from m3patch.errors import HostilePatch, TreeIOError
from m3patch.fsio import read_bytes, read_state
from m3patch.patching.diffs import check_rel_path
from m3patch.patching.states import Mode

LEDGER_SCHEMA = 1
_FILES_MARK = "\x00files\x00"
STATE_DIR = ".m3patch"
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


def digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def file_digest(path: Path) -> str | None:
    """sha256 of a file's bytes; None when it does not exist."""
    try:
        return digest(read_bytes(path))  # the tree's file: no FIFO, device or link
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"{path}: cannot read: {exc.strerror}"
        raise TreeIOError(msg, hint="check permissions on the vLLM tree") from None


def state_dir(root: Path) -> Path:
    return root / "vllm" / STATE_DIR


def ledger_path(root: Path) -> Path:
    return state_dir(root) / "ledger.json"


def journal_path(root: Path) -> Path:
    """Present only while a transaction runs, or after one was killed (writer.recover)."""
    return state_dir(root) / "journal.json"


@dataclass(frozen=True)
class LedgerFile:
    path: str
    pre: str | None
    post: str | None
    dirs: tuple[str, ...] = ()  # folders the apply created for this (new) file; revert removes them


@dataclass(frozen=True)
class Ledger:
    schema: int
    tool: str
    series: str
    mode: Mode  # strict | offset
    vllm_version: str
    vllm_commit: str | None
    version_note: str
    patches: tuple[str, ...]
    files: tuple[LedgerFile, ...]
    time: str

    def to_bytes(self) -> bytes:
        """Indented JSON with one line per file: json's indented encoder runs in pure Python
        (a tenth of a second for a release-sized ledger), the rows use its C encoder."""
        head: dict[str, object] = {f.name: getattr(self, f.name) for f in fields(self)}
        head["files"] = _FILES_MARK  # "files" sorts first: the mark's first occurrence is it
        names = [f.name for f in fields(LedgerFile)]
        rows = ",\n    ".join(json.dumps({n: getattr(f, n) for n in names}, sort_keys=True)
                               for f in self.files)
        text = json.dumps(head, indent=2, sort_keys=True)
        text = text.replace(json.dumps(_FILES_MARK), f"[\n    {rows}\n  ]" if rows else "[]", 1)
        return (text + "\n").encode()


def new_ledger(*, series: str, mode: Mode, vllm_version: str, vllm_commit: str | None,
               version_note: str, patches: tuple[str, ...],
               files: tuple[LedgerFile, ...]) -> Ledger:
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    return Ledger(LEDGER_SCHEMA, f"m3patch {__version__}", series, mode, vllm_version,
                  vllm_commit, version_note, patches, files, stamp)


def check_sha256(value: object, key: str) -> str | None:
    """A sha256 hex digest or None (no file), else ValueError: state files are untrusted."""
    if value is not None and not (isinstance(value, str) and SHA256_RE.match(value)):
        msg = f"{key!r} {value!r} is not a sha256 (64 lowercase hex digits) or null"
        raise ValueError(msg)
    return value


def dirs_above(path: str, raw: object, key: str) -> tuple[str, ...]:
    """Folders recorded for a file (made for it, removed with it) must be folders above it,
    inside vllm/ and never vllm/ itself; anything else is a ValueError."""
    if not isinstance(raw, list) or not all(isinstance(d, str) for d in raw):
        msg = f"{key!r} must be a list of folders, not {raw!r}"
        raise ValueError(msg)
    parents = {str(p) for p in PurePosixPath(path).parents} - {"vllm", "."}
    outside = [d for d in raw if d not in parents]
    if outside:
        msg = f"{key!r}: {outside[0]!r} is not a folder above {path} inside vllm/"
        raise ValueError(msg)
    return tuple(raw)


def confined(path: object, where: str) -> str:
    """A file path confined to vllm/ by the checks diffs get, as a ValueError (state files)."""
    if not isinstance(path, str):
        msg = f"path {path!r} is not a string"
        raise ValueError(msg)
    try:
        return check_rel_path(path, where)
    except HostilePatch as exc:
        raise ValueError(exc.message) from None


def _ledger_file(raw: dict[str, object], where: str) -> LedgerFile:
    path = confined(raw["path"], where)
    return LedgerFile(path, check_sha256(raw["pre"], "pre"), check_sha256(raw["post"], "post"),
                      dirs_above(path, raw.get("dirs", []), "dirs"))


def _mode(raw: object) -> Mode:
    if raw not in (Mode.STRICT, Mode.OFFSET):
        msg = f"'mode' must be 'strict' or 'offset', not {raw!r}"
        raise ValueError(msg)
    return Mode(raw)


def _no_constant(name: str) -> object:
    msg = f"{name} is not a JSON number"
    raise ValueError(msg)


def _strings(raw: object, key: str) -> str:
    if not isinstance(raw, str):
        msg = f"{key!r} {raw!r} is not a string"
        raise TypeError(msg)
    return raw


def parse_ledger(data: bytes, where: str) -> Ledger:
    try:
        raw = json.loads(data, parse_constant=_no_constant)
        if not isinstance(raw, dict):
            msg = f"a JSON {type(raw).__name__}, not an object"
            raise TypeError(msg)
        if raw["schema"] != LEDGER_SCHEMA:
            msg = f"{where}: ledger schema {raw['schema']} is not {LEDGER_SCHEMA}"
            raise TreeIOError(msg, hint="m3patch revert with the m3patch that wrote it")
        if not isinstance(raw["files"], list) or not isinstance(raw["patches"], list):
            msg = "'files' and 'patches' must be lists"
            raise TypeError(msg)
        files = tuple(_ledger_file(f, where) for f in raw["files"])
        commit = raw["vllm_commit"]
        return Ledger(raw["schema"], _strings(raw["tool"], "tool"),
                      _strings(raw["series"], "series"), _mode(raw["mode"]),
                      _strings(raw["vllm_version"], "vllm_version"),
                      None if commit is None else _strings(commit, "vllm_commit"),
                      _strings(raw["version_note"], "version_note"),
                      tuple(_strings(p, "patches") for p in raw["patches"]), files,
                      _strings(raw["time"], "time"))
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as exc:
        msg = f"{where}: corrupt ledger ({type(exc).__name__}: {exc})"
        raise TreeIOError(msg, hint="m3patch apply rewrites it from the files") from None


def read_ledger(root: Path) -> Ledger | None:
    """The ledger of the tree rooted at `root`, or None when nothing was recorded."""
    path = ledger_path(root)
    try:
        data = read_state(path)
    except FileNotFoundError:
        return None
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror
        msg = f"{path}: cannot read: {why}"
        raise TreeIOError(msg, hint="check permissions on the vLLM tree") from None
    return parse_ledger(data, str(path))
