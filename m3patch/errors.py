"""One exception root, one exit code per failure class.

Every code is unique and documented in docs/exit-codes.md; scripts and CI branch on them.

| code | class                 | meaning                                                        |
|------|-----------------------|----------------------------------------------------------------|
| 0    | -                     | success                                                        |
| 2    | UsageError            | bad command line, or a config/recipe/manifest that is invalid  |
| 3    | VllmNotFound          | no vLLM tree found, or two importable trees (ambiguous)        |
| 4    | VersionMismatch       | the vLLM tree is not the version/commit the series targets     |
| 5    | PatchConflict         | a file is partially applied, drifted, or a hunk is ambiguous   |
| 6    | VerifyFailed          | the tree does not equal the pinned post-images (or won't compile) |
| 7    | TreeIOError           | the tree cannot be read/written (read-only, permission, disk full) |
| 8    | LockTimeout           | another m3patch run held the tree lock past the deadline       |
| 9    | HostilePatch          | a patch reaches outside the tree, is binary, or uses a symlink |
| 10   | ServerExited          | vllm serve exited before it was ready                          |
| 11   | ReadyTimeout          | vllm serve was not ready by the ready deadline                 |
| 12   | MarkerMissing         | a required backend marker never appeared (or wrong count)      |
| 13   | MarkerForbidden       | a forbidden backend marker appeared                            |
| 14   | BenchFailed           | a sweep cell failed; a `tune --check` entry loses to default   |
| 15   | RunDeadline           | the whole run passed its deadline                              |
| 16   | ChangelogInvalid      | perf-changelog.yaml breaks the schema or append-only rules     |
| 17   | ResultsInvalid        | a benchmark result file is missing or malformed                |
| 18   | ServerDied            | vllm serve died or stopped answering after it was ready        |
| 19   | ModelMissing          | the recipe's model/draft/tokenizer is not on disk (fetch it)   |
| 20   | EvalFailed            | an eval score is below its min or dropped past max-drop        |
| 21   | EvalError             | the eval could not score: harness failed, task/metric missing, server died |
| 22   | PortConflict          | `series port`: a hunk conflicts on the new tree (output incomplete) |
| 23   | MarkerUnprintable     | a marker no log call of the tree plus series can print         |
| 24   | LaunchRejected        | vLLM's own parser / env list refuses the recipe's launch       |
| 25   | NodeMismatch          | a node of a multi-node set runs another series, tree, or an unverified tree |
| 26   | NodeLost              | a node of a multi-node set exited, failed its gate or missed its deadline |
| 27   | OutputFailed          | stdout/stderr or a named report file cannot be written         |
| 28   | NodeAddress           | a multi-node set has no routable head or node address, or the network interface is missing |
| 29   | RunDirBusy            | another live set holds the multi-node run folder               |
| 31   | AgenticClientError    | AIPerf (the agentic client) is missing, not the pinned version, failed, or left no valid export |
| 32   | KvOffloadError        | the KV-offload tier failed: LMCache not the pinned version, a server not healthy by its deadline |
| 34   | UnsafeState           | a state folder is a symlink, not a folder, or another user's   |
| 35   | FileNameEncoding      | a patch path this locale's file-system encoding cannot name    |
| 37   | WaiverIncomplete      | `series waiver`: a series entry lacks why, upstream or drop-when |
| 40   | AgenticTraceError     | `aiperf synthesize agentic-code` failed, or its trace (fresh or cached) is not a valid Mooncake trace |
| 70   | InternalError         | a bug in m3patch (traceback in the crash log)                  |
| 130  | Interrupted           | SIGINT/SIGTERM (SIGHUP/SIGQUIT where not ignored)             |
| 141  | -                     | stdout closed by its reader (errors_handler: 128 + SIGPIPE)    |
"""

from __future__ import annotations

import time


class M3PatchError(Exception):
    """Root of every expected failure; carries its own exit code."""

    exit_code = 1

    def __init__(self, message: str, *, hint: str | None = None, annotated: bool = False) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint
        # True when each problem was already printed as its own GitHub `::error file=,line=`
        # annotation: the handler then adds no second, flattened one for the whole message.
        self.annotated = annotated

    def __str__(self) -> str:
        if self.hint:
            return f"{self.message}\n  fix: {self.hint}"
        return self.message


class UsageError(M3PatchError):
    exit_code = 2


class VllmNotFound(M3PatchError):
    exit_code = 3


class VersionMismatch(M3PatchError):
    exit_code = 4


class PatchConflict(M3PatchError):
    exit_code = 5


class VerifyFailed(M3PatchError):
    exit_code = 6


class TreeIOError(M3PatchError):
    exit_code = 7


class LockTimeout(M3PatchError):
    exit_code = 8


class HostilePatch(M3PatchError):
    exit_code = 9


class ServerExited(M3PatchError):
    exit_code = 10


class ReadyTimeout(M3PatchError):
    exit_code = 11


class MarkerMissing(M3PatchError):
    exit_code = 12


class MarkerForbidden(M3PatchError):
    exit_code = 13


class BenchFailed(M3PatchError):
    exit_code = 14


class RunDeadline(M3PatchError):
    exit_code = 15


class ChangelogInvalid(M3PatchError):
    exit_code = 16


class ResultsInvalid(M3PatchError):
    exit_code = 17


class ServerDied(M3PatchError):
    exit_code = 18


class ModelMissing(M3PatchError):
    exit_code = 19


class EvalFailed(M3PatchError):
    exit_code = 20


class EvalError(M3PatchError):
    exit_code = 21


class PortConflict(M3PatchError):
    exit_code = 22


class MarkerUnprintable(M3PatchError):
    exit_code = 23


class LaunchRejected(M3PatchError):
    """The target vLLM's own argument parser (or its list of environment variables) refuses
    the launch a recipe renders, or that check could not run; raised before the tree or a node
    is touched."""

    exit_code = 24


class NodeMismatch(M3PatchError):
    exit_code = 25


class NodeLost(M3PatchError):
    exit_code = 26


class NodeAddress(M3PatchError):
    """A multi-node set has no routable address to bind or reach: no head address, a head name
    that does not resolve, loopback where nodes live on separate hosts, or a network interface
    that is not there. Refused before any server starts; never a fallback to 127.0.0.1."""

    exit_code = 28


class RunDirBusy(M3PatchError):
    """Another set, still alive (fresh heartbeat), holds the run folder: two sets in one folder
    would overwrite each other's logs and results."""

    exit_code = 29


class OutputFailed(M3PatchError):
    """stdout (or stderr) refused a write: a full device, a quota, an I/O error, a stdout closed
    before the start; or a report file the user named (`--json-file`, `--out`) cannot be
    written. The command's work stands; only its report was lost."""

    exit_code = 27


class AgenticClientError(M3PatchError):
    """The agentic-coding client (AIPerf, in its own venv) cannot run or measured nothing valid:
    not installed, not the pinned version, exited non-zero, or its export misses a field."""

    exit_code = 31


class AgenticTraceError(M3PatchError):
    """The agentic trace a recipe synthesizes cannot be made: the manifest is unreadable, AIPerf's
    `synthesize agentic-code` failed or overran, or what it wrote is not a valid Mooncake trace."""

    exit_code = 40


class KvOffloadError(M3PatchError):
    """The recipe's KV-offload tier cannot serve: LMCache is not installed at the pinned version,
    or one of its per-rank servers exited or missed its health deadline."""

    exit_code = 32


class UnsafeState(M3PatchError):
    """A folder m3patch keeps state in (a run folder, a cache) is a symlink, not a folder, or
    owned by another user: nothing is written through it."""

    exit_code = 34


class FileNameEncoding(M3PatchError):
    """A patch (or ledger, journal) path this process cannot hand to the file system: its
    file-system encoding (an ASCII locale with UTF-8 mode off) has no bytes for a character of
    the name. Refused before anything is read or written, so no command acts on half a series."""

    exit_code = 35


class WaiverIncomplete(M3PatchError):
    """An InferenceX patch waiver cannot be written: a series entry states no why, upstream or
    drop-when (the waiver's reason, links and removal plan)."""

    exit_code = 37


class Interrupted(M3PatchError):
    exit_code = 130


_pending_interrupts: list[Interrupted] = []
_deferring: set[object] = set()  # split batches running (folder_shares): their threads end first
_deferred: list[BaseException] = []
_stopping: list[float] = []  # when this command last raised a stop (time.monotonic)
STOP_BURST_S = 0.5  # stops this close to a raised one arrived with it (pending at once)


def interrupt(error: Interrupted) -> None:
    """A stop signal's Interrupted, kept and raised (see `stop`): a broad `except M3PatchError`
    around a best-effort step (a memo read) may swallow the raise, and `raise_if_interrupted` in
    every wait raises it again, so a stop request is never lost in a wait that would not end."""
    _pending_interrupts.append(error)
    stop(error)


def stop(error: BaseException) -> None:
    """A stop signal handler's last act: raise `error`; while a batch is split over threads,
    keep it instead (the batch raises it once every thread has ended). A stop within
    STOP_BURST_S of one raised is only kept: signals sent together (a terminal's Ctrl-C and a
    runner's SIGTERM) are all pending at once, and CPython runs each handler at its next check,
    so the second would raise inside the first one's unwinding (its error report, a batch's
    stop handling). A later one (a user's second Ctrl-C, after the first was swallowed or is
    stuck in a library's cleanup) raises again."""
    now = time.monotonic()
    if _stopping and now - _stopping[-1] < STOP_BURST_S:
        return  # even inside a batch: it must not be raised again in the first one's unwinding
    if _deferring:
        _deferred.append(error)
        return
    _stopping[:] = [now]
    raise error


def raise_kept(error: BaseException) -> None:
    """Raise a stop a split batch kept, as `stop` raises one."""
    _stopping[:] = [time.monotonic()]
    raise error


def on_sigint(signum: int, frame: object) -> None:
    """SIGINT as Python's own handler (KeyboardInterrupt), under `stop`'s rules; kept as an
    Interrupted too, so a best-effort step that swallows the raise does not lose it."""
    _pending_interrupts.append(Interrupted("interrupted (SIGINT)", hint="re-run the same command"))
    stop(KeyboardInterrupt())


def stop_requested() -> bool:
    """A stop signal arrived while a split batch runs: its shares end after their current item."""
    return bool(_deferred)


def defer_stops(batch: object) -> None:
    _deferring.add(batch)


def end_deferring(batch: object) -> BaseException | None:
    """The first stop kept while batches were split (an inner batch raises it too, so that the
    outer one ends); forgotten once the last batch has ended. Safe for a batch that never began
    deferring."""
    _deferring.discard(batch)
    if not _deferred:
        return None
    first = _deferred[0]
    if not _deferring:
        _deferred.clear()
        _stopping[:] = [time.monotonic()]  # raised now: a stop right behind it is part of it
    return first


def raise_if_interrupted() -> None:
    if _pending_interrupts:
        raise _pending_interrupts[0]  # the first stop, as `stop` raises it


def forget_interrupts() -> None:
    """A new command starts with no stop request of an earlier one in the same process (tests
    and callers that run `main` more than once)."""
    _pending_interrupts.clear()
    _deferred.clear()
    _stopping.clear()


INTERNAL_ERROR_EXIT = 70

ALL_ERRORS: tuple[type[M3PatchError], ...] = (
    UsageError, VllmNotFound, VersionMismatch, PatchConflict, VerifyFailed, TreeIOError,
    LockTimeout, HostilePatch, ServerExited, ReadyTimeout, MarkerMissing, MarkerForbidden,
    BenchFailed, RunDeadline, ChangelogInvalid, ResultsInvalid, ServerDied, ModelMissing,
    EvalFailed, EvalError, PortConflict, MarkerUnprintable, LaunchRejected, NodeMismatch,
    NodeLost, NodeAddress, RunDirBusy, OutputFailed, UnsafeState, FileNameEncoding,
    WaiverIncomplete, Interrupted, AgenticClientError, KvOffloadError, AgenticTraceError,
)
