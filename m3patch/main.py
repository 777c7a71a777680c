"""CLI entry: `m3patch COMMAND ...`.

The command table maps names to modules imported only when that command runs, so
`m3patch --version` imports nothing heavy (pip's `commands_dict` shape). Each command module
exposes `add_arguments(parser)` and `run(args) -> int`; expected failures are raised as
M3PatchError and turned into one message and a unique exit code here and nowhere else.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import io
import os
import re
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NamedTuple, NoReturn

from m3patch import __version__

if TYPE_CHECKING:
    from _typeshed import SupportsWrite

OUTPUT_FAILED_EXIT = 27  # errors.OutputFailed, without importing the errors module for --version
CLOSED_PIPE_EXIT = 141  # 128 + SIGPIPE, as errors_handler gives it


class ClosedStdout(io.TextIOBase):
    """sys.stdout when descriptor 1 was closed before m3patch started (`m3patch status >&-`):
    Python leaves sys.stdout None, and print() to None writes nothing, so the report would be
    lost behind exit 0 (and rich fails on None). Every write fails as one to a closed
    descriptor does (EBADF), which the error handler reports as OutputFailed."""

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        raise OSError(errno.EBADF, "stdout is closed")

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return 1  # /dev/null by now (_guard_standard_streams)


def _guard_standard_streams() -> None:
    """Descriptors 0-2 that were closed at start get /dev/null: otherwise the next file m3patch
    opens (a ledger, a lock, a log) takes number 1 or 2, and a print or a child's output would
    land in it. A closed stdout then fails each write (ClosedStdout); a closed stderr only
    loses m3patch's messages, as with any tool."""
    closed = []
    for fd in (0, 1, 2):
        try:
            os.fstat(fd)
        except OSError:
            closed.append(fd)
            null = os.open(os.devnull, os.O_RDWR)  # the lowest free number: fd itself
            if null != fd:
                os.dup2(null, fd)
                os.close(null)
    # only for a closed descriptor: a program that calls main() with sys.stdout set to None
    # (contextlib.redirect_stdout(None)) asked for silence
    if 1 in closed and sys.stdout is None:
        sys.stdout = ClosedStdout()
    if 2 in closed and sys.stderr is None:
        sys.stderr = open(os.devnull, "w", encoding="utf-8")  # noqa: SIM115  # for the process's life


class Command(NamedTuple):
    module: str
    help: str
    read_only: bool = False  # writes nothing at all, not even to m3patch's memos


COMMANDS: dict[str, Command] = {
    "locate": Command("m3patch.commands.locate", "show the vLLM tree an interpreter would import", read_only=True),
    "apply": Command("m3patch.commands.apply", "apply the patch series (atomic, idempotent)"),
    "verify": Command("m3patch.commands.verify", "check the tree equals the pinned post-images", read_only=True),
    "status": Command("m3patch.commands.status", "per-patch, per-file, per-hunk state", read_only=True),
    "revert": Command("m3patch.commands.revert", "restore the exact pinned pre-images"),
    "series": Command("m3patch.commands.series", "maintain a series (lock pins, show, port)"),
    "recipe": Command("m3patch.commands.recipe", "validate or show recipes"),
    "model": Command("m3patch.commands.model", "check or fetch a recipe's model files (HF cache)"),
    "serve": Command("m3patch.commands.serve", "apply, verify, then run vllm serve with a marker gate"),
    "markers": Command("m3patch.commands.markers", "check a saved server log against markers; lint markers"),
    "bench": Command("m3patch.commands.bench", "concurrency sweep with vllm bench serve; compare"),
    "eval": Command("m3patch.commands.eval", "accuracy gate: lm-eval against a running server"),
    "matrix": Command("m3patch.commands.matrix", "emit the CI job matrix for recipes"),
    "changelog": Command("m3patch.commands.changelog", "validate perf-changelog.yaml"),
    "ci": Command("m3patch.commands.ci", "one CI job: apply, verify, serve, sweep, results"),
    "tune": Command("m3patch.commands.tune", "tune vLLM's fused-MoE Triton kernel on this GPU"),
}


class _Parser(argparse.ArgumentParser):
    """argparse's own printing swallows a write that fails: `--help` to a closed stdout or a
    full device exited 0 with the help lost. Here such a write fails as every output does
    (OutputFailed, 27; a reader that left: 141)."""

    def _print_message(self, message: str, file: SupportsWrite[str] | None = None) -> None:
        if message:
            stream = file or sys.stderr
            stream.write(message)
            flush = getattr(stream, "flush", None)
            if flush is not None:
                flush()

    def error(self, message: str) -> NoReturn:
        super().error(_usage_message(self, message))


_UNRECOGNIZED = re.compile(r"unrecognized arguments: (.*)")
_INVALID_CHOICE = re.compile(r"invalid choice: '(.*)' (\(choose from (.*)\))$")


def _usage_message(parser: argparse.ArgumentParser, message: str) -> str:
    """argparse's message, a long list of choices cut to its count, then the nearest one."""
    hint = _suggestion(parser, message)
    choice = _INVALID_CHOICE.search(message)
    if choice and len(listed := re.findall(r"'([^']*)'", choice.group(3))) > _CHOICES_SHOWN:
        message = (message[:choice.start(2)] + f"(one of {len(listed)}: "
                   f"`{parser.prog} --help` lists them)")
    return f"{message}.{hint}" if hint else message


def _options(parser: argparse.ArgumentParser) -> set[str]:
    """Its option strings and its actions' (`series list --jsn` is refused by `series`, which
    holds `list`'s options only through its subparser)."""
    found = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= _options(sub)
    return found


_CHOICES_SHOWN = 16  # the command names, every one


def _suggestion(parser: argparse.ArgumentParser, message: str) -> str:
    """The nearest option or choice to what argparse refused, as schema errors name it; '' when
    nothing is near (argparse itself names neither)."""
    from m3patch.schema import suggest

    unknown = _UNRECOGNIZED.search(message)
    if unknown:
        options = [o for o in _options(parser) if o.startswith("--")]
        flags = [arg.split("=", 1)[0] for arg in unknown.group(1).split()
                 if arg.startswith("--")]
        return "".join(suggest(flag, options) for flag in flags[:1])
    choice = _INVALID_CHOICE.search(message)
    if choice:
        return suggest(choice.group(1), re.findall(r"'([^']*)'", choice.group(3)))
    return ""


def _top_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="m3patch",
        description="Patch-and-launch toolkit for pinned vLLM images.",
        epilog="Exit codes: docs/exit-codes.md. `m3patch COMMAND --help` for a command.",
        allow_abbrev=False,
    )
    parser.add_argument("--version", action="version", version=f"m3patch {__version__}")
    parser.add_argument(
        "--debug-traceback", action="store_true",
        help="print tracebacks for expected errors too (or M3PATCH_DEBUG_TRACEBACK=1)",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, cmd in COMMANDS.items():
        sub.add_parser(name, help=cmd.help, add_help=False)
    return parser


def _split(argv: list[str]) -> tuple[list[str], str | None, list[str]]:
    """Split global options, the command name and the command's own arguments."""
    for index, arg in enumerate(argv):
        if not arg.startswith("-"):
            return argv[:index], arg, argv[index + 1 :]
    return argv, None, []


class _JsonUsageParser(_Parser):
    """Under --json a command-line error is the JSON object too (a usage error, exit 2), so a
    script reading stdout gets an object, never a bare usage text."""

    def error(self, message: str) -> NoReturn:
        from m3patch.errors import UsageError
        from m3patch.patching import report_json

        report_json.start(self.prog.removeprefix("m3patch "))
        msg = f"{self.prog}: {_usage_message(self, message)}"
        raise UsageError(msg, hint=f"{self.prog} --help")


def _own_sigint() -> Callable[[], None]:
    """Ctrl-C raises KeyboardInterrupt as before, under errors.stop's rules (kept while a batch
    is split over threads; a second one during the first's unwinding only returns); a SIGINT
    that is ignored (a background job, nohup) stays ignored. Returns what puts Python's back."""
    import signal
    import threading

    from m3patch.errors import on_sigint

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGINT) is not signal.default_int_handler:
        return lambda: None
    signal.signal(signal.SIGINT, on_sigint)

    def restore() -> None:
        if signal.getsignal(signal.SIGINT) is on_sigint:  # not one the command set since
            signal.signal(signal.SIGINT, signal.default_int_handler)

    return restore


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    _guard_standard_streams()
    if args == ["--version"]:  # before importing the error handler (dataclasses, traceback)
        try:
            print(f"m3patch {__version__}", flush=True)
        except OSError as exc:
            return _output_failed(exc)
        return 0
    global_args, name, rest = _split(args)
    top = _top_parser()
    try:
        ns = top.parse_args(global_args)
        if name is None:
            top.print_help(sys.stderr)
            return 2
        if name not in COMMANDS:
            top.parse_args([*global_args, name])  # argparse prints "invalid choice" and exits 2
            return 2
    except OSError as exc:  # the top-level help or usage to a stream that refused it
        return _output_failed(exc)
    restore_sigint = _own_sigint()
    try:
        return _run(name, rest, ns.debug_traceback)
    finally:
        if argv is not None:  # a program calling main(argv) gets Python's handler back; the
            restore_sigint()  # command line keeps m3patch's until exit (a late Ctrl-C is quiet)


def _output_failed(exc: OSError) -> int:
    """Before the error handler exists (`--version`, the top-level help): a reader that left is
    141, as a tool killed by SIGPIPE reports; any other refused write is OutputFailed."""
    with contextlib.suppress(OSError, ValueError):  # the final flush must not fail again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    if isinstance(exc, BrokenPipeError):
        return CLOSED_PIPE_EXIT
    with contextlib.suppress(OSError):
        sys.stderr.write(f"m3patch: error: cannot write the output: {exc.strerror or exc}\n")
    return OUTPUT_FAILED_EXIT


def _run(name: str, rest: list[str], debug: bool) -> int:
    from m3patch.errors_handler import handle_errors  # after the --version fast path

    with handle_errors(debug=debug) as outcome:
        from m3patch.patching import memo
        from m3patch.tool_env import check_environment

        check_environment(os.environ)
        memo.start_command(COMMANDS[name].read_only)
        module = importlib.import_module(COMMANDS[name].module)
        parser_class = _JsonUsageParser if "--json" in rest else _Parser
        parser = parser_class(
            prog=f"m3patch {name}", description=COMMANDS[name].help, allow_abbrev=False
        )
        module.add_arguments(parser)
        cmd_args = parser.parse_args(rest)
        outcome.code = int(module.run(cmd_args))
    return outcome.code


if __name__ == "__main__":
    raise SystemExit(main())


_STOP_SIGNALS = ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT")


def run() -> NoReturn:
    """The `m3patch` program (console script and `python -m m3patch`): main, then exit with its
    code. Once main has returned, the exit code is decided; a stop signal arriving after it (a
    second one sent with the first, landing while the interpreter shuts down and has put the
    default handlers back) would otherwise kill the process with that signal's status instead.
    So stop signals are blocked for the exit; an in-process caller of main() keeps its own."""
    code = main()
    import signal

    with contextlib.suppress(ValueError, OSError):  # ValueError: not the main thread
        signal.pthread_sigmask(signal.SIG_BLOCK, [getattr(signal, s) for s in _STOP_SIGNALS])
    raise SystemExit(code)
