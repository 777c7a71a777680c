"""Fixtures shared by the bench tests."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A short base folder: pytest's own tmp_path is too deep for a socket path under it."""
    path = Path(tempfile.mkdtemp(prefix="m3t-"))
    yield path
    shutil.rmtree(path)
