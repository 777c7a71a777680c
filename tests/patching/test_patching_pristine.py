"""The cached pristine tree is checked against its wheel's RECORD before it is used: an edited
cache is rebuilt from the cached wheel (or not used), never trusted. Each test builds its own
M3PATCH_CACHE under tmp_path from hard links (the cached wheel, a copy of the tree whose edited
files are new inodes), so the real cache is never written through."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
from pathlib import Path

import pytest
from core_helpers import REPO, CliRunner, replace_file

from m3patch.patching.pristine import (
    cache_root,
    cached_file,
    cached_tree,
    check_cached_tree,
    copy_tree,
    pristine_tree,
    verify_against_record,
)

ORACLE = "vllm/model_executor/layers/fused_moe/oracle/mxfp8.py"
RECORD = "vllm-0.33.0.dist-info/RECORD"
LOG_LINE = b"Using '%s' MxFp8 MoE backend"
TAMPERED = b"Usin '%s' MxFp8 MoE backend"


def link_all(src: Path, dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    for path in src.iterdir():
        if path.is_file():
            os.link(path, dest / path.name)


@pytest.fixture
def own_cache(pristine_033: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """M3PATCH_CACHE under tmp_path: the 0.33.0 tree (hard links), its wheel and the marker
    texts cache (hard links: read only, and every write is a rename)."""
    cache = tmp_path / "cache"
    copy_tree(pristine_033, cache / "tree-vllm-0.33.0")
    real = pristine_033.parent
    (cache / "wheels").mkdir()
    for wheel in (real / "wheels").glob("vllm-0.33.0-*.whl"):
        os.link(wheel, cache / "wheels" / wheel.name)
    if (real / "marker-sources").is_dir():
        link_all(real / "marker-sources", cache / "marker-sources")
    monkeypatch.setenv("M3PATCH_CACHE", str(cache))
    return cache


def tamper(tree: Path, rel: str = ORACLE) -> None:
    path = tree / rel
    replace_file(path, path.read_bytes().replace(LOG_LINE, TAMPERED))  # a new inode


def test_an_edited_cached_tree_is_rebuilt_from_its_wheel(own_cache: Path) -> None:
    """Before: the tree was trusted as long as its done mark was there."""
    tree = own_cache / "tree-vllm-0.33.0"
    tamper(tree)
    assert cached_file("0.33.0", ORACLE) is None  # never taken for the pristine file
    assert pristine_tree("0.33.0") == tree
    assert LOG_LINE in (tree / ORACLE).read_bytes()
    assert verify_against_record(tree) == [] and check_cached_tree(tree) == []
    assert cached_file("0.33.0", ORACLE) == (tree / ORACLE).read_bytes()


def _record_agrees(tree: Path) -> None:
    """The tampered file's RECORD row made to agree with it (size too)."""
    data = (tree / ORACLE).read_bytes()
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    record = (tree / RECORD).read_text()
    old = next(line for line in record.splitlines() if line.startswith(ORACLE + ","))
    replace_file(tree / RECORD, record.replace(old, f"{ORACLE},{digest},{len(data)}").encode())


@pytest.mark.parametrize("how", ["added file", "record edited too", "link", "done mark lies",
                                 "huge file", "record field too large", "record a fifo",
                                 "record a link"])
def test_every_kind_of_edit_is_found(own_cache: Path, tmp_path: Path, how: str) -> None:
    """Later cases (a second hostile review): a done mark naming another wheel made the check
    fall back to the tree's own RECORD (edited to agree: trusted, and pinned into a lock); a
    planted 8 GB file was read whole (MemoryError: 70); a RECORD field over csv's limit was 70."""
    tree = own_cache / "tree-vllm-0.33.0"
    assert check_cached_tree(tree) == []
    if how == "added file":
        (tree / "vllm" / "extra_printer.py").write_text("print('Using EMULATION')\n")
    elif how == "record edited too":  # RECORD made to agree: the cached wheel's RECORD does not
        tamper(tree)
        _record_agrees(tree)
    elif how == "done mark lies":  # and it names a wheel that is not there
        tamper(tree)
        _record_agrees(tree)
        replace_file(tree / ".m3patch-pristine-ok", b"bogus.whl\n")
    elif how == "huge file":  # sparse: the check must look at its size, never read it
        target = tree / "vllm" / "envs.py"
        target.unlink()
        with target.open("wb") as fh:
            fh.truncate(8 << 30)
    elif how == "record a fifo":  # Before: opened and read: the check waited for a writer
        (tree / RECORD).unlink()  # forever (`series lock --pristine` hung until killed)
        os.mkfifo(tree / RECORD)
    elif how == "record a link":  # to the wheel's own RECORD bytes, elsewhere: still refused
        outside = tmp_path / "RECORD"
        outside.write_bytes((tree / RECORD).read_bytes())
        (tree / RECORD).unlink()
        (tree / RECORD).symlink_to(outside)
    elif how == "record field too large":
        record = (tree / RECORD).read_bytes()
        replace_file(tree / RECORD, record + b"vllm/x.py,sha256=" + b"a" * 200_000 + b",1\n")
    else:  # the same bytes, through a link to a file outside the cache
        target = tree / "vllm" / "envs.py"
        outside = tmp_path / "envs.py"
        outside.write_bytes(target.read_bytes())
        target.unlink()
        target.symlink_to(outside)
    assert check_cached_tree(tree) != []


def test_an_edit_in_place_that_keeps_the_mtime_is_still_seen(own_cache: Path) -> None:
    """The warm path's stamp holds ctime too: restoring the mtime does not hide an edit."""
    tree = own_cache / "tree-vllm-0.33.0"
    path = tree / ORACLE
    replace_file(path, path.read_bytes())  # its own inode: the edit below stays in this cache
    assert check_cached_tree(tree) == []  # stamped
    assert check_cached_tree(tree) == []  # from the stamp
    before = path.stat()
    with path.open("r+b") as fh:
        data = fh.read()
        fh.seek(0)
        fh.write(data.replace(LOG_LINE, LOG_LINE.replace(b"Using", b"Usinn")))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert check_cached_tree(tree) == [ORACLE]


def test_an_edited_tree_without_its_wheel_is_not_used(own_cache: Path) -> None:
    shutil.rmtree(own_cache / "wheels")
    tamper(own_cache / "tree-vllm-0.33.0")
    assert cached_tree("0.33.0") is None
    assert cache_root() == own_cache.resolve()


def test_markers_lint_and_series_lock_on_an_edited_cache(own_cache: Path, tmp_path: Path,
                                                         m3patch_cli: CliRunner) -> None:
    """Before: `markers lint` exited 23 blaming the shipped marker, and `series lock --pristine`
    wrote the edited file's hashes into the lock, then exited 23."""
    tamper(own_cache / "tree-vllm-0.33.0")
    env = {"M3PATCH_CACHE": str(own_cache)}
    proc = m3patch_cli("markers", "lint", "--series", "vllm-0.33.0", env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "is not its wheel's" in proc.stderr and ORACLE in proc.stderr
    tamper(own_cache / "tree-vllm-0.33.0")
    series = Path(shutil.copytree(REPO / "patches" / "vllm-0.33.0", tmp_path / "s2"))
    proc = m3patch_cli("series", "lock", "--series", str(series), "--pristine", env=env,
                       timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert (series / "series.lock.json").read_bytes() == (
        REPO / "patches" / "vllm-0.33.0" / "series.lock.json").read_bytes()
