"""The spellings every command shares, defined once so they cannot drift apart.

- `--json`: the command's report as one JSON object on stdout (docs/json-schema.md).
- `--json-file FILE`: the same report written to FILE (stdout keeps the human output).
  `--json FILE` is the older spelling of it where a command once took a FILE after `--json`
  (`bench`, `changelog check`); it still works there and is documented as an alias.
- `--python PATH`: the interpreter the command runs (vLLM's, or for `eval` lm-eval's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

STDOUT = "-"  # `--json` without a FILE


def add_json_flags(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                   report: str, file_alias: bool = False) -> None:
    """`--json` (stdout) and `--json-file FILE`; `file_alias` keeps `--json FILE` working."""
    if file_alias:
        parser.add_argument("--json", nargs="?", const=STDOUT, metavar="FILE",
                            help=f"{report} as one JSON object on stdout (docs/json-schema.md); "
                                 "`--json FILE` is the older spelling of --json-file FILE")
    else:
        parser.add_argument("--json", action="store_const", const=STDOUT,
                            help=f"{report} as one JSON object on stdout (docs/json-schema.md)")
    parser.add_argument("--json-file", type=Path, metavar="FILE",
                        help=f"write {report} as one JSON object to FILE")


def json_stdout(args: argparse.Namespace) -> bool:
    return bool(args.json == STDOUT)


def json_file(args: argparse.Namespace) -> Path | None:
    """The file the report goes to: --json-file, or the older `--json FILE`."""
    if args.json_file is not None:
        return Path(args.json_file)
    if args.json not in (None, STDOUT):
        return Path(args.json)
    return None


def add_python_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *, what: str,
                    aliases: tuple[str, ...] = ()) -> None:
    """`--python PATH`: the interpreter `what` runs in (aliases: older spellings kept)."""
    parser.add_argument("--python", *aliases, metavar="PATH", dest="python", help=what)


def port_number(text: str) -> int:
    """argparse type of a --port: a TCP port, so a typo is refused before a launch is shown or
    started on a port nothing can bind (99999, 0, -5)."""
    try:
        port = int(text)
    except ValueError:
        port = 0
    if not 1 <= port <= 65535:
        msg = f"{text} is not a TCP port (1-65535)"
        raise argparse.ArgumentTypeError(msg)
    return port
