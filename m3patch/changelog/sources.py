"""Effects for the changelog check: read files from git refs or the work tree, build the Catalog.

Refs are read with `git show REF:path` / `git ls-tree`, never by checking anything out, so the
check can run in a CI checkout of the head and still read the PR's base.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path
from typing import Protocol

from m3patch.changelog.refs import PATCHES_DIR, RECIPES_DIR, Catalog, is_recipe_path
from m3patch.errors import M3PatchError, UsageError
from m3patch.shipped import shipped_dir
from m3patch.yamlio import load_yaml_text

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
    return Path(done.stdout.decode().strip()) if done.returncode == 0 else None


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
        try:
            return (self.root / relpath).read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            msg = f"{self.root / relpath}: cannot read: {exc}"
            raise UsageError(msg) from None


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
    recipes = tuple(p for p in reader.files(RECIPES_DIR) if is_recipe_path(p))
    series: dict[str, tuple[str, ...]] = {}
    broken: dict[str, str] = {}
    # A repository without patches/ (an InferenceX checkout) runs the series that ship with
    # m3patch: an entry names them as `series list` prints them (vllm-0.33.0).
    paths = reader.files(PATCHES_DIR)
    shipped = shipped_dir("patches") if not paths else None
    if shipped is not None:
        reader = WorkTreeReader(shipped.parent)
        paths = reader.files(shipped.name)
    for path in paths:
        parts = path.split("/")
        if len(parts) != 3 or parts[2] != "series.yaml":
            continue
        try:
            series[parts[1]] = _patch_ids(reader.read(path) or b"", path)
        except M3PatchError as exc:
            broken[parts[1]] = exc.message
    return Catalog(recipes=recipes, series=series, series_errors=broken)


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
