"""One spelling per meaning across every command: `--json` alone is the report on stdout,
`--json-file FILE` writes it, and the interpreter a command runs is `--python PATH`; the older
spellings (`--json FILE`, `--lm-eval-python`, `--spec-python`, `--check-json`) stay as aliases."""

from __future__ import annotations

import argparse
import importlib
import re
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from m3patch.commands.flags import STDOUT
from m3patch.errors import OutputFailed
from m3patch.main import COMMANDS, main

PROJECT = Path(__file__).resolve().parents[2]
RUNS = PROJECT / "tests" / "data" / "bench" / "runs"


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
    # every command that launches a server takes the launch interpreter (before: ci had none)
    assert {"serve", "bench", "ci"} <= set(seen)


@pytest.mark.parametrize(("command", "argv", "dest", "value"), [
    ("eval", ["cpu_tiny_moe", "--lm-eval-python", "/x/python"], "python", "/x/python"),
    ("tune", ["--check-json", "c.json"], "check_json", "c.json"),
    ("tune", ["--json-file", "c.json"], "check_json", "c.json"),
])
def test_older_spellings_still_work(command: str, argv: list[str], dest: str, value: str) -> None:
    parser = dict(parsers())[command]
    assert str(getattr(parser.parse_args(argv), dest)) == value


def _report_commands(tmp_path: Path) -> dict[str, tuple[list[str], str]]:
    """Every command that writes a report or output file the user names: argv, and the flag,
    each naming FILE (replaced by the unwritable path)."""
    run = shutil.copytree(RUNS / "base", tmp_path / "run")
    recipe = tmp_path / "cpu_tiny_moe.yaml"
    text = (PROJECT / "recipes" / "cpu_tiny_moe.yaml").read_text()
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 0.8", text)
    text = re.sub(r"concurrency: \[[0-9, ]+\]", "concurrency: [1, 2, 4]", text)
    text = re.sub(r"osl: [0-9]+", "osl: 16", text)  # the recorded run's shape
    recipe.write_text(text.replace("series: ../patches", f"series: {PROJECT}/patches"))
    return {
        "bench": (["bench", str(recipe), "--resume", "--run-dir", str(run), "--no-plots",
                   "--json-file", "FILE"], "--json-file"),
        "bench compare": (["bench", "compare", str(RUNS / "base"), str(RUNS / "base"),
                           "--json-file", "FILE"], "--json-file"),
        "changelog check": (["changelog", "check", "--file",
                             str(PROJECT / "perf-changelog.yaml"), "--json-file", "FILE"],
                            "--json-file"),
        "series waiver": (["series", "waiver", "--pr", "1", "--out", "FILE"], "--out"),
        "serve --write-sbatch": (["serve", "mi300x_ep16_2node", "--run-dir", str(tmp_path / "r"),
                                  "--write-sbatch", "FILE"], "--write-sbatch"),
    }


@pytest.mark.parametrize("command", ["bench", "bench compare", "changelog check",
                                     "series waiver", "serve --write-sbatch"])
def test_an_unwritable_report_file_is_output_failed_in_every_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str) -> None:
    """Before: 17 from bench, 7 from changelog check and series waiver, each its own code for
    the same failure. A file stands where the report's folder should be (root writes through a
    read-only folder, not through a file)."""
    (tmp_path / "blocker").write_text("")
    target = tmp_path / "blocker" / "sub" / "report.out"
    argv, flag = _report_commands(tmp_path)[command]
    code = main([str(target) if a == "FILE" else a for a in argv])
    err = capsys.readouterr().err
    assert code == OutputFailed.exit_code == 27, err
    assert f"cannot write {target}, the file {flag} names" in err and "fix:" in err


@pytest.mark.parametrize(("argv", "said"), [
    (["apply", "--dry-rn"], "unrecognized arguments: --dry-rn. Perhaps you meant '--dry-run'?"),
    (["aply"], "invalid choice: 'aply' (choose from 'locate', "),
    (["aply"], "'tune'). Perhaps you meant 'apply'?"),
    (["changelog", "chek"], "Perhaps you meant 'check'?"),
    (["series", "list", "--pythn"], "--pythn. Perhaps you meant '--python'?"),
    (["bench", "results", "--metric", "p99_tpto"],
     "invalid choice: 'p99_tpto' (one of 44: `m3patch bench --help` lists them). "
     "Perhaps you meant 'p99_tpot'?"),
])
def test_a_refused_flag_or_choice_names_the_nearest(
        argv: list[str], said: str, capsys: pytest.CaptureFixture[str]) -> None:
    """argparse names neither; the schema's errors do, and a command line should too. A long
    list of choices is cut to its count (the unknown changelog key printed some 45 names)."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_nothing_near_adds_nothing(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["apply", "--zzzzz"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --zzzzz")


def test_under_json_the_usage_error_names_the_nearest_too(
        capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["apply", "--json", "--dry-rn"]) == 2
    assert "Perhaps you meant '--dry-run'?" in capsys.readouterr().out
