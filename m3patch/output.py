"""The one place that talks to the terminal. rich is imported lazily: `--version` stays fast."""

from __future__ import annotations

import errno
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


def _console(**options: Any) -> Console:
    # deferred: rich: loaded only when something is printed (keeps --version fast)
    from rich.console import Console

    class PipeAware(Console):
        def on_broken_pipe(self) -> None:
            # rich's own exits 1 with no word; the error handler gives a closed pipe 141
            self.quiet = True
            raise BrokenPipeError(errno.EPIPE, "the reader of the output left")

    return PipeAware(highlight=False, soft_wrap=True, **options)


@cache
def console() -> Console:
    return _console(stderr=True)


@cache
def stdout_console() -> Console:
    # Logs and pipes get rich's 80-column default, which truncates table cells; CI logs are wide.
    return _console(width=None if sys.stdout.isatty() else 160)


# C0 controls but newline and tab, DEL, C1 controls, and surrogates (lone ones come from JSON's
# "\ud800" or a file name's undecodable byte)
_UNPRINTABLE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")


def printable(text: str) -> str:
    """`text` as a terminal may show it: a control character as a Python escape (ESC or CSI
    from a state or results file would start a terminal sequence: recolour, retitle, clear),
    a lone surrogate too (UTF-8 has no bytes for it: a strict stdout fails on it); one of
    U+DC80-U+DCFF, a file name's undecodable byte, as that byte (\\xff)."""
    return _UNPRINTABLE.sub(_escape, text)


def _escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if 0xDC80 <= code <= 0xDCFF:
        return f"\\x{code - 0xDC00:02x}"
    return match.group().encode("unicode_escape").decode("ascii")


def show(text: str) -> None:
    """A line of a command's own output on stdout, escaped as `printable` (it may carry a
    recipe's or a series' names and paths)."""
    print(printable(text), flush=True)


def info(message: str) -> None:
    print(f"m3patch: {printable(message)}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"m3patch: warning: {printable(message)}", file=sys.stderr, flush=True)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a table to stdout: rich's boxed table on a terminal, plain text otherwise.

    Pipes, files and CI logs get `plain_table`: no box drawing, no cell cut or wrapped, so the
    output can be grepped and its values copied as they are.
    """
    title = printable(title)
    cells = [[printable(str(cell)) for cell in row] for row in rows]
    if not sys.stdout.isatty():
        sys.stdout.write(plain_table(title, columns, cells))
        sys.stdout.flush()
        return
    # deferred: rich: loaded only when something is printed (keeps --version fast)
    from rich.markup import escape
    from rich.table import Table

    tab = Table(title=escape(title), show_lines=False)
    for col in columns:
        tab.add_column(col)
    for row in cells:  # escaped: log text such as "m3patch[provenance]" is not rich markup
        tab.add_row(*(escape(cell) for cell in row))
    stdout_console().print(tab)


def plain_table(title: str, columns: list[str], rows: list[list[str]]) -> str:
    """Title, header, a dashed rule and the rows, columns padded to their widest value."""
    widths = [max(len(value) for value in column) for column in zip(columns, *rows, strict=True)]

    def line(values: list[str]) -> str:  # the last value is not padded: no trailing blanks added
        padded = [value.ljust(width) for value, width in zip(values[:-1], widths, strict=False)]
        return "  ".join([*padded, values[-1]]) if values else ""

    body = [line(columns), line(["-" * width for width in widths]), *(line(r) for r in rows)]
    return "\n".join([title, *body]) + "\n"


@contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[str], None]]:
    """A progress bar on stderr; yields `advance(label)`, called after each finished step.

    Not a terminal (CI logs): one plain line per step instead of redraws.
    """
    if not console().is_terminal:
        done = [0]

        def advance_plain(label: str) -> None:
            done[0] += 1
            info(f"{description} {done[0]}/{total}: {label}")

        yield advance_plain
        return
    # deferred: rich: loaded only when something is printed (keeps --version fast)
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn(), TextColumn("{task.fields[label]}"))
    with Progress(*columns, console=console()) as bar:
        task = bar.add_task(description, total=total, label="")

        def advance(label: str) -> None:
            bar.update(task, advance=1, label=label)

        yield advance
