"""series.lock.json: where a series is pinned (computed on a pristine tree), written and read.

`m3patch series lock` applies every patch, in order and exactly, to the pristine files in memory
and writes the target, the sha256 of each .patch and of every file's pre- and post-image, so
nobody edits a hash by hand. Apply, verify and status read the lock back as untrusted input and
check every .patch against its pin (`pinned`) before trusting a byte of it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar

from m3patch import __version__
from m3patch.errors import PatchConflict, UsageError
from m3patch.fsio import read_json, write_bytes_atomic, write_json_atomic
from m3patch.patching.diffs import PatchFile, check_rel_path, parse_patch, safe_target
from m3patch.patching.hunks import apply_file
from m3patch.patching.ledger import SHA256_RE, digest
from m3patch.patching.locate import VllmTree, check_target
from m3patch.patching.parse_cache import from_memo, parsed

LOCK = "series.lock.json"
LOCK_SCHEMA = 1
CLI_SPEC = "vllm-cli.json"  # the target vLLM's `vllm serve` options and env names (serving.cli_spec)


@dataclass(frozen=True)
class FilePin:
    path: str
    pre: str | None  # sha256 hex; None = the file does not exist before
    post: str | None  # None = the patch deletes it


@dataclass(frozen=True)
class PatchPin:
    id: str
    file: str
    sha256: str  # of the .patch bytes: an edited patch makes the lock stale
    files: tuple[FilePin, ...]


@dataclass(frozen=True)
class SpecPin:
    """The series' launch spec file and the sha256 `series lock` wrote it with."""

    file: str
    sha256: str


@dataclass(frozen=True)
class SeriesLock:
    series_id: str
    target_version: str
    target_commit: str | None
    patches: tuple[PatchPin, ...]
    cli_spec: SpecPin | None = None  # None: locked without one (`series lock --no-cli-spec`)

    def pin(self, patch_id: str) -> PatchPin:
        return next(p for p in self.patches if p.id == patch_id)


class EntryLike(Protocol):
    """What the lock needs of a series.yaml entry (patching.series.PatchEntry)."""

    @property
    def id(self) -> str: ...
    @property
    def file(self) -> str: ...


class SeriesLike(Protocol):
    """What the lock needs of a loaded series (patching.series.Series). A protocol rather than
    the class: series.py reads the lock through this module, so importing it back would make
    the two modules import each other."""

    @property
    def id(self) -> str: ...
    @property
    def directory(self) -> Path: ...
    @property
    def target_version(self) -> str: ...
    @property
    def target_commit(self) -> str | None: ...
    @property
    def patches(self) -> Sequence[EntryLike]: ...
    def require_lock(self) -> SeriesLock: ...


def relock_hint(directory: Path) -> str:
    return f"m3patch series lock --pristine --series {directory}"


# ---- read: the lock as untrusted input ---------------------------------------------------------

def _sha(value: object, where: str, *, optional: bool) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str) or not SHA256_RE.match(value):
        msg = f"{where}: {value!r} is not a sha256 (64 lowercase hex digits)"
        raise ValueError(msg)
    return value


def _file_pin(raw: Any, where: str) -> FilePin:
    path = check_rel_path(str(raw["path"]), where)
    pre = _sha(raw["pre"], f"{where} {path} pre", optional=True)
    post = _sha(raw["post"], f"{where} {path} post", optional=True)
    if pre == post:  # a pin that changes nothing would make apply skip the patch silently
        msg = f"{where} {path}: post-image hash equals the pre-image hash"
        raise ValueError(msg)
    return FilePin(path, pre, post)


def _patch_pin(raw: Any) -> PatchPin:
    where = f"patch {raw['id']!r}"
    sha = _sha(raw["sha256"], f"{where} sha256", optional=False)
    files = tuple(_file_pin(f, where) for f in raw["files"])
    return PatchPin(str(raw["id"]), str(raw["file"]), str(sha), files)


def read_lock(path: Path) -> SeriesLock:
    """Parse and validate series.lock.json: hashes well-formed, paths confined to vllm/."""
    hint = relock_hint(path.parent)
    raw = read_json(path, error=UsageError, hint=hint, expect=dict)
    if raw.get("schema") != LOCK_SCHEMA:
        msg = f"{path}: lock schema {raw.get('schema')!r} is not {LOCK_SCHEMA}"
        raise UsageError(msg, hint=hint)
    try:
        pins = tuple(_patch_pin(p) for p in raw["patches"])
        _check_chains(pins)
        target = raw["target"]
        return SeriesLock(str(raw["series"]), str(target["vllm-version"]),
                          target.get("commit"), pins, _spec_pin(raw.get("cli-spec")))
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        msg = f"{path}: unreadable lock ({type(exc).__name__}: {exc})"
        raise UsageError(msg, hint=hint) from None


def _spec_pin(raw: Any) -> SpecPin | None:
    if raw is None:
        return None
    if raw.get("file") != CLI_SPEC:  # a fixed name: the lock never points outside its folder
        msg = f"cli-spec file {raw.get('file')!r} is not {CLI_SPEC!r}"
        raise ValueError(msg)
    return SpecPin(CLI_SPEC, str(_sha(raw["sha256"], "cli-spec sha256", optional=False)))


def _check_chains(pins: Sequence[PatchPin]) -> None:
    """Each file's pins form one chain: a patch starts from the image the previous one left."""
    last: dict[str, str | None] = {}
    for pin in pins:
        for file in pin.files:
            if file.path in last and last[file.path] != file.pre:
                msg = (f"patch {pin.id!r} {file.path}: pre-image hash is not the post-image "
                       "hash of the previous patch on this file")
                raise ValueError(msg)
            last[file.path] = file.post


def check_lock_matches(lock: SeriesLock, series: SeriesLike, path: Path) -> None:
    manifest = [(p.id, p.file) for p in series.patches]
    locked = [(p.id, p.file) for p in lock.patches]
    same_target = (lock.target_version, lock.target_commit) == (
        series.target_version, series.target_commit)
    if manifest != locked or lock.series_id != series.id or not same_target:
        msg = f"{path}: stale: series.yaml changed (ids, files, order or target) since the lock"
        raise UsageError(msg, hint=relock_hint(series.directory))


# ---- pin: compute on a pristine tree, write ----------------------------------------------------

def compute_pins(patches: Sequence[tuple[str, PatchFile, str]],
                 pristine: Mapping[str, bytes | None]) -> tuple[PatchPin, ...]:
    """Apply every patch in order, exactly, to the pristine files (pure)."""
    current = dict(pristine)
    pins: list[PatchPin] = []
    for patch_id, patch, patch_sha in patches:
        files: list[FilePin] = []
        for fp in patch.files:
            before = current.get(fp.path)
            after = apply_file(fp, before, patch_id)
            current[fp.path] = after
            files.append(FilePin(fp.path, None if before is None else digest(before),
                                 None if after is None else digest(after)))
        pins.append(PatchPin(patch_id, patch.name, patch_sha, tuple(files)))
    return tuple(pins)


def _lock_body(series: SeriesLike, tree: VllmTree, pins: Sequence[PatchPin],
               spec: SpecPin | None) -> dict[str, Any]:
    return {"schema": LOCK_SCHEMA, "series": series.id, "generated-by": f"m3patch {__version__}",
            "target": {"vllm-version": series.target_version, "commit": series.target_commit},
            "pinned-from": tree.version + (f" (commit {tree.commit})" if tree.commit else ""),
            **({} if spec is None else {"cli-spec": {"file": spec.file, "sha256": spec.sha256}}),
            "patches": [{"id": p.id, "file": p.file.rsplit("/", 1)[-1], "sha256": p.sha256,
                         "files": [{"path": f.path, "pre": f.pre, "post": f.post}
                                   for f in p.files]} for p in pins]}


@dataclass(frozen=True)
class LockWritten:
    path: Path
    patches: int
    files: int


def pin_series(series: SeriesLike, tree: VllmTree) -> tuple[PatchPin, ...]:
    """The pins of `series` on the pristine `tree` (its target version); writes nothing."""
    check_target(tree, series.target_version, series.target_commit)
    patches = []
    for entry in series.patches:
        path = series.directory / entry.file
        data = path.read_bytes()
        patches.append((entry.id, parse_patch(data, str(path)), digest(data)))
    paths = sorted({fp.path for _, patch, _ in patches for fp in patch.files})
    pristine = {}
    for rel in paths:
        target = safe_target(tree.root, rel)
        pristine[rel] = target.read_bytes() if target.is_file() else None
    try:
        return compute_pins(patches, pristine)
    except PatchConflict as exc:  # `status` needs the lock this run could not write
        hint = (f"regenerate the patch against the pristine vLLM {tree.version} tree, or see "
                f"every hunk with `m3patch series port {series.directory} --tree {tree.root} "
                "--out NEW_DIR`")
        raise PatchConflict(exc.message, hint=hint) from None


def write_lock(series: SeriesLike, tree: VllmTree, pins: Sequence[PatchPin],
               cli_spec: bytes | None = None) -> LockWritten:
    """Write series.lock.json of `pins` (from `pin_series` on `tree`); with `cli_spec` (the
    launch spec generated from the same tree) write it and pin its hash."""
    spec = None
    if cli_spec is not None:
        write_bytes_atomic(series.directory / CLI_SPEC, cli_spec)
        spec = SpecPin(CLI_SPEC, digest(cli_spec))
    path = series.directory / LOCK
    write_json_atomic(path, _lock_body(series, tree, pins, spec))
    return LockWritten(path, len(pins), len({f.path for p in pins for f in p.files}))


def lock_series(series: SeriesLike, tree: VllmTree, cli_spec: bytes | None = None) -> LockWritten:
    """Pin `series` on the pristine `tree` and write series.lock.json (`pin_series`, then
    `write_lock`)."""
    return write_lock(series, tree, pin_series(series, tree), cli_spec)


# ---- use: the lock checked against the .patch bytes --------------------------------------------

@dataclass(frozen=True)
class Pinned:
    series: SeriesLike
    hashes: dict[str, tuple[str | None, ...]]  # per file: pristine, then after each patch on it
    raw: dict[str, bytes]  # per patch id: the .patch bytes, read once and checked against the lock


def pinned(series: SeriesLike) -> Pinned:
    """The lock's chain of hashes per file; refuses a patch edited since `series lock`."""
    lock = series.require_lock()
    raw = {}
    for entry in series.patches:
        path = (series.directory / entry.file)
        try:
            data = path.read_bytes()
        except OSError as exc:
            msg = f"{path}: cannot read: {exc.strerror}"
            raise UsageError(msg, hint="restore the patch file") from None
        if digest(data) != lock.pin(entry.id).sha256:
            msg = f"{path}: changed since series.lock.json was generated"
            raise UsageError(msg, hint=relock_hint(series.directory))
        raw[entry.id] = data
    hashes: dict[str, list[str | None]] = {}
    for pin in lock.patches:
        for file in pin.files:
            hashes.setdefault(file.path, [file.pre]).append(file.post)
    return Pinned(series, {p: tuple(h) for p, h in hashes.items()}, raw)


Patches = tuple[tuple[PatchFile, PatchPin], ...]
T = TypeVar("T")


def with_patches(series: SeriesLike, raw: Mapping[str, bytes],
                 run: Callable[[Patches], T]) -> T:
    """`run` on the series' parsed patches; when it ends in a PatchConflict and some hunks came
    from the parse memo, once more on a fresh parse of the pinned bytes (which rewrites those
    memo entries). A memo entry's hunks are checked for shape, not truth (that would be the
    parse it saves); a lie only shows as a result off its pin, which must not be blamed on the
    tree. A true conflict raises again from the fresh parse."""
    patches = load_patches(series, raw)
    try:
        return run(patches)
    except PatchConflict:
        if not any(from_memo(patch) for patch, _ in patches):
            raise
    return run(load_patches(series, raw, fresh=True))


def load_patches(series: SeriesLike, raw: Mapping[str, bytes] | None = None, *,
                 fresh: bool = False) -> Patches:
    """Parse every patch of the series (bytes from `pinned`, else read and checked here);
    `fresh`: from the bytes, whatever the parse memo holds (parse_cache.parsed)."""
    raw = pinned(series).raw if raw is None else raw
    lock = series.require_lock()
    out = []
    for entry in series.patches:
        pin = lock.pin(entry.id)
        data = raw[entry.id]
        if digest(data) != pin.sha256:  # the memo's key must name exactly these bytes
            msg = f"{series.directory / entry.file}: changed since series.lock.json was generated"
            raise UsageError(msg, hint=relock_hint(series.directory))
        name = str(series.directory / entry.file)
        patch = parsed(data, name, pin.sha256, fresh=fresh)
        if _shape(patch) != _pinned_shape(pin):  # a memo that lies: the bytes decide
            patch = parse_patch(data, name)
            if _shape(patch) != _pinned_shape(pin):
                msg = f"{name}: its files differ from what series.lock.json pins for {entry.id}"
                raise UsageError(msg, hint=relock_hint(series.directory))
        out.append((patch, pin))
    return tuple(out)


def _shape(patch: PatchFile) -> set[tuple[str, str]]:
    return {(f.path, f.kind) for f in patch.files}


def _pinned_shape(pin: PatchPin) -> set[tuple[str, str]]:
    """The files a lock pins for a patch, each with the kind its hashes imply."""
    return {(f.path, "add" if f.pre is None else "delete" if f.post is None else "modify")
            for f in pin.files}
