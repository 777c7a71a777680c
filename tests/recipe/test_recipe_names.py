"""A recipe named by path or by name (`m3patch recipe show mi300x_tp8`), and `series list`."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from core_helpers import REPO

from m3patch.errors import UsageError
from m3patch.recipe.names import recipe_path, shipped_recipe_names

Cli = Callable[..., subprocess.CompletedProcess[str]]


def test_a_name_resolves_to_the_shipped_recipe(tmp_path: Path,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # far from the checkout's recipes/
    assert recipe_path("mi300x_tp8") == REPO / "recipes" / "mi300x_tp8.yaml"
    assert recipe_path("mi300x_tp8.yaml") == REPO / "recipes" / "mi300x_tp8.yaml"
    assert "cpu_tiny_moe" in shipped_recipe_names()
    assert len(shipped_recipe_names()) == len(list((REPO / "recipes").glob("*.yaml")))


def test_an_existing_file_or_a_path_always_wins(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mi300x_tp8.yaml").write_text("schema: 1\n")
    assert recipe_path("mi300x_tp8.yaml") == Path("mi300x_tp8.yaml")  # the local file
    # Anything with a folder part is the user's path, found or not (the loader reports it).
    assert recipe_path("recipes/nope.yaml") == Path("recipes/nope.yaml")
    assert recipe_path("./mi300x_tp8") == Path("./mi300x_tp8")


def test_a_bare_name_that_is_also_a_file_here_is_refused(tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """Before: `serve mi300x_tp8` beside the user's own mi300x_tp8.yaml ran the shipped recipe,
    silently another one than the file the user was looking at."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mi300x_tp8.yml").write_text("schema: 1\n")
    with pytest.raises(UsageError) as info:
        recipe_path("mi300x_tp8")
    assert "both a shipped recipe" in info.value.message and "mi300x_tp8.yml" in info.value.message
    assert "give ./mi300x_tp8.yml for the file here" in (info.value.hint or "")
    monkeypatch.chdir(REPO / "recipes")  # the shipped file itself is no twin
    assert recipe_path("mi300x_tp8") == REPO / "recipes" / "mi300x_tp8.yaml"


def test_an_unknown_name_lists_the_shipped_ones(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UsageError) as info:
        recipe_path("mi300x_tp9")
    assert "no shipped recipe is named 'mi300x_tp9'. Perhaps you meant 'mi300x_tp8'?" in str(
        info.value)
    assert "cpu_tiny_moe" in (info.value.hint or "")


def test_commands_take_a_recipe_name(m3patch_cli: Cli, tmp_path: Path) -> None:
    show = m3patch_cli("recipe", "show", "mi300x_tp8", env={"COLUMNS": "250"})
    assert show.returncode == 0, show.stderr
    assert f"# series {REPO / 'patches' / 'vllm-0.33.0'} " in show.stdout
    dry = m3patch_cli("serve", "cpu_tiny_moe", "--dry-run", env={"COLUMNS": "250"})
    assert dry.returncode == 0, dry.stderr
    assert "--dtype float32 --enforce-eager" in dry.stdout
    matrix = m3patch_cli("matrix", "cpu_tiny_moe", "--per", "recipe")
    assert matrix.returncode == 0, matrix.stderr
    bad = m3patch_cli("serve", "cpu_tiny_mo", "--dry-run")
    assert bad.returncode == 2
    assert "Perhaps you meant 'cpu_tiny_moe'?" in bad.stderr and "Traceback" not in bad.stderr


def test_series_list_marks_the_series_that_fits(m3patch_cli: Cli, pristine_033: Path) -> None:
    fits = m3patch_cli("series", "list", "--vllm-root", str(pristine_033))
    assert fits.returncode == 0, fits.stderr
    lines = fits.stdout.splitlines()
    assert lines[0] == f"shipped series in {REPO / 'patches'}:"
    assert [line.split()[0] for line in lines[1:3]] == ["vllm-0.32.0", "vllm-0.33.0"]
    assert lines[2].endswith("<- fits the located vLLM") and "<-" not in lines[1]
    assert lines[-1] == f"located: vLLM 0.33.0 at {pristine_033} -> vllm-0.33.0"


def test_series_list_without_a_vllm_still_lists(m3patch_cli: Cli, tmp_path: Path) -> None:
    none = m3patch_cli("series", "list")  # the test interpreter has no vllm
    assert none.returncode == 0, none.stderr
    assert "vllm-0.33.0" in none.stdout and "<-" not in none.stdout
    assert "located: no vLLM" in none.stdout
    named = m3patch_cli("series", "list", "--vllm-root", str(tmp_path))  # named, so an error
    assert named.returncode == 3
