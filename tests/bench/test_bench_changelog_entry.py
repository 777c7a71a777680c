"""`bench compare BASE NEW --changelog-entry`: a perf-changelog.yaml entry `changelog check` accepts."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
from core_helpers import isolated_git

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


def _git_repo(root: Path, monkeypatch: pytest.MonkeyPatch, files: dict[str, str]) -> None:
    """A git repository holding `files` and no recipes/ (as an InferenceX checkout), committed;
    the current folder."""
    isolated_git(monkeypatch)
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    for args in (["init", "-q", "-b", "main"], ["add", "-A"], ["commit", "-q", "-m", "base"]):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    monkeypatch.chdir(root)


def _append_entry_and_check(capsys: pytest.CaptureFixture[str], new: Path) -> tuple[int, str]:
    """The README's flow: `bench compare ... --changelog-entry >> perf-changelog.yaml`, then
    `changelog check --base HEAD`."""
    entry = _entry(capsys, RUNS / "base", new)
    with Path("perf-changelog.yaml").open("a") as changelog:
        changelog.write(entry)
    code = main(["changelog", "check", "--base", "HEAD", "--repo", "acme/inferencex"])
    return code, capsys.readouterr().err


def test_the_inferencex_flow_passes_in_a_checkout_without_recipes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No recipes/ here: the entry names the recipe m3patch ships, which this checkout runs
    (`m3patch bench cpu_tiny_moe`). Before: 16, "matches no recipe under recipes/"."""
    _git_repo(tmp_path, monkeypatch, {"perf-changelog.yaml": entry_text("a-config")})
    code, err = _append_entry_and_check(capsys, RUNS / "new")
    assert code == 0, err


def test_the_entry_names_the_config_entry_an_inferencex_checkout_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """NEW's recipe states its InferenceX master-config entry: the changelog entry is keyed by
    it, and the checkout's master configs judge the key as InferenceX's own check does."""
    new = shutil.copytree(RUNS / "new", tmp_path / "runs" / "new")
    data = json.loads((new / "aggregate.json").read_text())
    data["inferencex_config_entry"] = "minimaxm3-fp8-mi300x-vllm"
    (new / "aggregate.json").write_text(json.dumps(data))
    checkout = tmp_path / "inferencex"
    checkout.mkdir()
    _git_repo(checkout, monkeypatch, {
        "perf-changelog.yaml": entry_text("a-config"),
        "configs/amd-master.yaml": "minimaxm3-fp8-mi300x-vllm:\n  image: x\na-config:\n  image: y\n",
    })
    code, err = _append_entry_and_check(capsys, new)
    assert code == 0, err
    assert "    - minimaxm3-fp8-mi300x-vllm\n" in Path("perf-changelog.yaml").read_text()
    code, err = _append_entry_and_check(capsys, RUNS / "new")  # no config entry: its name
    assert code == 16
    assert ("'cpu_tiny_moe' is no entry of this InferenceX checkout's master configs "
            "(configs/amd-master.yaml)") in err


def test_a_run_records_its_recipes_inferencex_config_entry(tmp_path: Path) -> None:
    from m3patch.bench.runner import run_meta
    from m3patch.recipe.loader import load_recipe

    meta = run_meta(load_recipe(REPO / "recipes" / "mi300x_tp8.yaml"), tmp_path, {})
    assert meta["inferencex_config_entry"] == "minimaxm3-fp8-mi300x-vllm"
    assert run_meta(load_recipe(REPO / "recipes" / "cpu_tiny_moe.yaml"), tmp_path,
                    {})["inferencex_config_entry"] is None


def entry_text(key: str) -> str:
    return f'- config-keys:\n    - {key}\n  description:\n    - "base"\n  pr-link: XXX\n'


def _edited(tmp_path: Path, edit: object) -> Path:
    run = shutil.copytree(RUNS / "new", tmp_path / "edited")
    data = json.loads((run / "aggregate.json").read_text())
    for row in data["rows"]:
        edit(row)  # type: ignore[operator]
    (run / "aggregate.json").write_text(json.dumps(data))
    return run


@pytest.mark.parametrize(("metric", "value"), [("p99_ttft", -5.0), ("median_e2el", "fast"),
                                               ("median_intvty", 10 ** 400)])
def test_an_entry_from_a_bad_headline_figure_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], metric: str, value: object) -> None:
    """Before: only the compared metric was checked; a negative TTFT or a string E2EL went
    into the entry (or a 70), exit 0. Every figure the entry states is checked: 17."""
    run = _edited(tmp_path, lambda row: row.__setitem__(metric, value))
    capsys.readouterr()
    code = main(["bench", "compare", str(RUNS / "base"), str(run), "--changelog-entry"])
    got = capsys.readouterr()
    assert code == 17, got.err
    assert f".{metric} is" in got.err and not got.out


def test_an_entry_with_no_cell_in_common_is_refused(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Before: "no cell of the same shape on both sides" went into the changelog, exit 0."""
    run = _edited(tmp_path, lambda row: row.__setitem__("isl", row["isl"] * 2))
    capsys.readouterr()
    code = main(["bench", "compare", str(RUNS / "base"), str(run), "--changelog-entry"])
    got = capsys.readouterr()
    assert code == 17, got.err
    assert "nothing compared" in got.err and not got.out


def test_an_entry_under_json_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    """Before: `--json` printed the YAML entry, which no JSON reader takes."""
    code = main(["bench", "compare", str(RUNS / "base"), str(RUNS / "new"), "--changelog-entry",
                 "--json"])
    got = capsys.readouterr()
    assert code == 2
    assert json.loads(got.out)["ok"] is False and "--changelog-entry" in got.out


def test_a_recipe_key_with_a_trailing_newline_names_no_config_key(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`$` matched before a final newline: "cpu_tiny_moe\\n" made a key over two lines."""
    run = shutil.copytree(RUNS / "new", tmp_path / "nl")
    data = json.loads((run / "aggregate.json").read_text())
    data["recipe_name"] = "cpu_tiny_moe\n"
    data.pop("inferencex_config_entry", None)
    (run / "aggregate.json").write_text(json.dumps(data))
    capsys.readouterr()
    code = main(["bench", "compare", str(RUNS / "base"), str(run), "--changelog-entry"])
    assert code == 2 and not capsys.readouterr().out
