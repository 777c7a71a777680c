"""`bench compare` as a regression gate on hostile or degenerate aggregates: it never passes having
compared nothing, never calls a rounding difference a speedup, never ends in 70, and every JSON it
prints or writes is JSON. Real recorded runs (tests/data/bench/runs), edited per case."""

from __future__ import annotations

import contextlib
import io
import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from m3patch.bench.compare import CHANGE_TOLERANCE_PCT, compare_rows, summary
from m3patch.errors import ResultsInvalid, UsageError
from m3patch.main import main

RUNS = Path(__file__).parents[1] / "data" / "bench" / "runs"


def cli(*args: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(args))
    return code, out.getvalue(), err.getvalue()


def edited(tmp_path: Path, name: str, edit: Any) -> Path:
    """A copy of the recorded base run whose aggregate rows went through `edit`."""
    run = shutil.copytree(RUNS / "base", tmp_path / name)
    data = json.loads((run / "aggregate.json").read_text())
    for row in data["rows"]:
        edit(row)
    (run / "aggregate.json").write_text(json.dumps(data))
    return run


def test_no_overlapping_cell_fails_instead_of_passing(tmp_path: Path) -> None:
    """Before: an empty table and exit 0, so a CI gate passed having checked nothing."""
    other = edited(tmp_path, "other", lambda row: row.update(isl=row["isl"] * 2))
    code, out, err = cli("bench", "compare", str(RUNS / "base"), str(other))
    assert code == ResultsInvalid.exit_code, err
    assert "nothing compared" in err
    code, out, _ = cli("bench", "compare", str(RUNS / "base"), str(other), "--json")
    assert code == ResultsInvalid.exit_code
    assert json.loads(out)["error"]["type"] == "ResultsInvalid"


def test_a_difference_of_1e_9_is_not_higher(tmp_path: Path) -> None:
    """Before: 1e-9 tok/s more counted as "higher"."""
    rows = json.loads((RUNS / "base" / "aggregate.json").read_text())["rows"]
    nudged = [{**r, "tput_per_gpu": r["tput_per_gpu"] * (1 + 1e-9)} for r in rows]
    text = summary(compare_rows(rows, nudged))
    assert f"0 higher, 0 lower, {len(rows)} same (within {CHANGE_TOLERANCE_PCT:g}%)" in text


def test_plots_without_matplotlib_names_a_real_compare_flag_before_any_output(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """Before: exit 2 after the table, with a hint to pass --no-plots, a sweep flag."""
    monkeypatch.setattr("m3patch.commands.bench.have_matplotlib", lambda: False)
    code, out, err = cli("bench", "compare", str(RUNS / "base"), str(RUNS / "new"),
                         "--plots", str(tmp_path / "p"))
    assert code == UsageError.exit_code
    assert "drop --plots" in err and "--no-plots" not in err and out == ""


def test_a_new_throughput_of_zero_is_compared_without_a_crash(tmp_path: Path) -> None:
    """Before: log(0) in the geometric mean, exit 70."""
    zero = edited(tmp_path, "zero", lambda row: row.update(tput_per_gpu=0))
    code, out, err = cli("bench", "compare", str(RUNS / "base"), str(zero))
    assert code == 0, err
    assert "-100.0%" in out and "geometric mean n/a" in out


@pytest.mark.parametrize("value", ["fast", -1.0, True])
def test_a_malformed_metric_value_is_results_invalid(tmp_path: Path, value: object) -> None:
    """Before: a string or negative value of --metric was never validated (70, or a figure)."""
    bad = edited(tmp_path, "bad", lambda row: row.update(median_ttft=value))
    code, _, err = cli("bench", "compare", str(RUNS / "base"), str(bad), "--metric", "median_ttft")
    assert code == ResultsInvalid.exit_code, err
    assert "median_ttft" in err


def test_an_overflowing_ratio_prints_and_writes_real_json(tmp_path: Path) -> None:
    """Before: `Infinity` under --json - (not JSON), and --json FILE ended in 70."""
    tiny = edited(tmp_path, "tiny", lambda row: row.update(tput_per_gpu=1e-310))
    huge = edited(tmp_path, "huge", lambda row: row.update(tput_per_gpu=1e308))
    code, out, err = cli("bench", "compare", str(tiny), str(huge), "--json")
    assert "Infinity" not in out
    assert json.loads(out)  # strict JSON
    assert code == ResultsInvalid.exit_code, err  # no cell has a change figure
    code, _, err = cli("bench", "compare", str(tiny), str(huge), "--json", str(tmp_path / "c.json"))
    assert code == ResultsInvalid.exit_code, err
    assert json.loads((tmp_path / "c.json").read_text(), parse_constant=lambda c: 1 / 0)


@pytest.mark.parametrize("side", ["base", "new"])
def test_a_duplicated_cell_is_results_invalid_naming_it_and_the_file(tmp_path: Path,
                                                                      side: str) -> None:
    """Before: as NEW the last copy won ("+100.0% ... 1 higher", exit 0); as BASE the cell was
    reported "base only"."""
    run = shutil.copytree(RUNS / "base", tmp_path / "dup")
    data = json.loads((run / "aggregate.json").read_text())
    twin = {**data["rows"][0], "tput_per_gpu": data["rows"][0]["tput_per_gpu"] * 2}
    data["rows"].append(twin)
    (run / "aggregate.json").write_text(json.dumps(data))
    pair = (str(run), str(RUNS / "base")) if side == "base" else (str(RUNS / "base"), str(run))
    code, _out, err = cli("bench", "compare", *pair)
    assert code == ResultsInvalid.exit_code, err
    assert f"cell {twin['cell_id']!r} repeats the shape and concurrency of rows[0]" in err
    assert str(run / "aggregate.json") in err and "fix:" in err


def test_a_duplicated_cell_under_another_cell_id_is_results_invalid(tmp_path: Path) -> None:
    """Before: a second row of the same shape and concurrency under another cell_id was taken
    as NEW's cell (the last copy won: wrong figures, exit 0). A cell is what compare matches
    on, whatever its id."""
    run = shutil.copytree(RUNS / "base", tmp_path / "dup")
    data = json.loads((run / "aggregate.json").read_text())
    twin = {**data["rows"][0], "cell_id": "renamed", "tput_per_gpu": 1.0}
    data["rows"].append(twin)
    (run / "aggregate.json").write_text(json.dumps(data))
    code, out, err = cli("bench", "compare", str(RUNS / "base"), str(run))
    assert code == ResultsInvalid.exit_code, err
    assert "cell 'renamed' repeats the shape and concurrency of rows[0]" in err and not out


@pytest.mark.parametrize(("key", "value"), [
    ("tput_per_gpu", 10 ** 400), ("range_ratio", 10 ** 400), ("isl", [1024]),
    ("dp_attention", {"a": 1}), ("trace", ["t"])])
def test_a_huge_or_unhashable_row_value_is_results_invalid(tmp_path: Path, key: str,
                                                           value: Any) -> None:
    """Before: an integer of 400 digits reached math.isfinite (OverflowError) and a list in a
    shape field reached a dict key (TypeError): 70, a traceback. Now 17 naming the key."""
    run = edited(tmp_path, "odd", lambda row: row.__setitem__(key, value))
    code, out, err = cli("bench", "compare", str(RUNS / "base"), str(run))
    assert code == ResultsInvalid.exit_code, err
    assert f".{key}" in err and "Traceback" not in err and not out


@pytest.mark.parametrize("name", ["\ud800", "\udcff"])
def test_a_lone_surrogate_or_escape_in_the_recipe_name_is_printed_escaped(
        tmp_path: Path, m3patch_cli: Any, name: str) -> None:
    """Before: the title's lone surrogate ended in UnicodeEncodeError on stdout (exit 70), and
    an ESC in it reached the terminal raw (it could recolour or clear the screen)."""
    run = shutil.copytree(RUNS / "base", tmp_path / "new")
    data = json.loads((run / "aggregate.json").read_text())
    data["recipe_name"] = f"{name}\x1b[2J\x9b"
    (run / "aggregate.json").write_text(json.dumps(data))
    done = m3patch_cli("bench", "compare", str(RUNS / "base"), str(run),
                       env={"PYTHONIOENCODING": "utf-8"})  # strict, as a UTF-8 locale's stdout
    assert done.returncode == 0, done.stderr
    shown = name.encode("unicode_escape").decode() if name == "\ud800" else "\\xff"
    assert f"-> new {shown}\\x1b[2J\\x9b / " in done.stdout
    assert "\x1b" not in done.stdout and "\x9b" not in done.stdout
