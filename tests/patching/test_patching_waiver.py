"""`m3patch series waiver`: InferenceX's docs/waiver/<PR>.md from the shipped 0.33.0 series.

The expected structure is that of InferenceX's own example, docs/waiver/2508.md (SemiAnalysisAI/
InferenceX main, commit 843c6254ff69b567f772f6a5fd97675af3d04431): its title line, its five
sections in order, the "Config covered" fields and the "What is patched" table header. Only the
structure is restated here; no text of that file is copied.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from m3patch.main import main
from m3patch.patching.series import load_series

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.33.0"
SECTIONS = ["Config covered", "What is patched",
            "Why the unmodified upstream image cannot run this benchmark",
            "Upstream PR / issue links", "Removal plan"]


def _waiver(tmp_path: Path, *extra: str) -> str:
    out = tmp_path / "docs" / "waiver" / "2600.md"
    assert main(["series", "waiver", "--pr", "2600", "--out", str(out), *extra]) == 0
    return out.read_text()


def _section(text: str, title: str) -> str:
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def test_the_shipped_series_gives_a_waiver_shaped_like_inferencexs_example(tmp_path: Path) -> None:
    text = _waiver(tmp_path)
    assert text.startswith("# Inference-engine patch waiver — PR #2600\n")
    assert re.findall(r"^## (.+)$", text, flags=re.M) == SECTIONS
    config = _section(text, "Config covered")
    assert ("**Master config entry:** `minimaxm3-fp8-mi300x-vllm` in "
            "[`configs/amd-master.yaml`]") in config
    assert "**Pinned image:** `vllm/vllm-openai-rocm:v0.33.0`" in config
    # the marker gate on the recipe's platform: the block-FP8 layer line proves the patch ran
    assert "block-fp8-moe: required `m3patch[mxfp8->block_fp8]: `" in config
    assert "Using 'EMULATION' MxFp8 MoE backend" in config
    patched = _section(text, "What is patched")
    assert "| Upstream PR/issue | What it changes | Notes |" in patched
    assert "| vllm #45726 |" in patched and "7 hunk(s)" in patched
    series = load_series(SERIES)
    lock = {pin.id: pin for pin in series.require_lock().patches}
    for patch in series.patches:
        for pin in lock[patch.id].files:
            assert f"`{pin.path}`" in patched
        assert f"**{patch.id}**" in _section(text, "Why the unmodified upstream image cannot run "
                                                   "this benchmark")
        assert f"- {patch.id}: " in _section(text, "Upstream PR / issue links")
        removal = _section(text, "Removal plan")
        assert f"**{patch.id}**: drop when {' '.join(patch.drop_when.split())}" in removal
    assert "https://github.com/vllm-project/vllm/pull/45726" in text


def test_config_entry_and_image_can_be_given_and_stdout_takes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = _waiver(tmp_path, "--recipe", "h200_tp8", "--config-entry", "my-entry",
                   "--image", "vllm/vllm-openai:custom")
    assert "`my-entry` in [`configs/nvidia-master.yaml`]" in text
    assert "**Pinned image:** `vllm/vllm-openai:custom`" in text
    capsys.readouterr()
    assert main(["series", "waiver", "--pr", "7", "--recipe", "mi300x_tp8", "--out", "-"]) == 0
    assert capsys.readouterr().out.startswith("# Inference-engine patch waiver — PR #7\n")


def _recipe_on(tmp_path: Path, series: Path) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(series)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


@pytest.mark.parametrize(("key", "value"), [("why", None), ("drop-when", "  "), ("upstream", None)])
def test_an_entry_without_why_upstream_or_drop_when_is_refused_by_name(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], key: str, value: object
) -> None:
    series = shutil.copytree(SERIES, tmp_path / "series")
    manifest = yaml.safe_load((series / "series.yaml").read_text())
    entry = manifest["patches"][2]
    if value is None:
        del entry[key]
    else:
        entry[key] = value
    (series / "series.yaml").write_text(yaml.safe_dump(manifest, sort_keys=False))
    out = tmp_path / "w.md"
    code = main(["series", "waiver", "--pr", "1", "--recipe", str(_recipe_on(tmp_path, series)),
                 "--out", str(out)])
    err = capsys.readouterr().err
    assert code == 37, err
    assert f"patch entry 'minimax-m3-mtp-fse' (patches[2]) has no {key}" in err
    assert not out.exists()


def test_a_recipe_without_a_config_entry_asks_for_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(SERIES)
    del data["inferencex"]["config-entry"]
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert main(["series", "waiver", "--pr", "1", "--recipe", str(path), "--out",
                 str(tmp_path / "w.md")]) == 2
    assert "--config-entry NAME" in capsys.readouterr().err
