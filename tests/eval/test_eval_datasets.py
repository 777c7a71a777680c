"""`model check` / `model fetch` cover a recipe's eval datasets: offline runs never download."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from m3patch.errors import ModelMissing
from m3patch.eval import datasets
from m3patch.main import main
from m3patch.recipe.loader import load_recipe

REPO = Path(__file__).resolve().parents[2]
MODEL, COMMIT = "MiniMaxAI/MiniMax-M3-MXFP8", "a" * 40


def gsm8k_recipe(tmp_path: Path, python: str = "/nonexistent/python") -> Path:
    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    data["model"]["revision"] = COMMIT
    data["eval"]["python"] = python
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    model = cache / ("models--" + MODEL.replace("/", "--"))
    (model / "snapshots" / COMMIT).mkdir(parents=True)
    (model / "snapshots" / COMMIT / "config.json").write_text("{}")
    (model / "snapshots" / COMMIT / "model.safetensors").write_text("x")
    return cache


def test_model_check_names_the_missing_eval_dataset(
        hub: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = gsm8k_recipe(tmp_path)
    assert main(["model", "check", str(path)]) == 21
    captured = capsys.readouterr()
    assert "gsm8k" in captured.out and "MISSING" in captured.out
    assert "gsm8k (openai/gsm8k)" in captured.err and f"fix: m3patch model fetch {path}" in captured.err
    snapshot = hub / "datasets--openai--gsm8k" / "snapshots" / ("b" * 40)
    snapshot.mkdir(parents=True)
    (snapshot / "README.md").write_text("x")
    assert main(["model", "check", str(path)]) == 0
    assert "eval datasets present (1 from the hub, 0 local)" in capsys.readouterr().err


def test_model_check_by_name_lists_datasets_even_without_the_model(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """A shipped recipe by name (as every other command takes it), on an empty cache: the model
    is missing (19) and the eval datasets are listed all the same, in the same look."""
    for name in ("HF_HOME", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-hub"))
    monkeypatch.chdir(tmp_path)
    assert main(["model", "check", "mi300x_tp8"]) == 19
    captured = capsys.readouterr()
    assert "MiniMax-M3" in captured.out and "eval datasets" in captured.out
    assert "gsm8k" in captured.out
    assert "file not found" not in captured.err


def test_fetch_without_the_harness_says_how_to_install(hub: Path, tmp_path: Path) -> None:
    recipe = load_recipe(gsm8k_recipe(tmp_path))
    assert recipe.eval is not None
    with pytest.raises(ModelMissing) as info:
        datasets.fetch(recipe.eval, recipe.path)
    assert "cannot fetch eval dataset openai/gsm8k" in info.value.message
    assert info.value.hint is not None and "/bin/pip install 'lm-eval[api]==" in info.value.hint


@pytest.mark.slow
def test_fetch_through_the_real_harness_reports_an_unreachable_hub(
        hub: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The real `datasets` in lm-eval's venv, asked for a dataset the hub cannot serve here
    (an unroutable endpoint): fetch fails with the library's own words and caches nothing."""
    python = Path(os.environ.get("M3PATCH_LM_EVAL_PYTHON", Path.home() / ".cache" / "m3patch"
                                 / "lm-eval-venv" / "bin" / "python"))
    if os.environ.get("M3PATCH_SKIP_SERVE") == "1":
        pytest.skip("M3PATCH_SKIP_SERVE=1")
    if not python.is_file():
        pytest.fail(f"no lm-eval at {python}: run scripts/setup/setup_lm_eval.sh")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    recipe = load_recipe(gsm8k_recipe(tmp_path, str(python)))
    assert recipe.eval is not None
    with pytest.raises(ModelMissing, match="cannot fetch eval dataset openai/gsm8k"):
        datasets.fetch(recipe.eval, recipe.path)
    assert datasets.missing(recipe.eval) == recipe.eval.tasks
