"""The one place that talks to the terminal. rich is imported lazily: `--version` stays fast."""

from __future__ import annotations

import sys
from functools import cache
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rich.console import Console


@cache
def console() -> Console:
    from rich.console import Console

    return Console(stderr=True, highlight=False, soft_wrap=True)


@cache
def stdout_console() -> Console:
    from rich.console import Console

    return Console(highlight=False, soft_wrap=True)


def info(message: str) -> None:
    print(f"m3patch: {message}", file=sys.stderr, flush=True)


def warn(message: str) -> None:
    print(f"m3patch: warning: {message}", file=sys.stderr, flush=True)


def table(title: str, columns: list[str], rows: list[list[Any]]) -> None:
    """Print a table to stdout (plain text when stdout is not a terminal)."""
    from rich.table import Table

    tab = Table(title=title, show_lines=False)
    for col in columns:
        tab.add_column(col)
    for row in rows:
        tab.add_row(*(str(cell) for cell in row))
    stdout_console().print(tab)
