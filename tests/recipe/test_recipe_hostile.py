"""Hostile recipe input: every malformed or oversized recipe is a schema error naming the key
(exit 2), never a traceback (70) or a run out of memory."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_helpers import recipe_text, write

from m3patch.recipe.loader import load_recipe
from m3patch.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.parametrize(("section", "entry"), [
    ("vllm-args", "1: x"), ("vllm-args", "true: y"), ("vllm-args", "null: y"),
    ("env", "1: x"), ("env", "false: x"),
])
def test_a_key_that_is_no_string_is_a_schema_error(tmp_path: Path, section: str,
                                                   entry: str) -> None:
    text = recipe_text().replace(f"\n{section}:\n", f"\n{section}:\n  {entry}\n", 1)
    with pytest.raises(SchemaError) as info:
        load_recipe(write(tmp_path, text))
    assert f"At key: {section}" in str(info.value)
    assert "keys must be strings" in str(info.value)


@pytest.mark.parametrize(("name", "old", "new", "where"), [
    ("cpu_tiny_moe", "\nmarkers:\n", "\nmarkers:\n  waive: {1: because}\n", "markers"),
    ("cpu_tiny_moe", "\nmarkers:\n", "\nmarkers:\n  counts: {true: 1}\n", "markers"),
    ("cpu_tiny_moe_pd", "      env:\n", "      env:\n        7: x\n", "prefill"),
])
def test_a_marker_id_or_role_key_that_is_no_string_is_a_schema_error(
        tmp_path: Path, name: str, old: str, new: str, where: str) -> None:
    text = recipe_text(name).replace(old, new, 1)
    with pytest.raises(SchemaError) as info:
        load_recipe(write(tmp_path, text))
    assert f"At key: {where}" in str(info.value) and "keys must be strings" in str(info.value)


def test_a_huge_node_count_is_refused_before_any_node_is_built(tmp_path: Path) -> None:
    text = recipe_text("cpu_tiny_moe_pd").replace(
        "      kind: decode\n", "      kind: decode\n      nodes: 1000000000\n", 1)
    with pytest.raises(SchemaError) as info:
        load_recipe(write(tmp_path, text))
    assert "At key: decode\n==> At key: nodes" in str(info.value)


def test_roles_that_add_up_past_the_node_cap_are_refused(tmp_path: Path) -> None:
    text = recipe_text("cpu_tiny_moe_pd").replace(
        "      kind: decode\n", "      kind: decode\n      nodes: 1000\n", 1).replace(
        "      kind: prefill\n", "      kind: prefill\n      nodes: 1000\n", 1)
    with pytest.raises(SchemaError) as info:
        load_recipe(write(tmp_path, text))
    assert "At key: roles" in str(info.value) and "add up to 2001" in str(info.value)


@pytest.mark.parametrize(("section", "entry", "key"), [
    ("vllm-args", "gpu-memory-utilization: .nan", "gpu-memory-utilization"),
    ("vllm-args", "max-num-seqs: .inf", "max-num-seqs"),
    ("vllm-args", "served-lora: [a, .nan]", "served-lora"),
    ("vllm-args", "compilation-config: {level: .nan}", "compilation-config"),
    ("env", "VLLM_X: .nan", "VLLM_X"),
    # quoted, the same text reaches vLLM: float(" -Infinity ") parses
    ("vllm-args", "max-num-batched-tokens: 'nan'", "max-num-batched-tokens"),
    ("vllm-args", "gpu-memory-utilization: ' -Infinity '", "gpu-memory-utilization"),
    ("env", "VLLM_X: 'INF'", "VLLM_X"),
])
def test_a_nan_or_infinite_launch_value_is_a_schema_error(tmp_path: Path, section: str,
                                                          entry: str, key: str) -> None:
    """vLLM's argparse takes `--gpu-memory-utilization nan` (float('nan') parses), and a NaN
    passes every bound it is compared with."""
    text = recipe_text().replace(f"\n{section}:\n", f"\n{section}:\n  {entry}\n", 1)
    with pytest.raises(SchemaError) as info:
        load_recipe(write(tmp_path, text))
    assert f"At key: {section}\n==> At key: {key}" in str(info.value)
    assert "finite" in str(info.value)


@pytest.mark.parametrize("port", ["99999", "-5", "0", "x"])
def test_a_port_outside_1_65535_is_a_usage_error(m3patch_cli: Cli, port: str) -> None:
    """serve --dry-run printed a launch on port 99999 and exited 0 (bench takes the same type)."""
    result = m3patch_cli("serve", "cpu_tiny_moe", "--dry-run", f"--port={port}")
    assert result.returncode == 2, result.stderr
    assert f"argument --port: {port} is not a TCP port (1-65535)" in result.stderr
