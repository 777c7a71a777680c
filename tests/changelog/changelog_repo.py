"""A real git repository in a temporary folder, for the changelog tests (not a test module)."""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
from core_helpers import isolated_git

from m3patch.main import main

REPO = "acme/m3patch"
FILE = "perf-changelog.yaml"


def entry(key: str = "cpu_tiny_moe", pr: str = "XXX", desc: str = "a change") -> str:
    return f'- config-keys:\n    - {key}\n  description:\n    - "{desc}"\n  pr-link: {pr}\n'


def link(number: int) -> str:
    return f"https://github.com/{REPO}/pull/{number}"


@dataclass
class GitRepo:
    root: Path

    def git(self, *args: str) -> str:
        done = subprocess.run(
            ["git", *args], cwd=self.root, capture_output=True, text=True, check=True
        )
        return done.stdout.strip()

    def write(self, data: str | bytes, name: str = FILE) -> None:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(data, str):
            data = data.encode()
        path.write_bytes(data)

    def commit(self, message: str = "change") -> str:
        self.git("add", "-A")
        self.git("commit", "-q", "--allow-empty", "-m", message)
        return self.git("rev-parse", "HEAD")

    def check(self, capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
        """Run `m3patch changelog check` in-process; return (exit code, stderr + stdout)."""
        code = main(["changelog", "check", "--repo", REPO, *args])
        out = capsys.readouterr()
        return code, out.err + out.out


def make_repo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> GitRepo:
    """git init with two recipes and a series; cwd moves there; CI variables cleared."""
    isolated_git(monkeypatch)
    root = tmp_path / "proj"
    root.mkdir()
    repo = GitRepo(root)
    repo.git("init", "-q", "-b", "main")
    repo.write("name: cpu_tiny_moe\n", "recipes/cpu_tiny_moe.yaml")
    repo.write("name: mi300x_tp8\n", "recipes/mi300x_tp8.yaml")
    repo.write(
        "schema: 1\nid: vllm-0.33.0\npatches:\n  - id: provenance\n    file: 0001.patch\n"
        "  - id: block-fp8-moe\n    file: 0002.patch\n",
        "patches/vllm-0.33.0/series.yaml",
    )
    monkeypatch.chdir(root)
    return repo
