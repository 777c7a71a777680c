"""Options shared by the tree commands (locate, apply, verify, status, revert, series)."""

from __future__ import annotations

import argparse
import io
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType

from m3patch.commands.flags import add_python_flag
from m3patch.errors import Interrupted, UsageError, forget_interrupts, interrupt
from m3patch.output import printable
from m3patch.patching.locate import VllmTree, find_vllm
from m3patch.patching.series import (
    ENV_SERIES,
    Series,
    find_series_dir,
    load_series,
    series_path,
)
from m3patch.tool_env import SHOWN_CHARS, shown


def add_tree_options(parser: argparse.ArgumentParser) -> None:
    add_python_flag(parser, what="interpreter whose vllm to patch (default: this one)")
    parser.add_argument("--vllm-root", metavar="DIR",
                        help="tree root containing vllm/ (or the vllm dir); env M3PATCH_VLLM_ROOT")


def add_series_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--series", metavar="NAME|DIR", type=series_path,
                        help="a series name as `series list` prints it (vllm-0.33.0) or a folder "
                             "with series.yaml (default: $M3PATCH_SERIES, else the series for "
                             "the installed vLLM version)")


def tree_from(args: argparse.Namespace) -> VllmTree:
    return find_vllm(args.python, args.vllm_root)


def series_dir(args: argparse.Namespace, tree: VllmTree | None) -> Path:
    """--series, else the default lookup for the tree's vLLM version (patching.series)."""
    try:
        return find_series_dir(args.series, None if tree is None else tree.version)
    except UsageError as exc:
        value = os.environ.get(ENV_SERIES)
        if args.series is not None or not value:
            raise
        # the value was never typed on this command line: say which variable gave it
        inner, hint = exc.message, exc.hint or ""
        if len(value) > SHOWN_CHARS:  # said once, cut: not a 100 kB value three times over
            inner, hint = inner.replace(value, "that value"), hint.replace(value, "that value")
        msg = f"{ENV_SERIES}={shown(value)} (from the environment): {inner}"
        raise UsageError(msg, hint=f"unset {ENV_SERIES}, or {hint}") from None


def tree_and_series(args: argparse.Namespace) -> tuple[VllmTree, Series]:
    tree = tree_from(args)
    return tree, load_series(series_dir(args, tree))


def add_tree_and_series_options(parser: argparse.ArgumentParser) -> None:
    add_tree_options(parser)
    add_series_option(parser)


def start_tree_command(args: argparse.Namespace) -> tuple[VllmTree, Series]:
    """What every command on a tree and its series does first: the process set-up, then both."""
    prepare_process()
    return tree_and_series(args)


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    from m3patch.patching import memo

    msg = f"received signal {signal.Signals(signum).name}"
    if memo.writes_allowed():
        hint = ("re-run the same command; the next apply or revert completes or rolls back an "
                "interrupted transaction")
    else:  # locate, status, verify: nothing was begun that a later run must finish
        msg, hint = msg + " (this command writes nothing)", "re-run the same command"
    interrupt(Interrupted(msg, hint=hint))


def prepare_process() -> None:
    """SIGTERM (and SIGHUP, SIGQUIT) unwinds like Ctrl-C (exit 130, as documented; the tree lock is released and a
    transaction left half-done is finished or undone by the next run), and text the locale
    cannot encode (LANG=C: ASCII) is escaped instead of ending in an internal error."""
    forget_interrupts()
    if threading.current_thread() is threading.main_thread():  # signal() works only there
        signal.signal(signal.SIGTERM, _on_sigterm)
        # a closed terminal or Ctrl-\ during a lock wait ends the same way (130, the JSON
        # object under --json); a SIGHUP that nohup ignores stays ignored
        for hangup in (signal.SIGHUP, signal.SIGQUIT):
            if signal.getsignal(hangup) is not signal.SIG_IGN:
                signal.signal(hangup, _on_sigterm)
    for stream in (sys.stdout, sys.stderr):
        if isinstance(stream, io.TextIOWrapper) and "utf" not in stream.encoding.lower():
            stream.reconfigure(errors="backslashreplace")


def say(line: str) -> None:
    print(printable(line), flush=True)


def err(line: str) -> None:
    print(printable(line), file=sys.stderr, flush=True)
