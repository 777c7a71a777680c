"""Effects for the changelog check: read files from git refs or the work tree, build the Catalog.

Refs are read with `git show REF:path` / `git ls-tree`, never by checking anything out, so the
check can run in a CI checkout of the head and still read the PR's base.
"""

from __future__ import annotations

import os
import re
import subprocess
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from m3patch.changelog.refs import (
    MASTER_CONFIGS,
    PATCHES_DIR,
    RECIPES_DIR,
    Catalog,
    is_recipe_path,
)
from m3patch.errors import M3PatchError, UsageError
from m3patch.fsio import read_state
from m3patch.shipped import Kind, shipped_dir
from m3patch.yamlio import YAML_MAX_BYTES, load_yaml_text

# Used when neither --repo, $GITHUB_REPOSITORY nor a github.com `upstream` / `origin` remote
# names the repo.
DEFAULT_REPO = "m3patch/m3patch"


def git(root: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    try:
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=False)
    except FileNotFoundError:
        msg = "git is not installed; the append-only check reads refs with git"
        raise UsageError(msg, hint="install git, or run without --base/--head") from None


def git_toplevel(start: Path) -> Path | None:
    done = git(start, "rev-parse", "--show-toplevel")
    # a checkout's path is bytes to git: os.fsdecode keeps one that is no UTF-8
    return Path(os.fsdecode(done.stdout.rstrip(b"\n"))) if done.returncode == 0 else None


def verify_ref(root: Path, ref: str) -> None:
    if git(root, "rev-parse", "--verify", "--quiet", f"{ref}^{{commit}}").returncode != 0:
        msg = f"unknown git ref {ref!r} in {root}"
        raise UsageError(msg, hint=f"git fetch origin {ref}  (or pass a ref that exists)")


class TreeReader(Protocol):
    def files(self, prefix: str) -> list[str]: ...
    def read(self, relpath: str) -> bytes | None: ...


class WorkTreeReader:
    def __init__(self, root: Path) -> None:
        self.root = root

    def files(self, prefix: str) -> list[str]:
        base = self.root / prefix
        if not base.is_dir():
            return []
        return sorted(p.relative_to(self.root).as_posix() for p in base.rglob("*") if p.is_file())

    def read(self, relpath: str) -> bytes | None:
        try:  # a regular file only: a FIFO in a recipe's or master config's place would block
            return read_state(self.root / relpath, YAML_MAX_BYTES, links=True)
        except FileNotFoundError:
            return None
        except OSError as exc:
            msg = f"{self.root / relpath}: cannot read: {exc.strerror or exc}"
            raise UsageError(msg, hint=f"make {relpath} a regular file, or remove it") from None


class GitRefReader:
    def __init__(self, root: Path, ref: str) -> None:
        self.root, self.ref = root, ref

    def files(self, prefix: str) -> list[str]:
        done = git(self.root, "ls-tree", "-r", "--name-only", self.ref, "--", prefix)
        return sorted(done.stdout.decode().splitlines()) if done.returncode == 0 else []

    def read(self, relpath: str) -> bytes | None:
        done = git(self.root, "show", f"{self.ref}:{relpath}")
        return done.stdout if done.returncode == 0 else None


def build_catalog(reader: TreeReader) -> Catalog:
    recipes, entries, shipped = _recipes(reader)
    masters = {path: _top_keys(reader.read(path)) for path in MASTER_CONFIGS}
    found = {path: keys for path, keys in masters.items() if keys is not None}
    series, broken = _series(reader)
    return Catalog(recipes=recipes, series=series, series_errors=broken, config_entries=entries,
                   recipes_shipped=shipped, master_files=tuple(found),
                   master_entries=tuple(sorted({k for keys in found.values() for k in keys})))


def _shipped_or(reader: TreeReader, folder: str, kind: Kind,
                keep: Callable[[str], bool]) -> tuple[TreeReader, list[str]]:
    """A repository without the folder (an InferenceX checkout) runs what ships with m3patch
    (`m3patch bench mi300x_tp8`, `series list`): its entries name those."""
    paths = [p for p in reader.files(folder) if keep(p)]
    shipped = shipped_dir(kind) if not paths else None
    if shipped is not None:
        reader = WorkTreeReader(shipped.parent)
        paths = [p for p in reader.files(shipped.name) if keep(p)]
    return reader, paths


def _recipes(reader: TreeReader) -> tuple[tuple[str, ...], dict[str, str], bool]:
    """The recipes, of each that states one its `inferencex.config-entry`, and whether they are
    the shipped ones."""
    found, paths = _shipped_or(reader, RECIPES_DIR, "recipes", is_recipe_path)
    entries = {}
    for path in paths:
        entry = _config_entry(found.read(path))
        if entry is not None:
            entries[path] = entry
    return tuple(paths), entries, found is not reader


def _config_entry(raw: bytes | None) -> str | None:
    """Best effort: a recipe that does not parse names no entry (recipe validate says why)."""
    try:
        data = load_yaml_text((raw or b"").decode("utf-8", errors="replace"), source="recipe")
    except M3PatchError:
        return None
    section = data.get("inferencex") if isinstance(data, dict) else None
    entry = section.get("config-entry") if isinstance(section, dict) else None
    return entry if isinstance(entry, str) and entry else None


def _top_keys(raw: bytes | None) -> tuple[str, ...] | None:
    """An InferenceX master config's entries (its top-level keys); None when there is none."""
    if raw is None:
        return None
    try:
        data = load_yaml_text(raw.decode("utf-8", errors="replace"), source="master config")
    except M3PatchError:
        return ()  # present but unreadable: no key matches it, and the finding names the file
    return tuple(str(k) for k in data) if isinstance(data, dict) else ()


def _series(reader: TreeReader) -> tuple[dict[str, tuple[str, ...]], dict[str, str]]:
    series: dict[str, tuple[str, ...]] = {}
    broken: dict[str, str] = {}
    reader, paths = _shipped_or(reader, PATCHES_DIR, "patches", lambda _path: True)
    for path in paths:
        parts = path.split("/")
        if len(parts) != 3 or parts[2] != "series.yaml":
            continue
        try:
            series[parts[1]] = _patch_ids(reader.read(path) or b"", path)
        except M3PatchError as exc:
            broken[parts[1]] = exc.message
    return series, broken


def _patch_ids(raw: bytes, source: str) -> tuple[str, ...]:
    """Only the ids: the full manifest is the series loader's job (m3patch series show)."""
    data = load_yaml_text(raw.decode("utf-8", errors="replace"), source=source)
    patches = data.get("patches") if isinstance(data, dict) else None
    if not isinstance(patches, list):
        msg = "no 'patches' list"
        raise UsageError(msg)
    return tuple(str(p["id"]) for p in patches if isinstance(p, dict) and "id" in p)


def resolve_repo(option: str | None, root: Path | None) -> str:
    """OWNER/NAME for PR links: --repo, $GITHUB_REPOSITORY, `upstream`, `origin`, DEFAULT_REPO.

    `upstream` before `origin`: in a contributor's fork clone `origin` is the fork, while PRs
    (and so their links) live in the repository the fork came from.
    """
    if option:
        if not re.fullmatch(r"[\w.-]+/[\w.-]+", option):
            msg = f"--repo {option!r} is not OWNER/NAME"
            raise UsageError(msg, hint="--repo my-org/m3patch")
        return option
    env = os.environ.get("GITHUB_REPOSITORY")
    if env:
        return env
    for remote in ("upstream", "origin"):
        url = git(root, "remote", "get-url", remote).stdout if root is not None else b""
        found = github_repo_of(url.decode(errors="replace").strip())
        if found:
            return found
    return DEFAULT_REPO


def github_repo_of(url: str) -> str | None:
    """OWNER/NAME of a github.com remote URL (https, ssh or scp form); None for anything else."""
    found = re.search(r"github\.com[:/]([\w.-]+/[\w.-]+?)(?:\.git)?/?$", url)
    return found.group(1) if found else None
