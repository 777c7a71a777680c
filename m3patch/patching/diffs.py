"""Unified diff -> pure file/hunk model (unidiff parses; m3patch applies), plus hostile-path checks.

Text is handled as str decoded with `surrogateescape`, so any byte round-trips exactly, and lines
are split on "\\n" only: `str.splitlines` would also split on form feeds and U+2028, which
appear in real sources and would shift every hunk position after them.
"""

from __future__ import annotations

import errno
import io
import os
import re
import stat
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from m3patch.errors import FileNameEncoding, HostilePatch, UsageError

if TYPE_CHECKING:
    from unidiff.patch import Hunk as UnidiffHunk
    from unidiff.patch import PatchedFile, PatchSet

FileKind = Literal["modify", "add", "delete"]
ENCODING = "utf-8"
# unidiff's own patterns (unidiff.constants), kept here so that importing this module does
# not import unidiff: a hunk header, and a body line that is only a line break
RE_HUNK_HEADER = re.compile(r"^@@ -(\d+)(?:,(\d+))? \+(\d+)(?:,(\d+))?\ @@[ ]?(.*)")
RE_EMPTY_BODY_LINE = re.compile(r"^(?P<line_type>[- \+\\]?)(?P<value>[\r\n]{1,2})", re.DOTALL)
_MODE_RE = re.compile(r"^(?:new file mode|deleted file mode|old mode|new mode) (\d+)$", re.M)


@dataclass(frozen=True)
class Hunk:
    index: int  # 1-based, in file order, for messages
    old_start: int  # 1-based line number in the pre-image (0 for an empty pre-image)
    old_lines: tuple[str, ...]
    new_start: int
    new_lines: tuple[str, ...]
    header: str


@dataclass(frozen=True)
class FilePatch:
    path: str  # relative to the tree root, always under vllm/
    kind: FileKind
    hunks: Sequence[Hunk]  # a tuple, or the parse memo's StoredHunks (made on first use)
    new_mode: int | None  # permission bits of a git "new file mode" (add) / "deleted file mode"


@dataclass(frozen=True)
class PatchFile:
    name: str  # the .patch file name, for messages
    files: tuple[FilePatch, ...]


def decode(data: bytes) -> str:
    return data.decode(ENCODING, "surrogateescape")


def encode(text: str) -> bytes:
    return text.encode(ENCODING, "surrogateescape")


def split_lines(text: str) -> list[str]:
    """Lines with their "\\n" kept; a last line without newline stays as is."""
    if not text:
        return []
    # io's reader with newline="\n" ends lines at "\n" only and keeps it, in C: twice as fast
    # as splitting and re-adding, on every patch and file a release-sized series reads
    return io.StringIO(text, newline="\n").readlines()


_ABSENT = (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ELOOP)  # Path.is_symlink's "no"
# The writer stages `.NAME.m3patch-new` and backs up `.NAME.m3patch-pre` beside each file: a
# series path of that shape would be overwritten (or deleted) by the transaction of NAME.
WRITER_SUFFIXES = (".m3patch-new", ".m3patch-pre")
FILE_MODES = ("100644", "100755")  # the only modes git records for a plain file
_NAME_MAX, _PATH_MAX = 255, 4000  # bytes; Linux NAME_MAX and (with room for the root) PATH_MAX


_ACCEPTED: dict[str, str] = {}  # path -> its normal form, for paths that passed every check


def check_rel_path(path: str, where: str) -> str:
    """Refuse absolute paths, `..`, anything outside vllm/ or inside m3patch's own state folder,
    and names the file system cannot hold (HostilePatch, exit 9), or that this locale cannot
    encode (FileNameEncoding, exit 35)."""
    # a pure function of the text, asked of each file by the lock, the parse memo and both
    # confinement checks of an apply: a path that passed once is answered from memory
    known = _ACCEPTED.get(path)
    return _check_rel_path(path, where) if known is None else known


def _check_rel_path(path: str, where: str) -> str:
    # plain strings, not PurePosixPath: this runs for every file of every patch on each load;
    # the parts are PurePosixPath's for a relative path (empty and "." parts dropped)
    parts = [part for part in path.split("/") if part and part != "."]
    hint = "patch paths must look like a/vllm/... and b/vllm/... relative to the tree root"
    if path.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", path):
        msg = f"{where}: absolute path {path!r} in patch"
        raise HostilePatch(msg, hint=hint)
    if ".." in parts or "\x00" in path:
        msg = f"{where}: path {path!r} climbs out with '..'"
        raise HostilePatch(msg, hint=hint)
    if len(parts) < 2 or parts[0] != "vllm":
        msg = f"{where}: path {path!r} is not under vllm/"
        raise HostilePatch(msg, hint=hint)
    if parts[1] == ".m3patch":
        msg = f"{where}: path {path!r} is inside m3patch's state folder vllm/.m3patch/"
        raise HostilePatch(msg, hint=hint)
    if parts[-1].endswith(WRITER_SUFFIXES):
        msg = (f"{where}: path {path!r} ends like the writer's own staging or backup names "
               f"({', '.join(WRITER_SUFFIXES)}): it would clash with the transaction of another file")
        raise HostilePatch(msg, hint=hint)
    _require_nameable(path, where)
    sizes = [len(encode(part)) for part in parts]
    if max(sizes) > _NAME_MAX or sum(sizes) + len(sizes) > _PATH_MAX:
        msg = f"{where}: path {path[:60]!r}... is longer than the file system allows"
        raise HostilePatch(msg, hint=hint)
    _ACCEPTED[path] = normal = "/".join(parts)
    return normal


def _require_nameable(path: str, where: str) -> None:
    """Refuse a name every os call would fail on: under an ASCII locale with UTF-8 mode off
    (`LANG=C PYTHONUTF8=0 PYTHONCOERCECLOCALE=0`) the file-system encoding has no bytes for
    `é`. Checked where every patch, ledger and journal path enters, so no command gets halfway."""
    try:
        path.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:  # a lone surrogate: no locale has bytes for it
        msg = f"{where}: path {path!r} is not a file name in any encoding"
        raise HostilePatch(msg, hint="patch paths are UTF-8 text") from None
    try:
        os.fsencode(path)
    except UnicodeEncodeError as exc:
        char = exc.object[exc.start:exc.end]
        msg = (f"{where}: path {path!r} holds {char!r}, which this process's file-system "
               f"encoding ({sys.getfilesystemencoding()}) cannot name")
        raise FileNameEncoding(msg, hint="run under a UTF-8 locale: export LC_ALL=C.UTF-8 "
                                         "(or PYTHONUTF8=1), then re-run the command") from None


def _strip_prefix(name: str) -> str:
    return name[2:] if name.startswith(("a/", "b/")) else name


Rows = tuple[list[str], list[str]]  # a hunk's old and new lines


def _add(sides: Rows, last: list[list[str]], kind: str, value: str) -> list[list[str]]:
    """One unidiff line of a hunk onto its sides; the sides it went to (for a marker after it)."""
    if kind == "\\":  # "\ No newline at end of file" belongs to the previous line
        for side in last:
            side[-1] = side[-1].removesuffix("\n")
        return last
    if kind == "":  # a blank line after the body's counts are met: git and GNU patch ignore it
        return last
    old, new = sides
    last = [old, new] if kind == " " else [old] if kind == "-" else [new]
    for side in last:
        side.append(value)
    return last


def _hunk_lines(hunk: UnidiffHunk) -> Rows:
    sides: Rows = ([], [])
    last: list[list[str]] = []
    for line in hunk:
        last = _add(sides, last, line.line_type, line.value)
    return sides


_BODY_TYPES = frozenset("+- \\")


def _body(lines: list[str], start: int, hunk: UnidiffHunk) -> tuple[Rows, list[list[str]], int]:
    """The sides of the hunk body after the header at `start - 1`, read exactly as unidiff's
    full parse reads it (the same counting, line types and values); the sides its last line
    went to; the index after it. ValueError where the body does not end as the header says
    (unidiff has judged it already; a disagreement sends the patch to unidiff's full parse)."""
    source, target = hunk.source_start, hunk.target_start
    source_end, target_end = source + hunk.source_length, target + hunk.target_length
    old: list[str] = []
    new: list[str] = []
    both, only_old, only_new = [old, new], [old], [new]
    last: list[list[str]] = []
    for i in range(start, len(lines)):
        line = lines[i]
        kind = line[0]
        if kind in _BODY_TYPES:
            value = line[1:]
        else:  # unidiff's empty body line: a context line whose value is its line break
            empty = RE_EMPTY_BODY_LINE.match(line)
            if empty is None:
                raise ValueError(line)
            kind, value = " ", empty.group("value")
        if kind == " ":
            source += 1
            target += 1
            old.append(value)
            new.append(value)
            last = both
        elif kind == "-":
            source += 1
            old.append(value)
            last = only_old
        elif kind == "+":
            target += 1
            new.append(value)
            last = only_new
        else:  # "\\": no newline at the end of the line before
            for side in last:
                side[-1] = side[-1].removesuffix("\n")
        if source > source_end or target > target_end:
            raise ValueError(line)
        if source == source_end and target == target_end:
            return (old, new), last, i + 1
    raise ValueError(hunk)


def _fast_patch_set(lines: list[str]) -> tuple[PatchSet, list[Rows]] | None:
    """unidiff's metadata-only parse (files, headers, hunk positions and counts, every check it
    makes, but no object per line) plus each hunk's lines read here: the same model as its
    full parse at half the time. None where the two could differ: the caller then runs the
    full parse, which decides (and words any error)."""
    from unidiff.patch import PatchSet  # lazy: only commands that read patches pay for it

    try:
        patch_set = PatchSet(lines, metadata_only=True)
    except Exception:  # the full parse gives the error its words
        return None
    flat = [hunk for pf in patch_set for hunk in pf]
    out: list[Rows] = []
    i = 0
    try:
        while i < len(lines):
            header = RE_HUNK_HEADER.match(lines[i]) if lines[i].startswith("@@ ") else None
            i += 1
            if header is None:
                continue
            hunk = flat[len(out)]
            if (hunk.source_start, hunk.target_start) != (int(header[1]), int(header[3])):
                return None
            sides, last, i = _body(lines, i, hunk)
            # the metadata parse keeps only what follows a body (trailing empty lines, "no
            # newline" markers), in order, as the full parse appends them after the body
            for line in hunk:
                last = _add(sides, last, line.line_type, line.value)
            out.append(sides)
    except (ValueError, IndexError):
        return None
    return (patch_set, out) if len(out) == len(flat) else None


def _file_kind(pf: PatchedFile, info: str) -> FileKind:
    """From /dev/null or git's mode headers only: unidiff's is_added_file is also true for a
    single `@@ -0,0` hunk, which is how git diffs an edit of an existing EMPTY file."""
    if pf.source_file == "/dev/null" or re.search(r"^new file mode ", info, re.M):
        return "add"
    if pf.target_file == "/dev/null" or re.search(r"^deleted file mode ", info, re.M):
        return "delete"
    return "modify"


def _check_file(pf: PatchedFile, info: str, where: str) -> str:
    source = _strip_prefix(pf.source_file)
    target = _strip_prefix(pf.target_file)
    if pf.is_binary_file or "GIT binary patch" in info:
        msg = f"{where}: binary patch for {target}; m3patch applies text diffs only"
        raise HostilePatch(msg, hint="regenerate the patch without --binary")
    if pf.is_symlink or "120000" in _MODE_RE.findall(info):
        msg = f"{where}: {target} is a symlink in the patch; symlinks are refused"
        raise HostilePatch(msg, hint="patch the real file instead of a link")
    paths = [p for p in (source, target) if p != "/dev/null"]
    if not paths:
        msg = f"{where}: a file diff with /dev/null on both sides names no file"
        raise UsageError(msg, hint="regenerate the patch with `git diff`")
    odd = [m for m in _MODE_RE.findall(info) if m not in FILE_MODES]
    if odd:
        msg = (f"{where}: {target}: file mode {odd[0]} is refused (setuid, world-writable or "
               f"not a mode); only {' and '.join(FILE_MODES)} are accepted")
        raise HostilePatch(msg, hint="regenerate the patch from a file of mode 644 or 755")
    for path in paths:
        check_rel_path(path, where)
    if len(set(paths)) > 1 or pf.is_rename:
        msg = f"{where}: rename {source} -> {target} is not supported"
        raise UsageError(msg, hint="express a rename as a delete plus an add")
    if _file_kind(pf, info) == "modify" and any(
        m.startswith(("old mode", "new mode")) for m in info.splitlines()
    ):
        msg = f"{where}: mode change on {target} is not supported"
        raise UsageError(msg, hint="drop the mode change from the patch")
    return paths[0]


def _refuse_crlf_headers(lines: list[str], name: str) -> None:
    """A file header ending in CRLF means the whole patch was re-saved with Windows line endings
    (git writes headers with LF even for a CRLF file, whose CRs sit in the hunk bodies); read on,
    the CR would become part of the path and the patch be misnamed a rename."""
    # "--- x" can also be a body line (a removed "-- x"), so plain `diff -u` headers count only
    # as a "---"/"+++" pair, and only in a patch with no git header (which no body line can be)
    git = any(line.startswith("diff --git ") for line in lines)
    for number, line in enumerate(lines, start=1):
        header = line.startswith("diff --git ") or (
            not git and line.startswith("--- ") and number < len(lines)
            and lines[number].startswith("+++ "))
        if header and line.endswith("\r\n"):
            msg = (f"{name}: line {number}: the file header ends in CRLF: the patch was saved with "
                   "Windows line endings")
            raise UsageError(msg, hint=f"convert it back (`sed -i 's/\\r$//' {name}` or "
                             "dos2unix), then run `m3patch series lock` again")


def _refuse_lying_counts(lines: list[str], patch_set: PatchSet, name: str) -> None:
    """A hunk whose header counts fewer lines than its body has: the reader stops at the count,
    so the "-"/"+" lines after it would be dropped without a word (git apply calls such a patch
    corrupt). An empty hunk (0 lines on both sides) is refused the same way. "-- " alone is the
    signature line `git format-patch` ends a patch with, not a removed line."""
    flat = [(pf, hunk) for pf in patch_set for hunk in pf]
    at = 0
    for i, line in enumerate(lines):
        if at == len(flat) or not line.startswith("@@ ") or not RE_HUNK_HEADER.match(line):
            continue
        pf, hunk = flat[at]
        at += 1
        where = f"{name}: line {i + 1}: hunk of {_strip_prefix(pf.target_file)}"
        if hunk.source_length == 0 and hunk.target_length == 0:
            msg = f"{where} is empty ({line.strip()})"
            raise UsageError(msg, hint="drop the hunk, or regenerate the patch with `git diff`")
        try:
            _, _, end = _body(lines, i + 1, hunk)
        except (ValueError, IndexError):
            continue  # a body the reader already judged short or odd: unidiff words that
        nxt = lines[end] if end < len(lines) else ""
        header = nxt.startswith("--- ") and end + 1 < len(lines) and lines[end + 1].startswith("+++ ")
        if nxt[:1] in ("+", "-", " ") and nxt.rstrip("\r\n") != "-- " and not header:
            msg = (f"{where}: line {end + 1} ({nxt.rstrip()[:60]!r}) follows the last line the "
                   f"header counts ({line.strip()[:60]}): the counts lie")
            raise UsageError(msg, hint="regenerate the patch with `git diff` "
                             "(a hand edit must update the counts)")


def parse_patch(data: bytes, name: str, *, full: bool = False) -> PatchFile:
    """Parse one .patch file into the pure model; malformed input fails closed (exit 2).
    `full`: unidiff's full parse only (the reference the fast reading is tested against)."""
    from unidiff.patch import PatchSet  # lazy: only commands that read patches pay for it

    if b"\x00" in data:
        msg = f"{name}: contains NUL bytes (binary content)"
        raise HostilePatch(msg, hint="m3patch applies text diffs only")
    lines = split_lines(decode(data))
    _refuse_crlf_headers(lines, name)
    fast = None if full else _fast_patch_set(lines)
    if fast is None:
        try:
            patch_set = PatchSet(lines)
        except Exception as exc:  # unidiff raises more than UnidiffParseError on bad input
            msg = f"{name}: not a valid unified diff: {exc}"
            raise UsageError(msg, hint="regenerate it with `git diff` or `diff -u`") from None
        sides = [_hunk_lines(hunk) for pf in patch_set for hunk in pf]
    else:
        patch_set, sides = fast
    _refuse_lying_counts(lines, patch_set, name)
    files: list[FilePatch] = []
    flat = iter(sides)
    for pf in patch_set:
        info = str(pf.patch_info or "")
        path = _check_file(pf, info, name)
        hunks = []
        for index, hunk in enumerate(pf, start=1):
            old, new = next(flat)
            hunks.append(Hunk(index, hunk.source_start, tuple(old), hunk.target_start,
                              tuple(new), str(hunk.section_header or "")))
        if not hunks and _file_kind(pf, info) == "modify":
            msg = f"{name}: {path}: a file header with no hunk changes nothing"
            raise UsageError(msg, hint="drop the header, or regenerate the patch with `git diff`")
        modes = [stat.S_IMODE(int(m, 8)) for m in _MODE_RE.findall(info)]
        files.append(FilePatch(path, _file_kind(pf, info), tuple(hunks),
                               modes[-1] if modes else None))
    if not files:
        msg = f"{name}: contains no file diffs"
        raise UsageError(msg, hint="check that the file is a unified diff")
    seen = [f.path for f in files]
    if len(seen) != len(set(seen)):
        msg = f"{name}: names the same file twice"
        raise UsageError(msg, hint="merge the diffs of one file into one section")
    return PatchFile(name, tuple(files))


def safe_target(root: Path, rel: str) -> Path:
    """The absolute target of a patch path, refusing symlinks on the way (HostilePatch)."""
    return Path(_safe(root, rel, set()))


def safe_targets(root: Path, rels: Iterable[str]) -> dict[str, str]:
    """`safe_target` of each path as a plain string, each folder on the way inspected once for
    the whole batch (a release-sized series has a thousand files in a few hundred folders)."""
    plain: set[str] = set()
    return {rel: _safe(root, rel, plain) for rel in rels}


def _safe(root: Path, rel: str, plain: set[str]) -> str:
    parts = check_rel_path(rel, str(root)).split("/")
    current = str(root)
    for depth, part in enumerate(parts, start=1):
        current = f"{current}/{part}"  # plain strings: this runs per file of every command
        if current in plain:  # a folder of this batch already found to be no link
            continue
        try:
            if not stat.S_ISLNK(os.lstat(current).st_mode):
                if depth < len(parts):
                    plain.add(current)
                continue
        except OSError as exc:
            if exc.errno in _ABSENT:  # as Path.is_symlink: nothing there is no link
                continue
            # e.g. ENAMETOOLONG: nothing m3patch can write there
            msg = f"{Path(current)}: cannot inspect the patch target: {exc.strerror}"
            raise HostilePatch(msg, hint="m3patch writes only plain paths inside the tree") from None
        resolved = Path(os.path.realpath(current))
        if depth == len(parts):
            msg = f"{Path(current)}: the patch target is a symlink (-> {resolved})"
            raise HostilePatch(msg, hint="m3patch never writes through a symlink")
        if not resolved.is_relative_to(Path(os.path.realpath(root))):
            msg = f"{Path(current)}: symlink points outside the tree (-> {resolved})"
            raise HostilePatch(msg, hint="m3patch never writes through a symlink")
    return current
