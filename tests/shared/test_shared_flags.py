"""One spelling per meaning across every command: `--json` alone is the report on stdout,
`--json-file FILE` writes it, and the interpreter a command runs is `--python PATH`; the older
spellings (`--json FILE`, `--lm-eval-python`, `--spec-python`, `--check-json`) stay as aliases."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Iterator

import pytest

from m3patch.commands.flags import STDOUT
from m3patch.main import COMMANDS


def parsers() -> Iterator[tuple[str, argparse.ArgumentParser]]:
    for name, command in COMMANDS.items():
        parser = argparse.ArgumentParser(prog=f"m3patch {name}")
        importlib.import_module(command.module).add_arguments(parser)
        yield name, parser
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub_name, sub in action.choices.items():
                    yield f"{name} {sub_name}", sub


def options(parser: argparse.ArgumentParser) -> Iterator[argparse.Action]:
    yield from (a for a in parser._actions if a.option_strings)


def test_json_alone_means_stdout_everywhere() -> None:
    seen = []
    for name, parser in parsers():
        for action in options(parser):
            if "--json" in action.option_strings:
                seen.append(name)
                assert action.const == STDOUT or action.const is True, name
            assert not any(o.startswith("--json-") and o != "--json-file"
                           for o in action.option_strings), (name, action.option_strings)
    assert {"apply", "status", "bench", "changelog check", "ci", "serve"} <= set(seen)


def test_the_interpreter_is_python_path_everywhere() -> None:
    aliases = {"--lm-eval-python", "--spec-python"}
    seen = []
    for name, parser in parsers():
        for action in options(parser):
            if any("python" in o for o in action.option_strings):
                seen.append(name)
                assert "--python" in action.option_strings, (name, action.option_strings)
                assert set(action.option_strings) - {"--python"} <= aliases, name
                assert action.metavar == "PATH", name
    assert {"apply", "serve", "bench", "eval", "recipe show", "series list"} <= set(seen)


@pytest.mark.parametrize(("command", "argv", "dest", "value"), [
    ("eval", ["cpu_tiny_moe", "--lm-eval-python", "/x/python"], "python", "/x/python"),
    ("tune", ["--check-json", "c.json"], "check_json", "c.json"),
    ("tune", ["--json-file", "c.json"], "check_json", "c.json"),
])
def test_older_spellings_still_work(command: str, argv: list[str], dest: str, value: str) -> None:
    parser = dict(parsers())[command]
    assert str(getattr(parser.parse_args(argv), dest)) == value
