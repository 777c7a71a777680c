"""The one way m3patch writes and reads back its own files.

Every file m3patch writes (ledger, journal, lock, results, summaries, tables) is written as a new
inode beside the target and renamed over it, so a reader never sees half a file and a crash leaves
the old one. Every JSON file m3patch reads back is treated as hostile input: `read_json` turns
"missing", "unreadable", "not UTF-8", "not JSON" and "wrong top-level type" into one typed error
that names the file, so no caller ends in a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import hashlib
import json
import os
import re
import select
import stat
import struct
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from m3patch.errors import M3PatchError, OutputFailed, TreeIOError, UnsafeState

DEFAULT_MODE = 0o644
TEMP_MARK = ".tmp"  # temp names: .<name>.tmp<pid>; writer.recover sweeps a killed run's leftovers


def _owners() -> set[int]:
    """Who may own a folder m3patch writes through: this user, and root (a container's trees
    and system caches), never a third user who could swap its entries for links."""
    return {os.geteuid(), 0, *_unmapped()}


@functools.cache
def _unmapped() -> tuple[int, ...]:
    """In a user namespace that does not map root (a rootless container, `unshare -U`), root's
    files (/, /tmp, /usr) show as the overflow uid, which no one inside can act as."""
    try:
        uid_map = Path("/proc/self/uid_map").read_text(encoding="ascii").split()
        if uid_map[:3] == ["0", "0", "4294967295"]:
            return ()
        return (int(Path("/proc/sys/kernel/overflowuid").read_text(encoding="ascii")),)
    except (OSError, ValueError, UnicodeDecodeError):
        return ()


def owned_dir(path: Path, *, create: bool = False, error: type[M3PatchError] = UnsafeState) -> Path:
    """`path` as a real folder that this user (or root) owns, checked before anything is written
    through it: a symlink (dangling or not), a FIFO, a file or another user's folder is `error`.
    With `create`, a missing folder is made (its parent must exist); `path` is returned."""
    hint = f"move {path} aside (m3patch never writes through a link or another user's folder)"
    try:
        info = path.lstat()
    except FileNotFoundError:
        if not create:
            msg = f"{path}: missing"
            raise error(msg, hint=hint) from None
        try:
            path.mkdir(mode=0o755)
        except FileExistsError:
            pass  # another run made it between the two calls: checked below
        except OSError as exc:
            msg = f"{path}: cannot create the folder: {exc.strerror or exc}"
            raise TreeIOError(msg, hint=f"check that {path.parent} is writable") from None
        info = path.lstat()
    except OSError as exc:
        msg = f"{path}: cannot inspect: {exc.strerror or exc}"
        raise error(msg, hint=hint) from None
    problem = None
    if stat.S_ISLNK(info.st_mode):
        problem = f"a symlink (-> {path.readlink()}), not a folder"
    elif not stat.S_ISDIR(info.st_mode):
        problem = "not a folder"
    elif info.st_uid not in _owners():
        problem = f"owned by uid {info.st_uid}, not by this user ({os.geteuid()}) or root"
    if problem is not None:
        msg = f"{path}: {problem}"
        raise error(msg, hint=hint)
    return path


def trusted_dir(path: Path, *, create: bool = False,
                error: type[M3PatchError] = UnsafeState) -> Path:
    """The real folder a user-named folder (m3patch's cache root, a `--cache` file's folder)
    leads to, checked all the way from `/` so that nothing below it can be redirected after the
    check: every link on the way is this user's (or root's; a cache moved to another disk with a
    link is followed), and every folder on the way is this user's or root's and cannot be
    renamed into by a third user (not writable by others unless sticky, as /tmp; not by a group
    this user is not in, nor by another user or group an ACL names). The last folder is made when
    missing with `create` (each missing folder a real one this user owns). Anything else is
    `error`, naming the part of the way at fault."""
    real, missing = resolve_way(path, error=error)
    if missing:
        if not create or ".." in missing:
            msg = f"{path}: {real.joinpath(*missing)} is missing"
            raise error(msg, hint=f"create {path} as a folder of your own")
        return owned_dirs(real, real.joinpath(*missing), error=error)
    return owned_dir(real, error=error)


def resolve_way(path: Path, *, error: type[M3PatchError] = UnsafeState) -> tuple[Path, list[str]]:
    """`path` resolved link by link from `/` under `trusted_dir`'s checks: the real folder the
    existing part leads to, and the names below it that do not exist yet. Raises `error` only."""
    try:
        start = path if path.is_absolute() else Path.cwd() / path  # '..' left to the walk
    except OSError as exc:  # a relative path from a working folder that was removed
        msg = f"{path}: cannot tell where it is ({exc.strerror or exc})"
        raise error(msg, hint=f"give {path} as an absolute path") from None
    pending = list(start.parts[1:])
    named = len(pending)  # how many of `pending`, at its end, are the path's own names
    real, hops, link = Path("/"), 0, None
    _check_way(real, real.lstat(), path, error)  # / itself is always there
    while pending:
        from_link = len(pending) > named
        named -= not from_link
        name = pending.pop(0)
        if name == "..":
            real = real.parent
            continue
        here = real / name
        info = _inspect(here, path, error)
        if info is None:
            if from_link:
                _dangling(path, link, real / name, error)
            return real, [name, *pending]
        if stat.S_ISLNK(info.st_mode):
            hops += 1
            _check_link(here, info, hops, path, error)
            target = _inspect_link(here, path, error)
            real, link = (Path("/") if target.is_absolute() else real), here
            pending[:0] = target.parts[1:] if target.is_absolute() else target.parts
            continue
        _check_way(here, info, path, error)
        real = here
    return real, []


def _dangling(path: Path, link: Path | None, missing: Path, error: type[M3PatchError]) -> None:
    """A link on the way leads where nothing is: the folders there are not the path's own, and
    m3patch makes none outside what the user named (a stale link to another disk, `/nonexistent`)."""
    msg = f"{path}: the link {link} leads to {missing}, which does not exist"
    raise error(msg, hint=f"create {missing} yourself, or remove the link {link}")


def _inspect(here: Path, path: Path, error: type[M3PatchError]) -> os.stat_result | None:
    """`lstat` of one step of the way; None when it does not exist."""
    try:
        return here.lstat()
    except FileNotFoundError:
        return None
    except OSError as exc:
        msg = f"{path}: cannot inspect {here}: {exc.strerror or exc}"
        raise error(msg, hint=f"check the folders on the way to {path}") from None


def _inspect_link(here: Path, path: Path, error: type[M3PatchError]) -> Path:
    try:
        return here.readlink()
    except OSError as exc:
        msg = f"{path}: cannot read the link {here}: {exc.strerror or exc}"
        raise error(msg, hint=f"check the folders on the way to {path}") from None


def _check_link(here: Path, info: os.stat_result, hops: int, path: Path,
                error: type[M3PatchError]) -> None:
    if info.st_uid not in _owners():
        msg = (f"{path}: the link {here} on the way is owned by uid {info.st_uid}, not by this "
               f"user ({os.geteuid()}) or root")
        raise error(msg, hint=f"point {path} at a folder of your own, not through another "
                              "user's link")
    if hops > 40:
        msg = f"{path}: more than 40 links on the way (a loop at {here}?)"
        raise error(msg, hint=f"point {path} at a real folder")


def _check_way(here: Path, info: os.stat_result, path: Path, error: type[M3PatchError]) -> None:
    """A folder on the way to a trusted folder: a real folder no third user can rename into."""
    hint = (f"point {path} (M3PATCH_CACHE for m3patch's cache) at a folder of your own, e.g. "
            "below your home")
    if not stat.S_ISDIR(info.st_mode):
        msg = f"{path}: {here} on the way is not a folder"
        raise error(msg, hint=hint)
    problem = None
    sticky = bool(info.st_mode & stat.S_ISVTX)
    if info.st_uid not in _owners():
        problem = f"is owned by uid {info.st_uid}, not by this user ({os.geteuid()}) or root"
    elif info.st_mode & stat.S_IWOTH and not sticky:
        problem = "is writable by every user (and not sticky)"
    elif info.st_mode & stat.S_IWGRP and not sticky:
        problem = _group_writers(here, info)
    if problem is not None:
        msg = (f"{path}: the folder {here} on the way {problem}, so another user could swap "
               "what lies below it")
        raise error(msg, hint=hint)


_ACL_USER, _ACL_GROUP, _ACL_WRITE = 0x02, 0x08, 0x02


def _group_writers(here: Path, info: os.stat_result) -> str | None:
    """Why a group-writable folder lets a third user in, or None: the owning group is one this
    user is in, and no ACL entry gives write to another user or group (an ACL's mask shows as
    the group bits, so only a folder with them set can carry one)."""
    groups = {os.getegid(), *os.getgroups()}
    if info.st_gid not in groups:
        return f"is writable by group {info.st_gid}, which this user is not in"
    try:
        acl = os.getxattr(here, "system.posix_acl_access", follow_symlinks=False)
    except OSError:  # no ACL, or a file system without them
        return None
    entries = acl[4:4 + (len(acl) - 4) // 8 * 8]  # after the version word: (tag, perm, id)
    for tag, perm, who in struct.iter_unpack("<HHI", entries):
        if not perm & _ACL_WRITE:
            continue
        if tag == _ACL_USER and who not in _owners():
            return f"gives write to uid {who} by an ACL"
        if tag == _ACL_GROUP and who not in groups:
            return f"gives write to group {who} by an ACL"
    return None


def owned_dirs(base: Path, path: Path, *, error: type[M3PatchError] = UnsafeState) -> Path:
    """`owned_dir` on every folder from `base` (which must already be safe) down to `path`,
    creating the missing ones: the whole way below `base` is real folders, never a link."""
    rel = path.relative_to(base)
    current = base
    for part in rel.parts:
        current = owned_dir(current / part, create=True, error=error)
    return path


def path_is(path: Path, kind: str) -> bool:
    """`is_dir()` (kind "dir"), `is_file()` ("file") or `exists()` ("any") where a path the file
    system refuses to look up (a name longer than NAME_MAX, from the command line, a recipe or a
    manifest) is simply not there, so the caller names what it cannot find instead of ending in
    an internal error."""
    try:
        if kind == "any":
            return path.exists()
        return path.is_dir() if kind == "dir" else path.is_file()
    except OSError:
        return False


_SAFE_NAME = re.compile(r"[A-Za-z0-9._+-]{1,64}")


def safe_name(key: str) -> str:
    """A cache key as one file name: kept when it is short plain text (letters, digits, . _ + -,
    not starting with a dot), else a sha256 prefix of the key; never a path of its own."""
    if _SAFE_NAME.fullmatch(key) and not key.startswith("."):
        return key
    return "k-" + hashlib.sha256(key.encode("utf-8", "surrogateescape")).hexdigest()[:32]


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _syncfs(directory: Path) -> bool:
    """syncfs(2) of the file system holding `directory`: True once its writes are on disk,
    False where the call does not exist (not Linux); a failing call raises OSError."""
    if not sys.platform.startswith("linux"):
        return False
    # deferred: ctypes: loaded only by a transaction that writes many files
    import ctypes

    try:
        syncfs = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return False
    fd = os.open(directory, os.O_RDONLY)
    try:
        if syncfs(fd) != 0:
            errno = ctypes.get_errno()
            raise OSError(errno, os.strerror(errno), str(directory))
    finally:
        os.close(fd)
    return True


def make_durable(files: Iterable[Path], folders: Iterable[Path]) -> None:
    """Every write so far to `files` and to the entries of `folders` (the files' folders among
    them) is on disk when this returns: one syncfs(2) per file system they are on, so a
    transaction of a thousand files costs one flush, not a thousand; where there is no syncfs,
    fsync of each file, then of each folder once."""
    folders = list(dict.fromkeys(folders))
    devices = {folder.stat().st_dev: folder for folder in folders}
    if devices and all(_syncfs(folder) for folder in devices.values()):
        return
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    for folder in folders:
        fsync_dir(folder)


def write_new(path: Path | str, data: bytes, mode: int = DEFAULT_MODE, *, sync: bool = True,
              owner: tuple[int, int] | None = None) -> None:
    """Create `path` as a new inode (never through an existing link) with exactly `mode` (the
    umask set aside) and, where given, this (uid, gid) owner; fsynced unless `sync` is False
    (the caller then makes it durable with `make_durable`). Raises OSError."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL
    try:
        fd = os.open(path, flags, mode)
    except FileExistsError:  # a leftover name: removed, never written through
        Path(path).unlink()
        fd = os.open(path, flags, mode)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        made = os.fstat(fd)
        if owner is not None and (made.st_uid, made.st_gid) != owner:
            os.fchown(fd, *owner)
            os.fchmod(fd, mode)  # again after chown, which may clear set-id bits
        elif stat.S_IMODE(made.st_mode) != mode:
            os.fchmod(fd, mode)
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def temp_path(path: Path) -> Path:
    return path.with_name(f".{path.name}{TEMP_MARK}{os.getpid()}")


def replace_atomic(path: Path, data: bytes, mode: int = DEFAULT_MODE, *,
                   durable: bool = True) -> None:
    """New file + rename + folder fsync; raises OSError and leaves no temp file behind.
    `durable=False` (a cache: a lost or torn entry is only recomputed, as every reader
    validates it) skips both fsyncs; a reader still never sees half a file."""
    tmp = temp_path(path)
    try:
        write_new(tmp, data, mode, sync=durable)
        tmp.replace(path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        fsync_dir(path.parent)


def write_bytes_atomic(path: Path, data: bytes, *, error: type[M3PatchError] = TreeIOError,
                       durable: bool = True) -> None:
    """`replace_atomic`, creating the folder; an OSError becomes one `error` naming the path."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomic(path, data, durable=durable)
    except OSError as exc:
        msg = f"cannot write {path}: {exc.strerror or exc}"
        raise error(msg, hint=f"check that {path.parent} is writable and has free space") from None


def json_bytes(data: object, *, indent: int | None = 2, sort_keys: bool = False) -> bytes:
    """Strict JSON (NaN/Infinity refused) with a trailing newline; `indent=None`: one line,
    by json's C encoder (any indent runs the pure-Python one, ten times slower on a big memo)."""
    text = json.dumps(data, indent=indent, sort_keys=sort_keys, allow_nan=False)
    return (text + "\n").encode("utf-8")


def write_json_atomic(path: Path, data: object, *, indent: int | None = 2,
                      sort_keys: bool = False, error: type[M3PatchError] = TreeIOError,
                      durable: bool = True) -> None:
    write_bytes_atomic(path, json_bytes(data, indent=indent, sort_keys=sort_keys), error=error,
                       durable=durable)


def write_output(path: Path, data: bytes, *, flag: str) -> None:
    """A file the user named for a command's report or output (`flag`: `--json-file`, `--out`,
    ...): one failure for every command, OutputFailed (27) naming the file, since what the
    command did stands and only its report was lost (never a results, tree or changelog code)."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        replace_atomic(path, data)
    except OSError as exc:
        msg = f"cannot write {path}, the file {flag} names: {exc.strerror or exc}"
        raise OutputFailed(msg, hint=f"make {path.parent} writable (or free space there), or "
                                     f"give {flag} a file in a folder that is") from None


def write_output_json(path: Path, data: object, *, flag: str, sort_keys: bool = False) -> None:
    """`write_output` of `data` as JSON."""
    write_output(path, json_bytes(data, sort_keys=sort_keys), flag=flag)


def write_cache_json(root: Path, path: Path, data: object, *, indent: int | None = 2,
                     durable: bool = True) -> None:
    """`write_cache_bytes` of `data` as JSON."""
    write_cache_bytes(root, path, json_bytes(data, indent=indent), durable=durable)


def write_cache_bytes(root: Path, path: Path, data: bytes, *, durable: bool = True) -> None:
    """A cache entry at `path` below m3patch's cache `root`: the root is `trusted_dir` (made
    when missing; the user's own link followed, nothing another user controls on the way), every
    folder below it down to the entry's a real folder this user owns, never a link a planted
    cache folder would carry the write through; then `write_bytes_atomic`. Raises UnsafeState
    or TreeIOError: a cache that cannot be written only costs the next run time."""
    base = trusted_dir(root, create=True)
    target = base / path.relative_to(root)
    owned_dirs(base, target.parent)
    write_bytes_atomic(target, data, durable=durable)


def _reject_constant(name: str) -> Any:
    msg = f"{name} is not a JSON number"
    raise ValueError(msg)


def parse_json(data: bytes | str, where: str, *, error: type[M3PatchError], hint: str,
               expect: type = object) -> Any:
    """JSON text that m3patch wrote, read back as untrusted: strict numbers, one typed error."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
    except UnicodeDecodeError as exc:
        msg = f"{where}: not UTF-8 text (byte {exc.start})"
        raise error(msg, hint=hint) from None
    try:
        value = json.loads(text, parse_constant=_reject_constant)
    except (ValueError, RecursionError) as exc:
        msg = f"{where}: not JSON ({exc})"
        raise error(msg, hint=hint) from None
    if not isinstance(value, expect):
        msg = f"{where}: expected a JSON {_kind(expect)}, got {type(value).__name__}"
        raise error(msg, hint=hint)
    return value


STATE_MAX_BYTES = 256 << 20  # no state file m3patch writes comes near this


TREE_FILE_MAX_BYTES = 64 << 20  # vLLM's largest source file is under 1 MB


def read_bytes(path: Path | str) -> bytes:
    """A file of the vLLM tree, with half the system calls of `Path.read_bytes` (no buffered
    file object); read per file of every command, by read_state. The tree is input: a FIFO
    there would block, a device never end, a sparse file fill memory, so only a regular file of
    at most TREE_FILE_MAX_BYTES is read (else OSError EINVAL or EFBIG naming the path); a link
    is never followed (ELOOP: safe_targets refuses links before this, this closes the race).
    FileNotFoundError and IsADirectoryError as `Path.read_bytes`."""
    return read_state(path, TREE_FILE_MAX_BYTES)


def read_state(path: Path | str, limit: int = STATE_MAX_BYTES, *, links: bool = False) -> bytes:
    """The bytes of a state file m3patch wrote, read as untrusted: never through a symlink
    (ELOOP), only a regular file (a FIFO would block, /dev/zero never ends: EINVAL), at most
    `limit` bytes (EFBIG). Raises OSError (FileNotFoundError when missing), like read_bytes.
    `links`: a file another tool lays out as a link (the Hugging Face cache links each snapshot
    file to its blob) is followed; it must still end at a regular file within `limit`."""
    nofollow = 0 if links else os.O_NOFOLLOW
    fd = os.open(path, os.O_RDONLY | nofollow | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
        if not stat.S_ISREG(info.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        chunks = []
        size = 0
        ask = info.st_size + 1  # the whole file in one read (and no copy) while it does not grow
        while chunk := os.read(fd, ask):
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
            chunks.append(chunk)
            ask = 1 << 20
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)
    finally:
        os.close(fd)


FIFO_WRITER_WAIT_S = 10.0  # a FIFO's reader started just before its writer: `markers check F &`


def read_stream(path: Path | str, limit: int) -> bytes:
    """A file a user names that may be a pipe: a regular file or device as `read_state`
    (links followed), or a pipe read until its writer closes it: a shell's pipe or process
    substitution (`/dev/stdin`, `<(cat server.log)`: empty when its writer wrote nothing), or a
    named FIFO, whose writer may come up to FIFO_WRITER_WAIT_S later. A named FIFO no writer
    opens by then is refused (OSError ENXIO): a blocking open would wait forever."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)  # no wait for a writer
    try:
        if not stat.S_ISFIFO(os.fstat(fd).st_mode):
            return read_state(path, limit, links=True)
        # a shell's pipe is reached through /dev/fd (/proc/self/fd/N -> "pipe:[inode]"); its
        # writer was there from the start, so an end at once is an empty log, not a missing writer
        shells = Path(os.path.realpath(path)).name.startswith("pipe:[")
        return _read_pipe(fd, str(path), limit, 0.0 if shells else FIFO_WRITER_WAIT_S)
    finally:
        os.close(fd)


def _read_pipe(fd: int, path: str, limit: int, writer_wait_s: float) -> bytes:
    chunks: list[bytes] = []
    size, waited = 0, False
    poller = select.poll()
    poller.register(fd, select.POLLIN)
    while True:
        try:
            chunk = os.read(fd, 1 << 20)
        except BlockingIOError:  # empty while a writer holds it: wait for bytes or its close
            waited = True
            poller.poll()
            continue
        if chunk:
            size += len(chunk)
            if size > limit:
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", path)
            chunks.append(chunk)
            continue
        if chunks or waited or not writer_wait_s:
            break
        # a named FIFO at its end before any writer opened it: Linux's poll reports nothing
        # until a writer comes (then bytes, or a hang-up once it leaves)
        waited = True
        if not poller.poll(int(writer_wait_s * 1000)):
            msg = f"a FIFO no writer opened within {writer_wait_s:g} s"
            raise OSError(errno.ENXIO, msg, path)
    return b"".join(chunks)


def read_json(path: Path, *, error: type[M3PatchError], hint: str, expect: type = object,
              missing_ok: bool = False, links: bool = False) -> Any:
    """Read and parse `path` (`read_state`: no link unless `links`, no FIFO, no device,
    bounded); None for a missing file when `missing_ok`, else `error`."""
    try:
        data = read_state(path, links=links)
    except FileNotFoundError:
        if missing_ok:
            return None
        msg = f"{path}: missing"
        raise error(msg, hint=hint) from None
    except OSError as exc:
        why = "a symlink" if exc.errno == errno.ELOOP else exc.strerror or exc
        msg = f"{path}: cannot read ({why})"
        raise error(msg, hint=hint) from None
    return parse_json(data, str(path), error=error, hint=hint, expect=expect)


def _kind(expect: type) -> str:
    names: dict[type, str] = {dict: "object", list: "array", str: "string"}
    return names.get(expect, expect.__name__)
