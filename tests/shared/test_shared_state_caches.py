"""Caches m3patch reads back are hostile input: a FIFO, a link to /dev/zero, deep nesting or a
well-formed lie in their place costs a re-read, never a hang, a crash or a trusted wrong value;
a cache folder that is a link is never written through."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from m3patch.errors import UnsafeState
from m3patch.fsio import owned_dir, owned_dirs, read_state, safe_name
from m3patch.marker_lint import cache as marker_cache
from m3patch.tune.cache import ResultCache


def hostile_files(tmp_path: Path) -> dict[str, Path]:
    out = {}
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    out["fifo"] = fifo
    zero = tmp_path / "zero.json"
    zero.symlink_to("/dev/zero")
    out["dev-zero"] = zero
    dangling = tmp_path / "dangling.json"
    dangling.symlink_to(tmp_path / "nowhere")
    out["dangling"] = dangling
    deep = tmp_path / "deep.json"
    deep.write_text("[" * 100_000 + "]" * 100_000)
    out["deep"] = deep
    folder = tmp_path / "folder.json"
    folder.mkdir()
    out["folder"] = folder
    return out


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dangling", "deep", "folder"])
def test_the_marker_lint_cache_is_never_trusted_or_hung_on(tmp_path: Path, kind: str) -> None:
    """Before: a deep cache ended in 70, a FIFO hung forever, a link to /dev/zero MemoryError."""
    path = hostile_files(tmp_path)[kind]
    assert marker_cache._read_cache(path, None) is None


@pytest.mark.parametrize("kind", ["fifo", "dev-zero", "dangling", "deep", "folder"])
def test_read_state_refuses_what_is_not_a_plain_bounded_file(tmp_path: Path, kind: str) -> None:
    path = hostile_files(tmp_path)[kind]
    if kind == "deep":
        assert read_state(path).startswith(b"[")
        assert read_state(path, limit=1 << 20)
        with pytest.raises(OSError):
            read_state(path, limit=10)
        return
    with pytest.raises(OSError):
        read_state(path)


@pytest.mark.parametrize("line", [
    {"us": float("nan")}, {"us": -1.0}, {"us": 0}, {"us": "3"}, {"us": float("inf")},
    {"batch": True}, {"batch": 0}, {"stage": "best"}, {"shape": ["x"]}, {"error": -2.0},
])
def test_a_cached_tune_time_that_could_win_unfairly_is_dropped(tmp_path: Path,
                                                               line: dict[str, object]) -> None:
    """Before: a cached NaN or negative time was trusted and could win the pick."""
    good = {"shape": "s", "batch": 1, "config": "c", "stage": "quick", "us": 10.0, "error": None}
    path = tmp_path / "cache.jsonl"
    path.write_text(json.dumps(good) + "\n" + json.dumps({**good, "config": "bad", **line}) + "\n")
    cache = ResultCache(path)
    assert cache.get("s", 1, "c", "quick") is not None
    assert not [r for r in cache.results.values() if r.config == "bad"]


def test_a_tune_cache_in_a_fifo_or_dev_zero_starts_afresh(tmp_path: Path) -> None:
    for path in hostile_files(tmp_path).values():
        if path.is_dir():
            continue
        assert ResultCache(path).results == {}


def test_owned_dir_refuses_links_and_files_and_creates_real_folders(tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "link").symlink_to(outside)
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    (tmp_path / "file").write_text("x")
    for name in ("link", "dangling", "file"):
        with pytest.raises(UnsafeState):
            owned_dir(tmp_path / name, create=True)
    assert not (tmp_path / "nowhere").exists()
    made = owned_dirs(tmp_path, tmp_path / "a" / "b")
    assert made.is_dir() and not made.is_symlink()
    with pytest.raises(UnsafeState):
        owned_dirs(tmp_path, tmp_path / "link" / "c")
    assert list(outside.iterdir()) == []


@pytest.mark.parametrize("key", ["0/../../x/PWNED", "..", ".hidden", "a" * 300, "é", "a/b", ""])
def test_safe_name_never_makes_a_path(key: str) -> None:
    name = safe_name(key)
    assert "/" not in name and name not in ("", ".", "..") and not name.startswith(".")
    assert len(name) <= 64


def test_safe_name_keeps_a_plain_key_readable() -> None:
    assert safe_name("0.33.0") == "0.33.0"
