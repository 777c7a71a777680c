"""YAML a recipe (or manifest) may not be: complex keys, alias bombs, recursive aliases and values
Python cannot build are a usage error naming the file (exit 2), never a traceback or a run out of
memory."""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from recipe_helpers import recipe_text, write

from m3patch.errors import UsageError
from m3patch.yamlio import load_yaml_text

REPO = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]


@pytest.mark.parametrize("key", ["[a, b]", "{x: 1}"])
def test_a_complex_yaml_key_is_a_usage_error_naming_the_file(key: str) -> None:
    with pytest.raises(UsageError) as info:
        load_yaml_text(f"a: 1\nvllm-args:\n  ? {key}\n  : x\n", source="r.yaml")
    assert str(info.value).startswith("r.yaml:3: invalid YAML:"), str(info.value)
    assert "key" in str(info.value)


def test_validate_of_a_complex_key_exits_2(m3patch_cli: Cli, tmp_path: Path) -> None:
    text = recipe_text().replace("\nvllm-args:\n", "\nvllm-args:\n  ? [a, b]\n  : x\n", 1)
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(write(tmp_path, text)))
    assert result.returncode == 2, result.stderr
    assert "internal error" not in result.stderr


def test_a_billion_laughs_is_refused_naming_the_file() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 10)]
    with pytest.raises(UsageError) as info:
        load_yaml_text("\n".join(lines) + "\n", source="bomb.yaml")
    assert str(info.value).startswith("bomb.yaml: ") and "nodes" in str(info.value)


def test_a_billion_laughs_inside_vllm_args_exits_2(m3patch_cli: Cli, tmp_path: Path) -> None:
    """Ten million leaves (a JSON argument of 60 MB before the cap) from a file of 1 KiB."""
    levels = "".join(f"    l{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 10)}]\n" for i in range(1, 7))
    text = recipe_text().replace(
        "\nvllm-args:\n", "\nvllm-args:\n  compilation-config:\n"
        f"    l0: &l0 [{', '.join(['lol'] * 10)}]\n{levels}", 1)
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(write(tmp_path, text)),
                         timeout=120)
    assert result.returncode == 2, result.stderr
    assert str(tmp_path / "r.yaml") in result.stderr and "nodes" in result.stderr


def test_an_alias_that_contains_itself_is_refused() -> None:
    with pytest.raises(UsageError) as info:
        load_yaml_text("a: &a [1, *a]\n", source="r.yaml")
    assert "r.yaml" in str(info.value)


def test_a_large_plain_file_still_loads() -> None:
    data = load_yaml_text("\n".join(f"k{i}: [1, 2, 3]" for i in range(20000)), source="big")
    assert len(data) == 20000


@pytest.mark.parametrize("value", ["9" * 5000, "2024-13-45"])
def test_a_value_python_cannot_construct_is_a_usage_error(value: str) -> None:
    """A 5000-digit integer passes Python's int-from-text limit; a 13th month is no date."""
    with pytest.raises(UsageError) as info:
        load_yaml_text(f"a: 1\nb: {value}\n", source="r.yaml")
    assert str(info.value).startswith("r.yaml: invalid YAML:"), str(info.value)
