"""`m3patch tune --recipe`: the shape a recipe's deployment runs, through the module and the
real CLI (`--plan` stops before any GPU work), on the shipped recipes and edited copies."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from m3patch.errors import UsageError
from m3patch.recipe.loader import load_recipe
from m3patch.tune.recipe_shapes import deployment, shape_for_recipe

REPO = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]
M3_CONFIG = {"architectures": ["MiniMaxM3ForCausalLM"], "hidden_size": 6144,
             "intermediate_size": 3072, "num_local_experts": 128, "num_experts_per_tok": 4,
             "n_shared_experts": 1}
BLOCK = (128, 128)


@pytest.fixture
def m3_config(tmp_path: Path) -> Path:
    path = tmp_path / "MiniMax-M3-MXFP8" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(M3_CONFIG))
    return path


def _recipe(tmp_path: Path, base: str, *, source: str | None = None,
            edits: tuple[tuple[str, str], ...] = ()) -> Path:
    text = (REPO / "recipes" / base).read_text(encoding="utf-8")
    text = text.replace("series: ../patches/", f"series: {REPO}/patches/")
    if source is not None:
        text = text.replace("  source: MiniMaxAI/MiniMax-M3-MXFP8", f"  source: {source}")
    for old, new in edits:
        assert old in text, old
        text = text.replace(old, new)
    path = tmp_path / base
    path.write_text(text, encoding="utf-8")
    return path


def _shape(path: Path, model_config: Path | None = None) -> tuple[int, int, int, int, bool]:
    shape = shape_for_recipe(load_recipe(path), model_config=model_config, dtype="fp8_w8a8",
                             block_shape=BLOCK)
    return shape.num_experts, shape.width, shape.hidden, shape.top_k, shape.expert_parallel


def test_shipped_recipes_give_the_design_tables_shapes(m3_config: Path) -> None:
    """shared/design/vllm-0.33.md §4.3: TP8 E=128,N=384; TP8+EP8 E=16,N=3072; TP4 N=768,
    E=129 there because the MI355X recipe sets VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=1."""
    assert _shape(REPO / "recipes/h200_tp8.yaml", m3_config) == (128, 384, 6144, 4, False)
    assert _shape(REPO / "recipes/mi300x_tp8_ep8.yaml", m3_config) == (16, 3072, 6144, 4, True)
    assert _shape(REPO / "recipes/mi355x_tp4.yaml", m3_config) == (129, 768, 6144, 4, False)


def test_local_model_source_is_read_without_model_config(tmp_path: Path,
                                                         m3_config: Path) -> None:
    path = _recipe(tmp_path, "h200_tp8.yaml", source=str(m3_config.parent))
    assert _shape(path) == (128, 384, 6144, 4, False)


def test_fused_shared_experts_follow_the_recipes_rocm_env(tmp_path: Path,
                                                          m3_config: Path) -> None:
    fse = ('  VLLM_ROCM_USE_AITER: "1"\n',
           '  VLLM_ROCM_USE_AITER: "1"\n  VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS: "1"\n')
    tp8 = _recipe(tmp_path, "mi300x_tp8.yaml", edits=(fse,))
    assert deployment(load_recipe(tp8)).fused_shared_experts
    assert _shape(tp8, m3_config) == (129, 384, 6144, 4, False)  # E+1
    (tmp_path / "ep").mkdir()
    # The shipped EP8 recipe runs AITER off (EP8 with AITER returned garbage); turn both on here.
    fse_ep = ('  VLLM_ROCM_USE_AITER: "0"\n', fse[1])
    ep8 = _recipe(tmp_path / "ep", "mi300x_tp8_ep8.yaml", edits=(fse_ep,))
    assert _shape(ep8, m3_config) == (16, 3072, 6144, 4, True)  # vLLM turns FSE off with EP
    assert _shape(REPO / "recipes/mi300x_tp8.yaml", m3_config)[0] == 128  # env unset: no FSE


def test_data_parallel_ranks_split_like_vllm(tmp_path: Path, m3_config: Path) -> None:
    tp4dp2 = _recipe(tmp_path, "h200_tp8.yaml", edits=(("  tp: 8\n", "  tp: 4\n  dp: 2\n"),))
    assert _shape(tp4dp2, m3_config) == (128, 384, 6144, 4, False)  # MoE TP = TP x DP
    (tmp_path / "dpa").mkdir()
    dpa = _recipe(tmp_path / "dpa", "h200_tp8.yaml",
                  edits=(("  tp: 8\n", "  tp: 8\n  dp-attention: true\n"),))
    assert _shape(dpa, m3_config) == (16, 3072, 6144, 4, True)  # TP1 x DP8 with EP


def test_hub_model_without_a_local_config_fails_clearly(monkeypatch: pytest.MonkeyPatch,
                                                        tmp_path: Path) -> None:
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    with pytest.raises(UsageError, match=r"config\.json is not on this machine") as err:
        _shape(REPO / "recipes/h200_tp8.yaml")
    assert err.value.hint is not None and "--model-config" in err.value.hint
    snapshot = tmp_path / "hub/models--MiniMaxAI--MiniMax-M3-MXFP8/snapshots/abc123"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps(M3_CONFIG))
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs/main").write_text("abc123\n")
    assert _shape(REPO / "recipes/h200_tp8.yaml") == (128, 384, 6144, 4, False)


def test_local_source_without_config_and_cpu_recipes_are_refused(tmp_path: Path) -> None:
    empty = tmp_path / "empty-model"
    empty.mkdir()
    path = _recipe(tmp_path, "h200_tp8.yaml", source=str(empty))
    with pytest.raises(UsageError, match=r"has no config\.json"):
        _shape(path)
    cpu = REPO / "recipes/cpu_tiny_moe.yaml"
    with pytest.raises(UsageError, match="nothing to tune"):
        shape_for_recipe(load_recipe(cpu), model_config=None, dtype="fp8_w8a8",
                         block_shape=BLOCK)


def test_cli_plan_from_a_recipe(m3patch_cli: Cli, m3_config: Path) -> None:
    result = m3patch_cli("tune", "--recipe", "recipes/mi300x_tp8_ep8.yaml", "--model-config",
                         str(m3_config), "--plan", "--device-name", "NVIDIA H200")
    assert result.returncode == 0, result.stderr
    assert "E=16,N=3072,K=6144,topk=4,dtype=fp8_w8a8,block=128x128,ep" in result.stdout
    assert ("E=16,N=3072,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json"
            in result.stdout)


@pytest.mark.parametrize(("extra", "needle"), [
    (("--tp", "4"), "--tp cannot be combined with --recipe"),
    (("--shape", "16,3072,6144,4"), "give exactly one of --shape"),
])
def test_cli_rejects_conflicting_flags(m3patch_cli: Cli, m3_config: Path,
                                       extra: tuple[str, ...], needle: str) -> None:
    result = m3patch_cli("tune", "--recipe", "recipes/h200_tp8.yaml", "--model-config",
                         str(m3_config), "--plan", *extra)
    assert result.returncode == 2
    assert needle in result.stderr and "Traceback" not in result.stderr


def test_cli_missing_hub_config_is_a_usage_error(m3patch_cli: Cli, tmp_path: Path) -> None:
    result = m3patch_cli("tune", "--recipe", "recipes/h200_tp8.yaml", "--plan",
                         env={"HF_HUB_CACHE": str(tmp_path)})
    assert result.returncode == 2
    assert "MiniMaxAI/MiniMax-M3-MXFP8" in result.stderr and "--model-config" in result.stderr


def test_cli_plan_from_a_shipped_recipe_name(m3patch_cli: Cli, m3_config: Path) -> None:
    """`--recipe` takes a shipped recipe's name, as every command that takes a recipe does."""
    result = m3patch_cli("tune", "--recipe", "mi300x_tp8_ep8", "--model-config",
                         str(m3_config), "--plan", "--device-name", "NVIDIA H200")
    assert result.returncode == 0, result.stderr
    assert "E=16,N=3072,K=6144,topk=4,dtype=fp8_w8a8,block=128x128,ep" in result.stdout
    unknown = m3patch_cli("tune", "--recipe", "mi300x_tp9", "--plan")
    assert unknown.returncode == 2
    assert "no shipped recipe is named 'mi300x_tp9'" in unknown.stderr
