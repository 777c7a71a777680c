"""Pure series engine: per-file chains of patches, classification by hash then by hunk, post-images.

A file touched by patches p1..pn has pinned hashes h0 (pristine) .. hn (fully patched). A file
whose hash is some hk is exactly known; anything else is diagnosed hunk by hunk (forward and
reverse probes) as partially applied or drifted, and refused. No I/O here: callers pass bytes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from m3patch.errors import PatchConflict
from m3patch.patching import hunks as hk
from m3patch.patching.diffs import FilePatch, Hunk, PatchFile
from m3patch.patching.hunks import to_bytes, to_lines
from m3patch.patching.ledger import Ledger, digest
from m3patch.patching.series_lock import FilePin, PatchPin
from m3patch.patching.states import FileState, Mode, PatchState

PRISTINE, APPLIED, PARTIAL, DRIFTED, UPSTREAM = (
    FileState.PRISTINE, FileState.APPLIED, FileState.PARTIAL, FileState.DRIFTED, FileState.UPSTREAM)


@dataclass(frozen=True)
class Step:
    patch_id: str
    file: FilePatch
    pin: FilePin


@dataclass(frozen=True)
class Chain:
    path: str
    steps: tuple[Step, ...]

    @property
    def hashes(self) -> tuple[str | None, ...]:
        return (self.steps[0].pin.pre, *(s.pin.post for s in self.steps))


@dataclass(frozen=True)
class FileStatus:
    path: str
    state: FileState
    stage: int | None  # index into chain.hashes when the file equals a pinned image
    current: str | None
    hunks: tuple[tuple[str, hk.HunkState], ...]  # (patch id, state) when off every pin
    # off every pin with no hunk in conflict (a change outside every hunk): the first line where
    # the file differs from the pinned image its hunks point at, when a pristine copy was at hand
    differs_at: int | None = None
    differs_from: str = ""  # "pristine" | "post-image"


@dataclass(frozen=True)
class FilePlan:
    path: str
    pre: str | None
    post: str | None
    data: bytes | None
    offsets: tuple[tuple[str, hk.HunkState], ...] = ()


def build_chains(patches: Sequence[tuple[PatchFile, PatchPin]]) -> tuple[Chain, ...]:
    """Group every patch's file diffs by path, in series order."""
    steps: dict[str, list[Step]] = {}
    for patch, pin in patches:
        pins = {f.path: f for f in pin.files}
        for fp in patch.files:
            if fp.path not in pins:
                msg = f"{pin.file}: {fp.path} has no pin in series.lock.json"
                raise PatchConflict(msg, hint="m3patch series lock --pristine")
            steps.setdefault(fp.path, []).append(Step(pin.id, fp, pins[fp.path]))
    return tuple(Chain(path, tuple(s)) for path, s in steps.items())


def classify(chain: Chain, data: bytes | None) -> FileStatus:
    current = None if data is None else digest(data)
    hashes = chain.hashes
    for stage in range(len(hashes) - 1, -1, -1):
        if hashes[stage] == current:
            state = APPLIED if stage == len(hashes) - 1 else PRISTINE if stage == 0 else PARTIAL
            return FileStatus(chain.path, state, stage, current, ())
    if data is None:  # absence is a state of its own, never "matches" a pin by default
        return FileStatus(chain.path, FileState.MISSING, None, None, ())
    lines = to_lines(data)
    states = tuple((s.patch_id, h) for s in chain.steps
                   for h in hk.probe(lines, s.file.hunks, chain.path))
    kinds = {h.state for _, h in states}
    if kinds == {hk.APPLIED, hk.PENDING}:
        state = PARTIAL
    elif data is not None and all(hk.already_in(lines, s.file.hunks) for s in chain.steps):
        state = UPSTREAM
    else:
        state = DRIFTED
    return FileStatus(chain.path, state, None, current, states)


def post_image(chain: Chain, stage: int, data: bytes | None) -> FilePlan:
    """Apply the chain's remaining steps to a file at pinned `stage`; each step's result is
    checked against its pin, so a lock that does not match its patches is caught here."""
    for step in chain.steps[stage:]:
        data = hk.apply_file(step.file, data, step.patch_id)
        got = None if data is None else digest(data)
        if got != step.pin.post:
            msg = f"{chain.path}: patch {step.patch_id} gives sha256 {got}, lock pins {step.pin.post}"
            raise PatchConflict(msg, hint=(
                "m3patch series lock --pristine (the lock is stale); if it writes the same lock, "
                "m3patch's parse memo is wrong: rm -r ~/.cache/m3patch/parsed "
                "(or $M3PATCH_CACHE/parsed)"))
    return FilePlan(chain.path, chain.hashes[stage], chain.hashes[-1], data)


def offset_image(chain: Chain, data: bytes | None) -> FilePlan:
    """Porting mode: exact hunks at reported offsets on an unpinned file."""
    pre = None if data is None else digest(data)
    lines = to_lines(data)
    offsets: list[tuple[str, hk.HunkState]] = []
    deleted = False
    for step in chain.steps:
        if step.file.kind == "add" and (data is not None or offsets):
            msg = f"{chain.path}: patch {step.patch_id} adds this file but it already exists"
            raise PatchConflict(msg, hint="m3patch status shows what is there")
        lines, states = hk.apply_offset(lines, step.file.hunks, chain.path)
        offsets.extend((step.patch_id, s) for s in states)
        deleted = step.file.kind == "delete"
    if deleted:
        if lines:
            msg = f"{chain.path}: the delete leaves {len(lines)} lines (file differs from patch)"
            raise PatchConflict(msg, hint="port the deletion by hand")
        return FilePlan(chain.path, pre, None, None, tuple(offsets))
    out = to_bytes(lines)
    return FilePlan(chain.path, pre, digest(out), out, tuple(offsets))


def _reversed(step: Step) -> tuple[Hunk, ...]:
    return tuple(Hunk(h.index, h.new_start, h.new_lines, h.old_start, h.old_lines, h.header)
                 for h in step.file.hunks)


def pre_image(chain: Chain, stage: int, data: bytes | None, *, offset: bool = False) -> bytes | None:
    """Undo steps stage..1 exactly (reverse hunks), checking each result against its pin."""
    for step in reversed(chain.steps[:stage]):
        if offset:
            lines, _ = hk.apply_offset(to_lines(data), _reversed(step), chain.path)
        else:
            lines = hk.apply_exact(to_lines(data), _reversed(step), chain.path)
        data = None if step.file.kind == "add" and not lines else to_bytes(lines)
        got = None if data is None else digest(data)
        if not offset and got != step.pin.pre:
            msg = f"{chain.path}: undoing {step.patch_id} gives sha256 {got}, lock pins {step.pin.pre}"
            raise PatchConflict(msg, hint="m3patch status shows the file's state")
    return data


def new_file_mode(chain: Chain, kind: str) -> int | None:
    """The mode git recorded for the file where a step adds ("add") or deletes ("delete") it."""
    return next((s.file.new_mode for s in chain.steps if s.file.kind == kind), None)


def revert_plans(chains: Sequence[Chain], statuses: Mapping[str, FileStatus],
                 contents: Mapping[str, bytes | None],
                 ledger: Ledger | None) -> tuple[list[FilePlan], list[str]]:
    """(plans back to the pinned pre-images, diagnosis lines of files no pin explains); after an
    offset apply, a file equal to the post-image the ledger recorded is undone at offsets."""
    offset = ledger is not None and ledger.mode == Mode.OFFSET
    recorded = {f.path: f.post for f in ledger.files} if ledger is not None else {}
    plans, conflicts = [], []
    for chain in chains:
        status = statuses[chain.path]
        data = contents[chain.path]
        if offset and status.stage is None and recorded.get(chain.path, "") == status.current:
            pre = pre_image(chain, len(chain.steps), data, offset=True)
            plans.append(FilePlan(chain.path, status.current,
                                  None if pre is None else digest(pre), pre))
        elif status.stage is None:
            conflicts.extend(diagnosis(status))
        elif status.stage > 0:
            pre = pre_image(chain, status.stage, data)
            plans.append(FilePlan(chain.path, status.current, chain.hashes[0], pre))
    return plans, conflicts


def patch_states(chains: Sequence[Chain],
                 statuses: Mapping[str, FileStatus]) -> dict[str, PatchState]:
    """Per patch: applied / pending / partially applied / conflict, from its files' stages."""
    seen: dict[str, set[PatchState]] = {}
    for chain in chains:
        status = statuses[chain.path]
        for position, step in enumerate(chain.steps, start=1):
            if status.stage is None:
                state = PatchState.UPSTREAM if status.state == UPSTREAM else PatchState.CONFLICT
            else:
                state = PatchState.APPLIED if status.stage >= position else PatchState.PENDING
            seen.setdefault(step.patch_id, set()).add(state)
    return {pid: next(iter(s)) if len(s) == 1 else
            PatchState.CONFLICT if PatchState.CONFLICT in s else PatchState.PARTIAL
            for pid, s in seen.items()}


def first_differing_line(a: bytes | None, b: bytes | None) -> int | None:
    """1-based number of the first line where a and b differ; None when they are equal."""
    left, right = to_lines(a), to_lines(b)
    for number, (x, y) in enumerate(zip(left, right, strict=False), start=1):
        if x != y:
            return number
    return None if len(left) == len(right) else min(len(left), len(right)) + 1


def locate_drift(chain: Chain, status: FileStatus, data: bytes | None,
                 pristine: bytes | None) -> FileStatus:
    """Where a file off every pin, with no hunk in conflict, differs from the pinned image its
    hunks point at (all applied: the post-image; all pending: the pristine file)."""
    kinds = {h.state for _, h in status.hunks}
    if status.stage is not None or data is None or pristine is None or not kinds or \
            kinds - {hk.APPLIED, hk.PENDING} or len(kinds) != 1 or digest(pristine) != chain.hashes[0]:
        return status
    reference: bytes | None = pristine
    if kinds == {hk.APPLIED}:
        try:
            reference = post_image(chain, 0, pristine).data
        except PatchConflict:  # a stale lock: no reference to point at
            return status
    where = first_differing_line(reference, data)
    origin = "post-image" if kinds == {hk.APPLIED} else "pristine"
    return FileStatus(status.path, status.state, None, status.current, status.hunks, where, origin)


def diagnosis(status: FileStatus) -> list[str]:
    """Human lines: the file's state, then each hunk's state and first differing line."""
    if status.state == FileState.MISSING:
        return [f"{status.path}: missing (the series pins this file; it does not exist)"]
    out = [f"{status.path}: {status.state} (sha256 {str(status.current)[:12]} matches no pin)"]
    for patch_id, h in status.hunks:
        tail = f": {h.detail}" if h.detail else ""
        out.append(f"  {patch_id} hunk {h.index} @ line {h.line}: {h.state}{tail}")
    if status.differs_at is not None:
        out.append(f"  outside every hunk: first differs from the {status.differs_from} file "
                   f"at line {status.differs_at}")
    return out


ALL_UP_TO = 30  # a refusal of at most this many diagnosis lines shows them all; a longer one
SHOWN_FILES = 5  # names at most this many files ...
SHOWN_HUNKS = 4  # ... with at most this many hunk lines each
MORE_HINT = "`m3patch status --json` lists every file and hunk"


def summarize(lines: Sequence[str], headline: str) -> str:
    """A refusal that stays short on any base: `headline` with the counts of files and hunks,
    the first few files with their first few hunk lines, then where the rest is. `lines` are
    diagnosis lines: a file's line, then its indented hunk and detail lines."""
    blocks: list[list[str]] = []
    for line in lines:
        if line.startswith(" ") and blocks:
            blocks[-1].append(line)
        else:
            blocks.append([line])
    hunks = sum(1 for block in blocks for line in block[1:] if " hunk " in line)
    out = [f"{headline}: {len(blocks)} file(s), {hunks} hunk(s)"]
    if len(lines) <= ALL_UP_TO:
        return "\n".join([*out, *lines])
    hidden_hunks = 0
    for block in blocks[:SHOWN_FILES]:
        out.extend(block[:1 + SHOWN_HUNKS])
        rest = block[1 + SHOWN_HUNKS:]
        hidden_hunks += sum(1 for line in rest if " hunk " in line)
        if rest:
            out.append(f"    ... {len(rest)} more line(s) for this file")
    hidden_hunks += sum(1 for block in blocks[SHOWN_FILES:] for line in block if " hunk " in line)
    hidden_files = len(blocks) - SHOWN_FILES
    if hidden_files > 0 or hidden_hunks:
        out.append(f"... {max(hidden_files, 0)} more file(s), {hidden_hunks} more hunk(s) not "
                   f"shown: {MORE_HINT}")
    return "\n".join(out)
