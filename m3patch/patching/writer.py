"""Effects: a journaled, all-or-nothing replacement of files in the tree, under a lock.

Order of writes (each one is a numbered "step" for the fault hook):
  1 journal(phase=stage)  2.. backup links, new folders + staged post-images
  journal(phase=commit)  renames/unlinks  ledger  cleanup  [removal of folders]  journal removal.
The journal is written before anything else, so a killed run always leaves one behind; the next
run (`recover`) rolls a `stage` journal back and completes a `commit` journal when every staged
file is present with its post-image hash, else restores the backups (hard links of the
pre-images, so no data is copied and nothing is written through a link). Folders created for new
files are named in the journal before they are made, so a rollback removes exactly those (and a
revert removes the ones the ledger says the apply made); a pre-existing folder is never removed.
Durability is per phase, not per file: everything staged (post-images, backup links, folders) is
flushed at once (fsio.make_durable: one syncfs) before the commit journal is written, and the
renames at once before the ledger; the journal and ledger themselves are fsynced as they land.
A large transaction's per-file steps (staging, renames, backup removal) run on a few threads,
each owning whole folders (folder_shares); the phases stay in order, and so does every file's
own steps, so a killed run leaves the same kinds of states as one thread would.

Test-only fault hook: M3PATCH_FAULT=kill-after:N sends SIGKILL to this process right after
write step N; M3PATCH_FAULT=fail-after:N raises OSError there (an I/O error mid-transaction).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import signal
import stat
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path, PurePosixPath

from m3patch.errors import (
    HostilePatch,
    LockTimeout,
    PatchConflict,
    TreeIOError,
    raise_if_interrupted,
)
from m3patch.fsio import (
    DEFAULT_MODE,
    make_durable,
    owned_dir,
    read_json,
    replace_atomic,
    write_new,
)
from m3patch.patching.diffs import check_rel_path, safe_target
from m3patch.patching.folder_shares import run_shares
from m3patch.patching.ledger import (
    check_sha256,
    dirs_above,
    file_digest,
    journal_path,
    ledger_path,
    parse_ledger,
    state_dir,
)

JOURNAL = "journal.json"
PHASES = ("stage", "commit")
_HELD: set[str] = set()  # the lock files this process holds (tree_lock is re-entrant)


@dataclass(frozen=True)
class Change:
    path: str  # relative to the root
    pre: str | None
    post: str | None  # None = delete
    data: bytes | None  # the post-image
    mode: int | None = None  # permission bits of a new file (git "new file mode"); default 0644
    make_dirs: tuple[str, ...] = ()  # missing folders to create for a new file, shallowest first
    drop_dirs: tuple[str, ...] = ()  # folders to remove (when empty) after the file is deleted


@dataclass(frozen=True)
class Entry:
    path: str
    pre: str | None
    post: str | None
    stage: str | None  # file name beside the target
    backup: str | None
    made_dirs: tuple[str, ...] = ()
    drop_dirs: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, raw: object, root: Path) -> Entry:
        """An entry read back from the journal, validated like a hostile diff: the path confined
        to vllm/ with no symlink on the way (HostilePatch), hashes well-formed, the stage and
        backup names the ones this writer derives from the path, folders only above the file."""
        if not isinstance(raw, dict):
            msg = f"entry is a {type(raw).__name__}, not an object"
            raise ValueError(msg)
        if not isinstance(raw["path"], str):
            msg = f"'path' {raw['path']!r} is not a string"
            raise ValueError(msg)
        path = check_rel_path(raw["path"], str(journal_path(root)))  # HostilePatch, exit 9
        safe_target(root, path)
        pre, post = check_sha256(raw["pre"], "pre"), check_sha256(raw["post"], "post")
        name = PurePosixPath(path).name
        stage = f".{name}.m3patch-new" if post is not None else None
        backup = f".{name}.m3patch-pre" if pre is not None else None
        if (raw["stage"], raw["backup"]) != (stage, backup):
            msg = (f"{path}: stage/backup {raw['stage']!r}, {raw['backup']!r} are not the names "
                   f"this writer uses ({stage!r}, {backup!r})")
            raise ValueError(msg)
        made = dirs_above(path, raw.get("made_dirs", []), "made_dirs")
        drop = dirs_above(path, raw.get("drop_dirs", []), "drop_dirs")
        return cls(path, pre, post, stage, backup, made, drop)


class _Steps:
    """Counts write steps (from every thread of a transaction); the fault hook lets tests stop
    the process at each one."""

    def __init__(self) -> None:
        self.count = 0
        self.lock = threading.Lock()
        kind, _, number = os.environ.get("M3PATCH_FAULT", "").partition(":")
        self.kind = kind
        self.at = int(number) if number.isdigit() else -1

    def done(self) -> None:
        with self.lock:
            self.count += 1
            count = self.count
        if count != self.at:
            return
        if self.kind == "kill-after":
            os.kill(os.getpid(), signal.SIGKILL)
        if self.kind == "fail-after":
            raise OSError(5, f"M3PATCH_FAULT injected I/O error after step {count}")


def lock_timeout_from_env() -> float:
    """$M3PATCH_LOCK_TIMEOUT in seconds (tool_env.lock_timeout_s: checked at every command's
    start too, so a read-only command refuses a bad value as apply does)."""
    from m3patch.tool_env import lock_timeout_s

    return lock_timeout_s(os.environ)


def safe_state_dir(root: Path, *, create: bool) -> Path:
    """<root>/vllm/.m3patch as a real folder this user owns, reached through a real vllm/: a
    symlink on the way (or a file, or another user's folder) is HostilePatch (exit 9), before
    anything is created, written or deleted through it. Without `create`, a missing folder is
    FileNotFoundError."""
    vllm = root / "vllm"
    if vllm.is_symlink():
        msg = f"{vllm}: a symlink (-> {vllm.readlink()}); m3patch never writes through a link"
        raise HostilePatch(msg, hint="point --vllm-root at the real tree")
    folder = state_dir(root)
    if not create and not os.path.lexists(folder):
        raise FileNotFoundError(folder)
    return owned_dir(folder, create=create, error=HostilePatch)


def _open_lock(path: Path) -> int:
    """The lock file, created if missing, never through a link (a dangling link included)."""
    try:
        return os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP or path.is_symlink():
            msg = f"{path}: the lock is a symlink; m3patch never writes through a link"
            raise HostilePatch(msg, hint=f"remove {path} (m3patch re-creates it)") from None
        msg = f"{path}: cannot create the lock: {exc.strerror}"
        raise TreeIOError(msg, hint="run as the owner of the vLLM tree") from None


@contextlib.contextmanager
def tree_lock(root: Path, timeout_s: float | None = None) -> Iterator[None]:
    """Exclusive flock on <root>/vllm/.m3patch/lock; LockTimeout after the deadline. Re-entrant
    within this process: a nested call for a tree already locked here holds it already."""
    if timeout_s is None:
        timeout_s = lock_timeout_from_env()
    path = safe_state_dir(root, create=True) / "lock"
    key = os.path.realpath(path)
    if key in _HELD:
        yield
        return
    fd = _open_lock(path)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        msg = f"{path}: not a regular file"
        raise HostilePatch(msg, hint=f"remove {path} (m3patch re-creates it)")
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                raise_if_interrupted()  # a stop signal a memo read swallowed still ends the wait
                if time.monotonic() >= deadline:
                    msg = f"{path}: another m3patch run held the lock for {timeout_s:.0f} s"
                    raise LockTimeout(msg, hint="wait for it, or raise M3PATCH_LOCK_TIMEOUT") from None
                time.sleep(0.02)
        _HELD.add(key)
        try:
            yield
        finally:
            _HELD.discard(key)
    finally:
        os.close(fd)  # closing releases the flock


def _write_journal(root: Path, phase: str, entries: list[Entry], ledger: bytes | None) -> None:
    # the same document as asdict() gives, field by field and without indent: asdict and an
    # indented dump run in pure Python, about a second each for a release-sized transaction
    names = [f.name for f in fields(Entry)]
    body = {"phase": phase, "entries": [{n: getattr(e, n) for n in names} for e in entries],
            "ledger": None if ledger is None else ledger.decode()}
    replace_atomic(journal_path(root), json.dumps(body).encode())


def _entry(change: Change) -> Entry:
    name = Path(change.path).name
    stage = f".{name}.m3patch-new" if change.post is not None else None
    backup = f".{name}.m3patch-pre" if change.pre is not None else None
    return Entry(change.path, change.pre, change.post, stage, backup, change.make_dirs,
                 change.drop_dirs)


def _stage(root: Path, change: Change, entry: Entry, steps: _Steps) -> None:
    # plain strings, not Paths: this runs per file of a transaction of a thousand files
    target = f"{root}/{change.path}"
    folder = target.rpartition("/")[0]
    if entry.backup is not None:
        backup = f"{folder}/{entry.backup}"
        try:
            os.link(target, backup)  # a second name for the pre-image, no copy
        except FileExistsError:  # a killed run's leftover: replaced, never written through
            os.unlink(backup)
            os.link(target, backup)
        steps.done()
    if entry.made_dirs:
        for rel in entry.made_dirs:
            (root / rel).mkdir(exist_ok=True)
        steps.done()
    if entry.stage is not None and change.data is not None:
        # durable with the whole stage at once (make_durable in commit), before the commit phase
        info = os.stat(target) if change.pre is not None else None
        mode = stat.S_IMODE(info.st_mode) if info is not None else change.mode or DEFAULT_MODE
        owner = None if info is None else (info.st_uid, info.st_gid)  # the target's, kept
        write_new(f"{folder}/{entry.stage}", change.data, mode, sync=False, owner=owner)
        steps.done()


def folder_keys(entries: list[Entry]) -> list[str]:
    """Per entry, the folder whose thread stages, renames and cleans it up: the shallowest
    folder the transaction creates above it (the entry that creates it comes first in the
    same thread), else its own folder."""
    made = {d for e in entries for d in e.made_dirs}
    keys = []
    for entry in entries:
        parts = entry.path.split("/")
        above = ("/".join(parts[:n]) for n in range(2, len(parts)))
        keys.append(next((d for d in above if d in made), entry.path.rpartition("/")[0]))
    return keys


def _swap_step(root: Path, entry: Entry, steps: _Steps) -> None:
    _swap(root, entry)
    steps.done()


def _swap(root: Path, entry: Entry) -> None:
    target = f"{root}/{entry.path}"
    if entry.post is None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(target)
    elif entry.stage is not None:
        with contextlib.suppress(FileNotFoundError):  # already swapped (a recovered run)
            os.replace(f"{target.rpartition('/')[0]}/{entry.stage}", target)


def _folders(root: Path, entries: list[Entry]) -> list[Path]:
    """The folders whose entries a transaction changes: each file's, and above each it made."""
    out = [f"{root}/{e.path}".rpartition("/")[0] for e in entries]
    out += [f"{root}/{d}".rpartition("/")[0] for e in entries for d in e.made_dirs]
    return [Path(d) for d in dict.fromkeys(out) if os.path.exists(d)]


def _stage_durable(root: Path, entries: list[Entry]) -> None:
    """Staged post-images, backup links and new folders on disk, in one flush."""
    staged = ((root / e.path).parent / e.stage for e in entries if e.stage is not None)
    # lazily: only the fallback without syncfs opens each file
    make_durable((p for p in staged if p.exists()), _folders(root, entries))


def _finish(root: Path, entries: list[Entry], ledger: bytes | None, steps: _Steps,
            keys: list[str] | None = None) -> None:
    make_durable([], _folders(root, entries))  # the renames, before the ledger says so
    if ledger is None:
        with contextlib.suppress(FileNotFoundError):
            ledger_path(root).unlink()
    else:
        replace_atomic(ledger_path(root), ledger)
    steps.done()
    run_shares(lambda entry: _drop_backup(root, entry), entries,
               folder_keys(entries) if keys is None else keys)
    steps.done()
    if any(e.drop_dirs for e in entries):
        _remove_dirs(root, [d for e in entries for d in e.drop_dirs])
        steps.done()
    journal_path(root).unlink()
    steps.done()


def _drop_backup(root: Path, entry: Entry) -> None:
    if entry.backup:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"{root}/{entry.path}".rpartition("/")[0] + f"/{entry.backup}")


def _remove_dirs(root: Path, dirs: list[str]) -> None:
    """Remove these folders, deepest first, where empty; one holding anything else stays."""
    safe = {d for d in dirs if d.startswith("vllm/") and ".." not in d.split("/")}
    for rel in sorted(safe, key=lambda d: d.count("/"), reverse=True):
        with contextlib.suppress(OSError):
            (root / rel).rmdir()


def commit(root: Path, changes: list[Change], ledger: bytes | None) -> None:
    """Replace every file, write (or with None remove) the ledger; all or nothing."""
    raise_if_interrupted()  # a stop a best-effort step (a memo read) swallowed: write nothing
    steps = _Steps()
    entries = [_entry(c) for c in changes]
    keys = folder_keys(entries)
    try:
        _write_journal(root, "stage", entries, ledger)
        steps.done()
        run_shares(lambda pair: _stage(root, *pair, steps), list(zip(changes, entries, strict=True)),
                   keys)
        _stage_durable(root, entries)  # every staged file and link on disk before "commit"
        _write_journal(root, "commit", entries, ledger)
        steps.done()
        run_shares(lambda entry: _swap_step(root, entry, steps), entries, keys)
    except OSError as exc:
        _rollback(root, entries)
        msg = f"{root}: write failed, every file restored: {exc.strerror or exc}"
        raise TreeIOError(msg, hint="free disk space / fix permissions, then rerun") from None
    try:
        _finish(root, entries, ledger, steps, keys)
    except OSError as exc:  # every file is in place; the journal lets the next run finish
        msg = f"{root}: files replaced, but recording failed: {exc.strerror or exc}"
        raise TreeIOError(msg, hint="rerun the same m3patch command to finish") from None


def _is(path: Path, sha256: str | None) -> bool:
    """The file at `path` (never followed through a link) holds exactly these bytes."""
    return sha256 is not None and not path.is_symlink() and file_digest(path) == sha256


def _rollback(root: Path, entries: list[Entry]) -> None:
    """Undo a transaction, deleting only what it can prove this writer made: a staged or backup
    file under the writer's own names, a new file whose bytes are the entry's post-image. A
    file the journal names but whose bytes match nothing it recorded is left as it is."""
    for entry in entries:
        target = root / entry.path
        if entry.stage:
            with contextlib.suppress(FileNotFoundError):
                (target.parent / entry.stage).unlink()
        backup = target.parent / entry.backup if entry.backup else None
        if backup is not None and _is(backup, entry.pre):
            if target.exists() and backup.samefile(target):
                backup.unlink()  # rename() onto the same inode would leave both names
            else:
                backup.replace(target)
        elif entry.pre is None and _is(target, entry.post):
            target.unlink()
    _remove_dirs(root, [d for e in entries for d in e.made_dirs])
    with contextlib.suppress(FileNotFoundError):
        journal_path(root).unlink()


def _refuse_edited(root: Path, entries: list[Entry]) -> None:
    """Finishing or undoing a transaction puts the writer's backup (pre-image) or staged file
    (post-image) over its target; a target that holds neither image the journal recorded was
    changed after the run died (a hand edit), and is never overwritten: PatchConflict (5), the
    journal and the writer's files kept for the next run. A target no writer's file would
    replace is left as it is (as a lying journal's entry is)."""
    for entry in entries:
        target = root / entry.path
        if not os.path.lexists(target) or _is(target, entry.pre) or _is(target, entry.post):
            continue
        backup = target.parent / entry.backup if entry.backup else None
        staged = target.parent / entry.stage if entry.stage else None
        kept = backup is not None and _is(backup, entry.pre)  # the pre-image the writer kept
        if not (kept or (staged is not None and _is(staged, entry.post))):
            continue
        msg = (f"{target}: changed after an interrupted transaction (it holds neither the "
               f"pre-image nor the post-image recorded in {journal_path(root)}); m3patch does "
               "not overwrite it")
        raise PatchConflict(msg, hint=_edited_hint(target, backup if kept else None, entry))


def pending_edit(root: Path) -> PatchConflict | None:
    """Read-only, for status: the refusal the next apply or revert would give a hand edit made
    after the interrupted transaction (None when there is none, or the journal is not one this
    writer can act on: apply and revert report that themselves)."""
    try:
        _, entries, _ = read_journal(root)
        _refuse_edited(root, entries)
    except PatchConflict as exc:
        return exc
    except (TreeIOError, HostilePatch, OSError):
        return None
    return None


def _edited_hint(target: Path, backup: Path | None, entry: Entry) -> str:
    """The way on from a hand edit: put back the pre-image the writer kept (`backup`: None when
    it holds no such image), or remove a file the transaction adds; else the pristine file."""
    keep = "copy your edit elsewhere first, then "
    rerun = "; then rerun the same m3patch command: it finishes or undoes the transaction"
    if backup is not None:
        return f"{keep}put back the pre-image the writer kept: `mv {backup} {target}`{rerun}"
    if entry.pre is None:
        return f"{keep}remove it (the transaction adds this file): `rm {target}`{rerun}"
    return (f"{keep}restore the file: `pip install --force-reinstall --no-deps "
            f"vllm==<this tree's version>` (`m3patch locate` prints it){rerun}")


def _completable(root: Path, entry: Entry) -> bool:
    """The entry can be finished: its target already holds the post-image, or the writer's
    staged file does; a deletion only while the pre-image is present under the writer's backup
    name (proof that this writer staged it) or the file is already gone."""
    target = root / entry.path
    if entry.post is None:
        backup = target.parent / entry.backup if entry.backup else None
        return not os.path.lexists(target) or (backup is not None and _is(backup, entry.pre))
    if _is(target, entry.post):
        return True
    staged = target.parent / entry.stage if entry.stage else None
    return staged is not None and _is(staged, entry.post)


def read_journal(root: Path) -> tuple[str, list[Entry], bytes | None]:
    """The journal of a killed run, validated before any of it is acted on: a phase this writer
    writes, entries confined to vllm/ (HostilePatch, exit 9), else TreeIOError (exit 7)."""
    path = journal_path(root)
    hint = f"inspect it, restore the tree (pip install --force-reinstall vllm), then delete {path}"
    body = read_json(path, error=TreeIOError, hint=hint, expect=dict)
    try:
        if body["phase"] not in PHASES:
            msg = f"unknown phase {body['phase']!r} (this m3patch writes {' or '.join(PHASES)})"
            raise ValueError(msg)
        if not isinstance(body["entries"], list) or not isinstance(body["ledger"], str | None):
            msg = "'entries' must be a list and 'ledger' text or null"
            raise ValueError(msg)
        entries = [Entry.from_json(e, root) for e in body["entries"]]
        # UnicodeEncodeError (a ValueError): a lone surrogate, JSON's "\ud800", has no bytes
        ledger = None if body["ledger"] is None else str(body["ledger"]).encode()
    except (ValueError, KeyError, TypeError) as exc:
        msg = f"{path}: invalid journal ({type(exc).__name__}: {exc}); nothing was changed"
        raise TreeIOError(msg, hint=hint) from None
    if ledger is not None:
        parse_ledger(ledger, f"{path} (its ledger)")  # TreeIOError: never recorded unchecked
    return str(body["phase"]), entries, ledger


def recover(root: Path) -> str | None:
    """Finish or undo a transaction a killed run left behind; call it holding the lock. An I/O
    failure here is the tree's (TreeIOError, exit 7), whatever the errno."""
    try:
        return _recover(root)
    except OSError as exc:
        msg = (f"{journal_path(root)}: cannot recover the interrupted transaction: "
               f"{exc.strerror or exc}")
        raise TreeIOError(msg, hint="free disk space / fix permissions on the vLLM tree, then "
                          "rerun the same m3patch command") from None


def _recover(root: Path) -> str | None:
    for leftover in state_dir(root).glob(".*.tmp*"):  # replace_atomic temps of a killed run
        if leftover.name.rpartition(".tmp")[2].isdigit() and leftover.is_file():
            leftover.unlink()
    path = journal_path(root)
    if not os.path.lexists(path):
        return None
    phase, entries, ledger = read_journal(root)
    _refuse_edited(root, entries)
    if phase == "commit" and all(_completable(root, e) for e in entries):
        for entry in entries:
            staged = (root / entry.path).parent / entry.stage if entry.stage else None
            if entry.post is None or (staged is not None and _is(staged, entry.post)):
                _swap(root, entry)
        _finish(root, entries, ledger, _Steps())
        return "completed an interrupted transaction found in the journal"
    _rollback(root, entries)
    return "rolled back an interrupted transaction found in the journal"
