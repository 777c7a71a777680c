"""Helpers for the core tests (issue 2), importable as `from core_helpers import ...`."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TEST_SERIES = REPO / "tests" / "data" / "test-series"

CliRunner = Callable[..., subprocess.CompletedProcess[str]]


def replace_file(path: Path, data: bytes) -> None:
    """Edit a tree file by hand the safe way: new inode + rename, never through a hard link."""
    tmp = path.with_name(path.name + ".hand-edit")
    tmp.write_bytes(data)
    tmp.replace(path)
