"""Helpers for the core tests, importable as `from core_helpers import ...`."""

from __future__ import annotations

import contextlib
import difflib
import io
import os
import stat
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
TEST_SERIES = REPO / "tests" / "data" / "test-series"

CliRunner = Callable[..., subprocess.CompletedProcess[str]]


def recipe_variant(tmp_path: Path, python: str, vllm_args: dict[str, object] | None = None,
                   env: dict[str, str] | None = None, base: Path | None = None,
                   extra: dict[str, object] | None = None) -> Path:
    """A shipped recipe (default: the CPU one) with edits: its series made absolute, `python`
    as its interpreter, a local model folder (nothing is fetched or checked); tmp_path/recipe.yaml."""
    import yaml

    base = base or REPO / "recipes" / "cpu_tiny_moe.yaml"
    data = yaml.safe_load(base.read_text())
    series = data["series"]  # a shipped series' name, or a folder relative to the recipe
    data["series"] = str(REPO / "patches" / series if "/" not in series
                         else (base.parent / series).resolve())
    data["target"]["python"] = python
    data["model"]["source"] = str(tmp_path)
    data["vllm-args"].update(vllm_args or {})
    data.setdefault("env", {}).update(env or {})
    data.update(extra or {})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def server_leftover(path: Path) -> bool:
    """What a stopped vLLM server leaves in its temporary folder, and m3patch leaves with it:
    its IPC sockets, torch.distributed's store file, Torch Inductor's cache (docs/reliability.md
    says why). Anything else there after a run was left by m3patch or its load client."""
    return stat.S_ISSOCK(path.lstat().st_mode) or path.name.startswith(
        ("vllm_dist_", "torchinductor_"))


def replace_file(path: Path, data: bytes) -> None:
    """Edit a tree file by hand the safe way: new inode + rename, never through a hard link."""
    tmp = path.with_name(path.name + ".hand-edit")
    tmp.write_bytes(data)
    tmp.replace(path)


def new_file_diff(rel: str, lines: list[str], mode: str = "100644") -> str:
    """A git diff that adds `rel` with `lines` and git's `new file mode`."""
    body = "".join(f"+{line}\n" for line in lines)
    return (f"diff --git a/{rel} b/{rel}\nnew file mode {mode}\nindex 0000000..1111111\n"
            f"--- /dev/null\n+++ b/{rel}\n@@ -0,0 +1,{len(lines)} @@\n{body}")


def append_diff(root: Path, rel: str, line: str) -> str:
    """A git diff appending one line to the real file `rel` (exact, made with difflib)."""
    old = (root / rel).read_text().splitlines(keepends=True)
    new = [*old, f"{line}\n"]
    diff = difflib.unified_diff(old, new, f"a/{rel}", f"b/{rel}")
    return f"diff --git a/{rel} b/{rel}\n" + "".join(diff)


def make_series(directory: Path, pristine_root: Path | None, patches: list[str]) -> Path:
    """A locked series (ids p1, p2, ...) of these diffs, pinned against `pristine_root`;
    with `pristine_root` None, not locked (a test that locks it itself)."""
    from m3patch.main import main

    directory.mkdir(parents=True)
    entries = []
    for index, text in enumerate(patches, start=1):
        (directory / f"{index:04d}-p{index}.patch").write_text(text)
        entries.append(f"  - {{id: p{index}, file: {index:04d}-p{index}.patch, summary: s, "
                       "why: w, upstream: [], drop-when: never}\n")
    (directory / "series.yaml").write_text(
        "schema: 1\nid: made\ntarget: {vllm-version: '0.33.0'}\npatches:\n" + "".join(entries))
    if pristine_root is None:
        return directory
    with contextlib.redirect_stdout(io.StringIO()):
        code = main(["series", "lock", "--series", str(directory), "--tree", str(pristine_root)])
    assert code == 0, f"series lock failed with {code}"
    return directory


def delete_diff(root: Path, rel: str) -> str:
    """A git diff that deletes the real file `rel` (git's `deleted file mode`)."""
    lines = (root / rel).read_text().splitlines(keepends=True)
    body = "".join(f"-{line}" for line in lines)
    return (f"diff --git a/{rel} b/{rel}\ndeleted file mode 100644\nindex 1111111..0000000\n"
            f"--- a/{rel}\n+++ /dev/null\n@@ -1,{len(lines)} +0,0 @@\n{body}")


def tree_listing(root: Path) -> set[str]:
    """Every file and folder under root/vllm, m3patch's own state folder left out."""
    return {str(p.relative_to(root)) for p in (root / "vllm").rglob("*")
            if ".m3patch" not in p.parts}


def gate_recorded_run(run: Path, recipe: Path, *, eval_passed: bool | None = None) -> None:
    """Make a copied recorded run folder read as measured on a server m3patch verified and gated,
    launched from exactly `recipe` (what `ci --resume` keeps); with `eval_passed`, also record
    an eval/eval.json of that verdict from the same server."""
    import hashlib
    import json

    provenance = {"verified": True, "server": "m3patch serve",
                  "recipe_sha256": hashlib.sha256(recipe.read_bytes()).hexdigest()}
    for cell in (run / "cells").glob("*.json"):
        data = json.loads(cell.read_text())
        data["m3patch"]["provenance"].update(provenance)
        cell.write_text(json.dumps(data))
    if eval_passed is not None:
        (run / "eval").mkdir(exist_ok=True)
        (run / "eval" / "eval.json").write_text(json.dumps(
            {"schema": 1, "passed": eval_passed, "provenance": provenance, "tasks": []}))


def _sh(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, check=False)


@contextlib.contextmanager
def mounted(*mount_args: str, target: Path) -> Iterator[Path]:
    """`mount ARGS target` for the block (a bind mount, a small tmpfs); skips, saying why, where
    the sandbox forbids mounting."""
    import pytest

    target.mkdir(parents=True, exist_ok=True)
    done = _sh("mount", *mount_args, str(target))
    if done.returncode != 0:
        pytest.skip(f"mount not allowed here ({done.stderr.strip()}); fault not shown")
    try:
        yield target
    finally:
        _sh("umount", "-l", str(target))


@contextlib.contextmanager
def read_only_view(folder: Path, target: Path) -> Iterator[Path]:
    """`folder` seen through a read-only bind mount at `target`."""
    with mounted("--bind", str(folder), target=target) as view:
        assert _sh("mount", "-o", "remount,ro,bind", str(view)).returncode == 0
        yield view


def fill(directory: Path, leave_bytes: int) -> Path:
    """Fill the filesystem of `directory` until about `leave_bytes` remain (a real ENOSPC)."""
    filler = directory / "filler.bin"
    free = os.statvfs(directory).f_bavail * os.statvfs(directory).f_frsize
    filler.write_bytes(b"\0" * max(0, free - leave_bytes))
    return filler


def revert_before_first_verify(monkeypatch: Any) -> list[int]:
    """Make the race certain: the first `verify_tree` that serve / bench / ci's apply-verify
    calls runs a real revert of the tree first (as a revert landing between the lock-free
    apply and its verify). Returns the list that counts verify calls."""
    from m3patch.patching import api

    real_verify = api.verify_tree
    calls: list[int] = []

    def revert_first(tree: Any, series: Any, **kwargs: Any) -> Any:
        if not calls:
            api.revert_series(tree, series)
        calls.append(1)
        return real_verify(tree, series, **kwargs)

    monkeypatch.setattr(api, "verify_tree", revert_first)
    return calls


def isolated_git(monkeypatch: pytest.MonkeyPatch) -> None:
    """git as a fresh CI machine runs it: no user or system config, a fixed identity, and no
    GitHub Actions variables (the changelog check reads them)."""
    for var in ("GITHUB_ACTIONS", "GITHUB_REPOSITORY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", "/dev/null")
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    for who in ("AUTHOR", "COMMITTER"):
        monkeypatch.setenv(f"GIT_{who}_NAME", "t")
        monkeypatch.setenv(f"GIT_{who}_EMAIL", "t@example.invalid")
