"""`bench compare BASE NEW --changelog-entry`: a perf-changelog.yaml entry `changelog check` accepts."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]
RUNS = REPO / "tests" / "data" / "bench" / "runs"


def _entry(capsys: pytest.CaptureFixture[str], base: Path, new: Path) -> str:
    capsys.readouterr()
    assert main(["bench", "compare", str(base), str(new), "--changelog-entry"]) == 0
    return capsys.readouterr().out


def test_the_entry_appends_to_the_changelog_and_passes_its_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = _entry(capsys, RUNS / "base", RUNS / "new")
    assert out.startswith("\n- config-keys:\n    - cpu_tiny_moe\n  description:\n")
    assert out.rstrip("\n").endswith("  pr-link: XXX")
    # headline deltas in InferenceX's vocabulary, per sequence and parallelism
    assert "32/16 TP1 (conc 1-4): TPUT/GPU " in out and "Intvty Median " in out
    assert "TTFT P99 (lower is better) " in out
    repo = tmp_path / "repo"
    (repo / "recipes").mkdir(parents=True)
    shutil.copy(REPO / "recipes" / "cpu_tiny_moe.yaml", repo / "recipes")
    changelog = repo / "perf-changelog.yaml"
    changelog.write_text((REPO / "perf-changelog.yaml").read_text() + out)
    capsys.readouterr()
    assert main(["changelog", "check", "--file", str(changelog)]) == 0, capsys.readouterr().err


def test_the_deltas_are_the_comparisons_own(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # NEW = BASE with every throughput 10 % higher: the entry says +10.0%, one figure.
    run = shutil.copytree(RUNS / "base", tmp_path / "new")
    data = json.loads((run / "aggregate.json").read_text())
    for row in data["rows"]:
        row["tput_per_gpu"] *= 1.1
    (run / "aggregate.json").write_text(json.dumps(data))
    out = _entry(capsys, RUNS / "base", run)
    assert "TPUT/GPU +10.0%," in out and "Intvty Median +0.0%" in out


def test_an_inferencex_row_as_new_has_no_recipe_to_name(
    capsys: pytest.CaptureFixture[str],
) -> None:
    row = REPO / "tests" / "data" / "bench" / "inferencex" / "agg_isl32-osl16-c4.json"
    assert main(["bench", "compare", str(RUNS / "base"), str(row), "--changelog-entry"]) == 2
    assert "names no m3patch recipe" in capsys.readouterr().err
