"""Patch series: `series.yaml` (the hand-written manifest), loaded with its lock, and where the
default series for a vLLM version is found.

The manifest says what each patch is for; series_lock.py pins, writes and reads the lock.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch import schema
from m3patch.errors import UsageError
from m3patch.fsio import path_is
from m3patch.markers import MARKER_KINDS, MarkerSpec, as_kind, regex_text
from m3patch.patching.series_lock import (
    LOCK,
    SeriesLock,
    check_lock_matches,
    read_lock,
    relock_hint,
)
from m3patch.shipped import shipped_dir
from m3patch.yamlio import load_yaml_file

PLATFORMS = ("cpu", "cuda", "rocm-gfx942", "rocm-gfx950")
MANIFEST = "series.yaml"
ENV_SERIES = "M3PATCH_SERIES"
_ID_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")
_SWITCH_RE = re.compile(r"^M3PATCH_[A-Z0-9_]+$")


@dataclass(frozen=True)
class Switch:
    """An environment switch a patch reads in the server (`M3PATCH_MXFP8_MOE`): its allowed
    values as the patch compares them (stripped, lower case; unset or empty is the first)."""

    name: str
    values: tuple[str, ...]
    patch: str


@dataclass(frozen=True)
class PatchEntry:
    id: str
    file: str
    summary: str
    why: str
    upstream: tuple[str, ...]
    drop_when: str
    platforms: tuple[str, ...]  # empty = every platform
    markers: tuple[MarkerSpec, ...]
    switches: tuple[Switch, ...] = ()


@dataclass(frozen=True)
class Series:
    id: str
    directory: Path
    target_version: str
    target_commit: str | None
    patches: tuple[PatchEntry, ...]
    lock: SeriesLock | None

    def markers_for(self, platform: str) -> tuple[MarkerSpec, ...]:
        """Markers active on `platform`: a marker's own platforms, else its patch's, else all."""
        return tuple(m for p in self.patches for m in p.markers
                     if not m.platforms or platform in m.platforms)

    @property
    def switches(self) -> dict[str, Switch]:
        """Every environment switch the series' patches read, by name."""
        return {s.name: s for p in self.patches for s in p.switches}

    def patch_path(self, entry: PatchEntry) -> Path:
        return self.directory / entry.file

    def require_lock(self) -> SeriesLock:
        if self.lock is None:
            msg = f"{self.directory / LOCK}: missing; the series has no pinned hashes"
            raise UsageError(msg, hint=relock_hint(self.directory))
        return self.lock


def _ident(value: object) -> str:
    text = schema.expect_str(value)
    if not _ID_RE.match(text):
        msg = f"invalid id {text!r}: use lowercase letters, digits, '.', '_' and '-'"
        raise schema.SchemaError(msg)
    return text


def _platforms(value: object) -> tuple[str, ...]:
    items = schema.expect_list(value, non_empty=True)
    out = []
    for index, item in enumerate(items):
        with schema.at_key(index):
            out.append(schema.expect_choice(item, PLATFORMS))
    return tuple(out)


def _marker(raw: object, declared_by: str, default_platforms: tuple[str, ...]) -> MarkerSpec:
    data = schema.expect_mapping(raw)
    schema.check_keys(data, required=("id", "kind"), optional=("text", "regex", "platforms"))
    with schema.at_key("id"):
        marker_id = _ident(data["id"])
    with schema.at_key("kind"):
        kind = as_kind(schema.expect_choice(data["kind"], MARKER_KINDS))
    if ("text" in data) == ("regex" in data):
        msg = "give exactly one of 'text' or 'regex'"
        raise schema.SchemaError(msg)
    if "text" in data:
        with schema.at_key("text"):
            text = schema.expect_str(data["text"])
    else:
        with schema.at_key("regex"):
            try:
                text = regex_text(schema.expect_str(data["regex"]))
            except ValueError as exc:
                raise schema.SchemaError(str(exc)) from None
    platforms = default_platforms
    if "platforms" in data:
        with schema.at_key("platforms"):
            platforms = _platforms(data["platforms"])
    return MarkerSpec(marker_id, kind, text, declared_by, platforms=platforms)


def _switch(raw: object, patch_id: str) -> Switch:
    data = schema.expect_mapping(raw)
    schema.check_keys(data, required=("name", "values"))
    with schema.at_key("name"):
        name = schema.expect_str(data["name"])
        if not _SWITCH_RE.match(name):
            msg = f"switch name {name!r} must be M3PATCH_ and upper-case letters, digits, '_'"
            raise schema.SchemaError(msg)
    with schema.at_key("values"):
        values = schema.str_list(data["values"])
        if not values or any(v != v.strip().lower() or not v for v in values):
            msg = "give the allowed values, lower case (the default first)"
            raise schema.SchemaError(msg)
    return Switch(name, values, patch_id)


_PATCH_KEYS = ("id", "file", "summary", "why", "upstream", "drop-when")


def _patch(raw: object, directory: Path) -> PatchEntry:
    data = schema.expect_mapping(raw)
    schema.check_keys(data, required=_PATCH_KEYS, optional=("platforms", "markers", "switches"))
    values: dict[str, Any] = {}
    for key in ("summary", "why", "drop-when", "file"):
        with schema.at_key(key):
            values[key] = schema.expect_str(data[key])
    with schema.at_key("id"):
        patch_id = _ident(data["id"])
    with schema.at_key("file"):
        path = directory / values["file"]
        if "/" in values["file"] or not path.is_file():
            msg = f"patch file {values['file']!r} not found in {directory}"
            raise schema.SchemaError(msg)
        if path.is_symlink():  # is_file() follows links: one could read a diff from anywhere
            msg = f"patch file {values['file']!r} is a symlink; keep the real file in {directory}"
            raise schema.SchemaError(msg)
    with schema.at_key("upstream"):
        upstream = schema.str_list(data["upstream"])
    platforms: tuple[str, ...] = ()
    if "platforms" in data:
        with schema.at_key("platforms"):
            platforms = _platforms(data["platforms"])
    markers = []
    with schema.at_key("markers"):
        for index, item in enumerate(schema.expect_list(data.get("markers", []))):
            with schema.at_key(index):
                markers.append(_marker(item, f"patch {patch_id} in {directory / MANIFEST}",
                                       platforms))
    switches = []
    with schema.at_key("switches"):
        for index, item in enumerate(schema.expect_list(data.get("switches", []))):
            with schema.at_key(index):
                switches.append(_switch(item, patch_id))
    return PatchEntry(patch_id, values["file"], values["summary"], values["why"], upstream,
                      values["drop-when"], platforms, tuple(markers), tuple(switches))


def _check_unique(patches: list[PatchEntry]) -> None:
    ids = [p.id for p in patches]
    marker_ids = [m.id for p in patches for m in p.markers]
    switch_names = [s.name for p in patches for s in p.switches]
    for label, names in (("patch id", ids), ("marker id", marker_ids), ("switch", switch_names)):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            msg = f"{label} {dup[0]!r} appears more than once"
            raise schema.SchemaError(msg)


def parse_manifest(data: object, directory: Path) -> tuple[str, str, str | None, list[PatchEntry]]:
    top = schema.expect_mapping(data)
    schema.check_keys(top, required=("schema", "id", "target", "patches"),
                      optional=("ported-from",))
    if "ported-from" in top:  # written by `series port`: a record for readers, not used here
        with schema.at_key("ported-from"):
            schema.expect_mapping(top["ported-from"])
    with schema.at_key("schema"):
        if schema.expect_int(top["schema"]) != 1:
            msg = f"unsupported schema {top['schema']}; this m3patch reads schema 1"
            raise schema.SchemaError(msg)
    with schema.at_key("id"):
        series_id = _ident(top["id"])
    with schema.at_key("target"):
        target = schema.expect_mapping(top["target"])
        schema.check_keys(target, required=("vllm-version",), optional=("commit",))
        with schema.at_key("vllm-version"):
            version = schema.expect_str(target["vllm-version"])
        commit = None
        if target.get("commit") is not None:
            with schema.at_key("commit"):
                commit = schema.expect_str(target["commit"])
    patches = []
    with schema.at_key("patches"):
        for index, item in enumerate(schema.expect_list(top["patches"], non_empty=True)):
            with schema.at_key(index):
                patches.append(_patch(item, directory))
        _check_unique(patches)
    return series_id, version, commit, patches


def load_series(series_dir: Path, *, with_lock: bool = True) -> Series:
    """Load and validate series.yaml (and series.lock.json when present) into frozen records;
    `with_lock=False` reads the manifest only (for `series lock`, which rewrites the lock)."""
    directory = Path(series_dir)
    manifest = directory / MANIFEST
    if not path_is(manifest, "file"):
        msg = f"{manifest}: no series manifest"
        raise UsageError(msg, hint=SERIES_HINT)
    with schema.in_file(manifest):
        series_id, version, commit, patches = parse_manifest(load_yaml_file(manifest), directory)
    series = Series(series_id, directory, version, commit, tuple(patches), None)
    lock_path = directory / LOCK
    if not with_lock or not lock_path.is_file():
        return series
    lock = read_lock(lock_path)
    check_lock_matches(lock, series, lock_path)
    return Series(series_id, directory, version, commit, tuple(patches), lock)


def base_version(version: str) -> str:
    """'0.33.0' of '0.33.0+cpu', '0.33.0rc1.dev5': the release a series targets."""
    head = version.split("+", 1)[0]
    parts = []
    for part in head.split("."):
        if not part.isdigit():
            break
        parts.append(part)
    return ".".join(parts)


SERIES_HINT = ("pass --series NAME (a name `m3patch series list` prints, e.g. vllm-0.33.0) or "
               "--series DIR (a folder with series.yaml)")


def shipped_series_names() -> tuple[str, ...]:
    """Names of the series that ship with m3patch (their folder names), sorted."""
    folder = shipped_dir("patches")
    if folder is None:
        return ()
    return tuple(sorted(p.name for p in folder.iterdir() if (p / MANIFEST).is_file()))


def series_path(text: str) -> Path:
    """The series folder for a --series argument (argparse type): an existing path, a path, or a
    series name as `series list` prints it (`vllm-0.33.0`: ./patches/NAME, else the shipped
    one). An unknown bare name is a usage error naming the shipped series."""
    path = Path(text)
    if path_is(path, "any") or not text or "/" in text or text.startswith(("~", ".", "$")):
        return path
    shipped = shipped_dir("patches")
    for candidate in (Path("patches") / text, *([shipped / text] if shipped else [])):
        if path_is(candidate / MANIFEST, "file"):
            return candidate
    names = shipped_series_names()
    msg = (f"{text}: no such series folder, and no shipped series is named {text!r}."
           f"{schema.suggest(text, names)}")
    shown = ", ".join(names) if names else "none ship with this m3patch"
    raise UsageError(msg, hint=f"give a series folder, or a shipped series name ({shown})")


def find_series_dir(explicit: Path | None, vllm_version: str | None) -> Path:
    """The series to use: `explicit` (--series), then $M3PATCH_SERIES, then patches/vllm-<base>
    in the working folder, then the one shipped with m3patch (checkout first, else the wheel's)."""
    if explicit is not None:
        return Path(explicit)
    if os.environ.get(ENV_SERIES):
        return series_path(os.environ[ENV_SERIES])
    if vllm_version is None:
        msg = "no series given"
        raise UsageError(msg, hint=SERIES_HINT)
    name = f"vllm-{base_version(vllm_version)}"
    shipped = shipped_dir("patches")
    candidates = [Path("patches") / name, *([shipped / name] if shipped is not None else [])]
    for candidate in candidates:
        if (candidate / MANIFEST).is_file():
            return candidate
    looked = ", ".join(str(c / MANIFEST) for c in candidates)
    msg = f"no series for vLLM {vllm_version} (looked for patches/{name}/series.yaml: {looked})"
    names = ", ".join(shipped_series_names()) or "none"
    raise UsageError(msg, hint=f"pass --series NAME|DIR (shipped: {names}; `m3patch series list` "
                               "says which fits), or write the series for this version")
