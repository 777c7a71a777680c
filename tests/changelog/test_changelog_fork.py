"""PR-link repository resolution in a contributor's fork clone, and one GitHub annotation per problem.

A real git repository whose remotes are a fork (`origin`) and the project (`upstream`); the shipped
pre-commit hook runs as pre-commit would run it (its `entry`, in a subprocess, from the clone).
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from changelog_repo import FILE, GitRepo, entry, make_repo

from m3patch.changelog.sources import github_repo_of, resolve_repo

PROJECT = Path(__file__).resolve().parents[2]
UPSTREAM = "acme/m3patch"
FORK = "contributor/m3patch"


@pytest.fixture
def fork(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GitRepo:
    repo = make_repo(tmp_path, monkeypatch)
    repo.git("remote", "add", "origin", f"git@github.com:{FORK}.git")
    repo.git("remote", "add", "upstream", f"https://github.com/{UPSTREAM}.git")
    return repo


def run_hook(repo: GitRepo) -> subprocess.CompletedProcess[str]:
    """The m3patch-changelog hook's entry, with `m3patch` as this interpreter's module."""
    hooks = yaml.safe_load((PROJECT / ".pre-commit-hooks.yaml").read_text())
    argv = shlex.split(next(h for h in hooks if h["id"] == "m3patch-changelog")["entry"])
    assert argv[0] == "m3patch"
    return subprocess.run([sys.executable, "-m", "m3patch", *argv[1:]], cwd=repo.root,
                          capture_output=True, text=True, check=False)


def test_hook_in_fork_clone_accepts_upstream_link(fork: GitRepo) -> None:
    fork.write(entry(desc="first", pr=f"https://github.com/{UPSTREAM}/pull/1"))
    fork.commit()
    fork.write(entry(desc="first", pr=f"https://github.com/{UPSTREAM}/pull/1") + "\n"
               + entry(desc="second", pr=f"https://github.com/{UPSTREAM}/pull/2"))
    done = run_hook(fork)
    assert done.returncode == 0, done.stderr
    assert "append: 1 new entry since HEAD" in done.stderr + done.stdout


def test_hook_in_fork_clone_rejects_fork_link(fork: GitRepo) -> None:
    fork.commit("no changelog yet")  # the hook compares with HEAD, so HEAD must exist
    fork.write(entry(pr=f"https://github.com/{FORK}/pull/2"))
    done = run_hook(fork)
    assert done.returncode == 16
    assert f"expected https://github.com/{UPSTREAM}/pull/N or XXX" in done.stderr


def test_without_upstream_remote_origin_names_the_repo(fork: GitRepo) -> None:
    # The same clone with no `upstream`: the fork is all git knows, so its links are expected.
    fork.git("remote", "remove", "upstream")
    fork.commit("no changelog yet")
    fork.write(entry(pr=f"https://github.com/{UPSTREAM}/pull/2"))
    done = run_hook(fork)
    assert done.returncode == 16
    assert f"expected https://github.com/{FORK}/pull/N or XXX" in done.stderr


def test_resolution_order(fork: GitRepo, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fork.root
    assert resolve_repo(None, root) == UPSTREAM
    monkeypatch.setenv("GITHUB_REPOSITORY", "ci/named")
    assert resolve_repo(None, root) == "ci/named"
    assert resolve_repo("flag/wins", root) == "flag/wins"
    monkeypatch.delenv("GITHUB_REPOSITORY")
    # an upstream that is not on github.com says nothing about PR links: origin is next
    fork.git("remote", "set-url", "upstream", "https://gitlab.example.invalid/acme/m3patch.git")
    assert resolve_repo(None, root) == FORK
    fork.git("remote", "remove", "origin")
    assert resolve_repo(None, root) == "m3patch/m3patch"
    assert resolve_repo(None, None) == "m3patch/m3patch"


@pytest.mark.parametrize(("url", "repo"), [
    ("https://github.com/acme/m3patch.git", "acme/m3patch"),
    ("https://github.com/acme/m3patch", "acme/m3patch"),
    ("https://github.com/acme/m3patch/", "acme/m3patch"),
    ("git@github.com:acme/m3.patch.git", "acme/m3.patch"),
    ("ssh://git@github.com/acme/m3patch.git", "acme/m3patch"),
    ("https://gitlab.com/acme/m3patch.git", None),
    ("", None),
])
def test_github_repo_of(url: str, repo: str | None) -> None:
    assert github_repo_of(url) == repo


def test_one_annotation_per_problem(fork: GitRepo) -> None:
    fork.write(entry(key="nope", pr=f"https://github.com/{FORK}/pull/2"))
    done = subprocess.run([sys.executable, "-m", "m3patch", "changelog", "check"], cwd=fork.root,
                          capture_output=True, text=True, check=False,
                          env={**os.environ, "GITHUB_ACTIONS": "true"})
    assert done.returncode == 16
    annotations = [line for line in (done.stdout + done.stderr).splitlines()
                   if line.startswith("::error")]
    assert len(annotations) == 2, annotations  # config-keys and pr-link, each once
    assert all(a.startswith(f"::error file={FILE},line=") for a in annotations)
    # the human summary is still there, on stderr
    assert "m3patch: error: perf-changelog.yaml: 2 changelog problems" in done.stderr
