"""Turn exceptions into one message and an exit code (pre-commit's error_handler shape)."""

from __future__ import annotations

import errno
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from m3patch import __version__
from m3patch.errors import (
    INTERNAL_ERROR_EXIT,
    M3PatchError,
    OutputFailed,
    forget_interrupts,
    raise_if_interrupted,
)
from m3patch.output import printable

CLOSED_PIPE_EXIT = 141  # 128 + SIGPIPE: what a tool killed by SIGPIPE reports (`| head`)
# errno of a write to a stream that cannot take it (stdout to /dev/full, a full disk or quota,
# a stdout closed before the start: main.ClosedStdout)
OUTPUT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO, errno.EBADF})


def is_output_error(exc: BaseException) -> bool:
    """An OSError from writing stdout/stderr, not from a file: every file m3patch touches goes
    through fsio or the writer, which name the path (and turn errors into their own codes), so
    an unnamed ENOSPC/EIO that reaches the handler is the output stream's."""
    return (isinstance(exc, OSError) and exc.errno in OUTPUT_ERRNOS
            and exc.filename is None and exc.filename2 is None)


def _silence_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush cannot fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


@dataclass
class Outcome:
    code: int = 0


# The --json object of the running command (m3patch.patching.report_json), printed on stdout
# with the error when the command fails, so a machine reader never gets an empty stdout.
_json_report: dict[str, Any] | None = None


def report_json_on_error(fields: dict[str, Any] | None) -> None:
    """Register (or, with None, drop) the object an error is to be reported in on stdout."""
    global _json_report  # one command per process; handle_errors resets it per run
    _json_report = fields


def _emit_json(code: int, kind: str, message: str, hint: str | None) -> None:
    if _json_report is None:
        return
    report = {**_json_report, "exit_code": code, "ok": False,
              "error": {"type": kind, "message": message, "hint": hint}}
    try:
        print(json.dumps(report, indent=2), flush=True)
    except (OSError, ValueError):  # stdout closed or full: the stderr message stands alone
        _silence_stdout()


def _emit(message: str, *, annotated: bool = False) -> None:
    message = printable(message)  # values from state or results files: no terminal sequence
    first, *rest = message.splitlines() or [""]
    try:
        if os.environ.get("GITHUB_ACTIONS") == "true" and not annotated:
            flat = message.replace("%", "%25").replace("\r", "%0D").replace("\n", "%0A")
            print(f"::error::{flat}", file=sys.stderr)
        print(f"m3patch: error: {first}", file=sys.stderr)
        for line in rest:
            print(f"  {line}", file=sys.stderr)
        sys.stderr.flush()
    except (OSError, ValueError):  # stderr full or closed too: the exit code is all that is left
        pass


def crash_log_dir() -> Path:
    override = os.environ.get("M3PATCH_CRASH_DIR")
    if override:
        return Path(override)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "m3patch"


def _write_crash_log(exc: BaseException) -> Path | None:
    try:
        directory = crash_log_dir()
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"crash-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        body = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        path.write_text(
            f"m3patch {__version__}\npython {sys.version}\nargv {sys.argv}\n\n{body}",
            encoding="utf-8",
        )
    except OSError:
        return None
    return path


@contextmanager
def handle_errors(*, debug: bool = False) -> Iterator[Outcome]:
    outcome = Outcome()
    report_json_on_error(None)
    debug = debug or os.environ.get("M3PATCH_DEBUG_TRACEBACK") == "1"
    forget_interrupts()
    try:
        yield outcome
        if outcome.code == 0:  # a stop that a best-effort step swallowed is not a success
            raise_if_interrupted()
    except M3PatchError as exc:
        if debug:
            traceback.print_exc()
        _emit(str(exc), annotated=exc.annotated)
        outcome.code = exc.exit_code
        _emit_json(exc.exit_code, type(exc).__name__, exc.message, exc.hint)
    except KeyboardInterrupt:
        _emit("interrupted")
        outcome.code = 130
        _emit_json(130, "Interrupted", "interrupted", None)
    except BrokenPipeError:  # the reader of stdout left (`status --json | head -1`)
        _silence_stdout()
        outcome.code = CLOSED_PIPE_EXIT
    except SystemExit:
        raise
    except OSError as exc:
        if not is_output_error(exc):
            _internal(exc, debug, outcome)
            return
        _silence_stdout()  # the interpreter's final flush would fail again on the same device
        hint = ("give stdout a file or /dev/null (`> out.txt`) instead of closing it"
                if exc.errno == errno.EBADF else
                "free space on the device stdout goes to, or redirect it")
        failed = OutputFailed(f"cannot write the output: {exc.strerror or exc}", hint=hint)
        _emit(str(failed))
        outcome.code = failed.exit_code
    except Exception as exc:
        _internal(exc, debug, outcome)


def _internal(exc: Exception, debug: bool, outcome: Outcome) -> None:
    """A bug: the traceback to a crash log, one line to stderr, exit 70."""
    log = _write_crash_log(exc)
    if debug or log is None:
        traceback.print_exc()
    where = f"; details in {log}" if log else ""
    message = f"internal error: {type(exc).__name__}: {exc}{where} (please report it)"
    _emit(message)
    outcome.code = INTERNAL_ERROR_EXIT
    _emit_json(INTERNAL_ERROR_EXIT, "InternalError", message, None)
