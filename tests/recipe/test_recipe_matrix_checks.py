"""`m3patch matrix` emits jobs only for recipes `recipe validate` passes (its checks that need
no server, GPU or vLLM tree), and each recipe's jobs once however often it is named."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from m3patch.main import main

REPO = Path(__file__).resolve().parents[2]


def variant(tmp_path: Path, name: str, old: str, new: str) -> Path:
    text = (REPO / "recipes" / f"{name}.yaml").read_text().replace(
        "series: vllm-", f"series: {REPO}/patches/vllm-")
    assert old in text
    path = tmp_path / f"{name}-bad.yaml"
    path.write_text(text.replace(old, new, 1))
    return path


@pytest.mark.parametrize(("name", "old", "new", "key"), [
    ("cpu_tiny_moe", "  enforce-eager: true", "  enforce-eagr: true", "vllm-args.enforce-eagr"),
    ("cpu_tiny_moe", '  VLLM_CPU_KVCACHE_SPACE: "1"', '  VLLM_CPU_KVCACHE_SPAC: "1"',
     "env.VLLM_CPU_KVCACHE_SPAC"),
    ("cpu_tiny_moe_pd", "          kv_role: kv_producer\n",
     "          kv_role: kv_producer\n          kv_rol: x\n",
     "topology.roles.prefill.vllm-args.kv-transfer-config.kv_rol"),
])
def test_a_recipe_validate_refuses_is_no_job(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                             name: str, old: str, new: str, key: str) -> None:
    bad = variant(tmp_path, name, old, new)
    assert main(["recipe", "validate", "--no-lint-markers", str(bad)]) == 24
    capsys.readouterr()
    assert main(["matrix", "recipes/cpu_tiny_moe.yaml", str(bad)]) == 24
    out, err = capsys.readouterr()
    assert out == ""  # no matrix at all: CI would run the good recipe's jobs and skip the bad
    assert str(bad) in err and key in err


def test_a_recipe_given_twice_is_one_recipes_jobs(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["matrix", "recipes/cpu_tiny_moe.yaml"]) == 0
    once = json.loads(capsys.readouterr().out)["include"]
    assert main(["matrix", "recipes/cpu_tiny_moe.yaml", "cpu_tiny_moe",
                 str(REPO / "recipes" / "cpu_tiny_moe.yaml")]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["include"] == once
    assert "recipes/cpu_tiny_moe.yaml given 3 times" in err
