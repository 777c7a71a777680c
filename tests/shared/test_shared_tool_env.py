"""The `M3PATCH_*` variables m3patch reads: the list is derived from the source here, so it cannot
drift; a near miss of one in the shell is a warning; a known one with an unusable value fails."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from m3patch.errors import UsageError
from m3patch.patching.series import load_series, shipped_series_names
from m3patch.shipped import shipped_dir
from m3patch.tool_env import (
    CHECKOUT_ENV,
    KNOWN_ENV,
    TOOL_ENV,
    bad_values,
    check_environment,
    near_misses,
)

REPO = Path(__file__).resolve().parents[2]
NAME = r"M3PATCH_[A-Z0-9_]+"
EXACT = re.compile(rf"{NAME}")
EXPANDED = re.compile(rf"\$\{{?({NAME})")  # $NAME, ${NAME}, ${NAME:-default}


def read_by_package() -> set[str]:
    """Every name the package reads: a string that is exactly the name (os.environ.get("..."),
    NAME_VAR = "..."), or `$NAME` / `${NAME...}` inside a string (a recipe default it expands,
    the Slurm script it writes, a hint's example); the list itself does not count."""
    found: set[str] = set()
    for path in sorted((REPO / "m3patch").rglob("*.py")):
        if path.name == "tool_env.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if EXACT.fullmatch(node.value):
                    found.add(node.value)
                found.update(EXPANDED.findall(node.value))
    for recipe in sorted((REPO / "recipes").rglob("*.yaml")):  # expanded when m3patch loads them
        found.update(EXPANDED.findall(recipe.read_text(encoding="utf-8")))
    return found


def test_the_list_is_every_name_the_package_reads() -> None:
    assert read_by_package() == set(TOOL_ENV)


def test_every_name_the_scripts_read_is_known() -> None:
    switches = {name for series in shipped_series_names()
                for name in load_series(shipped_dir("patches") / series).switches}  # type: ignore[operator]
    read = {m for path in (REPO / "scripts").rglob("*") if path.is_file()
            and path.suffix in (".sh", ".py", "")
            for m in re.findall(NAME, path.read_text(encoding="utf-8", errors="replace"))}
    assert read - switches - KNOWN_ENV == set()
    assert not TOOL_ENV & CHECKOUT_ENV


def test_no_shipped_switch_looks_like_a_typo_of_a_tool_variable() -> None:
    switches = {name: "x" for series in shipped_series_names()
                for name in load_series(shipped_dir("patches") / series).switches}  # type: ignore[operator]
    assert switches and near_misses(switches) == []


def test_a_near_miss_warns_and_a_foreign_name_is_left_alone(
        capsys: pytest.CaptureFixture[str]) -> None:
    env = {"M3PATCH_SERIE": "vllm-0.33.0", "M3PATCH_LOCK_TIMOUT": "5", "M3PATCH_CACHE": "/c",
           "M3PATCH_SITE_LABEL": "a site's own", "M3PATCH_SKIP_SERVE": "1"}
    check_environment(env)
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "m3patch: warning: environment variable M3PATCH_LOCK_TIMOUT is not one m3patch reads; "
        "it is ignored. Perhaps you meant 'M3PATCH_LOCK_TIMEOUT'?",
        "m3patch: warning: environment variable M3PATCH_SERIE is not one m3patch reads; "
        "it is ignored. Perhaps you meant 'M3PATCH_SERIES'?"]


@pytest.mark.parametrize(("name", "value"), [("M3PATCH_DEBUG_TRACEBACK", "true"),
                                             ("M3PATCH_DEBUG_TRACEBACK", "yes"),
                                             ("M3PATCH_FAULT", "kill-after3")])
def test_a_known_variable_with_an_unusable_value_fails(name: str, value: str) -> None:
    with pytest.raises(UsageError) as caught:
        check_environment({name: value})
    assert caught.value.message.startswith(f"environment variable {name}={value!r} is not")
    assert caught.value.hint is not None and f"unset {name}" in caught.value.hint


def test_the_values_a_known_variable_takes() -> None:
    good = [{"M3PATCH_DEBUG_TRACEBACK": v} for v in ("1", "0", "")]
    good += [{"M3PATCH_FAULT": v} for v in ("kill-after:3", "fail-after:12", "")]
    assert all(bad_values(env) == [] for env in good)


def test_the_command_line_checks_the_environment(m3patch_cli: object) -> None:
    result = m3patch_cli("recipe", "show", "cpu_tiny_moe",  # type: ignore[operator]
                         env={"M3PATCH_DEBUG_TRACEBACK": "true"})
    assert result.returncode == 2, result.stderr
    assert "M3PATCH_DEBUG_TRACEBACK='true' is not 1 (on) or 0 (off)" in result.stderr
    result = m3patch_cli("series", "list", "--vllm-root", "/nonexistent",  # type: ignore[operator]
                         env={"M3PATCH_SERIE": "vllm-0.33.0"})
    assert "Perhaps you meant 'M3PATCH_SERIES'?" in result.stderr


def test_a_bad_series_variable_is_named(pristine_033: Path, m3patch_cli: object) -> None:
    result = m3patch_cli("status", "--vllm-root", str(pristine_033),  # type: ignore[operator]
                         env={"M3PATCH_SERIES": "bogus"})
    assert result.returncode == 2, result.stderr
    assert "M3PATCH_SERIES='bogus' (from the environment): bogus: no such series folder" in (
        result.stderr)
    assert "fix: unset M3PATCH_SERIES, or" in result.stderr


def test_every_command_refuses_a_bad_lock_timeout(pristine_033: Path,
                                                   m3patch_cli: object) -> None:
    """Before (a second hostile review): only apply and revert, which take the tree lock,
    read M3PATCH_LOCK_TIMEOUT; status, verify and apply --dry-run ran with `abc`, `nan` or
    `-1` and said nothing, though the docs say the environment is checked as a command
    starts."""
    tree = ["--vllm-root", str(pristine_033), "--series", "vllm-0.33.0"]
    for command in (["status"], ["verify"], ["apply", "--dry-run"]):
        for value in ("abc", "nan", "-1"):
            result = m3patch_cli(*command, *tree,  # type: ignore[operator]
                                 env={"M3PATCH_LOCK_TIMEOUT": value})
            assert result.returncode == 2, (command, value, result.stderr)
            assert f"$M3PATCH_LOCK_TIMEOUT={value!r} is not a number" in result.stderr


def test_a_huge_value_is_quoted_once_and_cut(pristine_033: Path, m3patch_cli: object) -> None:
    """Before: a 100 kB M3PATCH_SERIES made a message of about 300 kB (the value three times)."""
    huge = "x" * 100_000
    result = m3patch_cli("status", "--vllm-root", str(pristine_033),  # type: ignore[operator]
                         env={"M3PATCH_SERIES": huge})
    assert result.returncode == 2, result.stderr[:500]
    assert len(result.stderr) < 2_000 and "(100,000 characters)" in result.stderr
    with pytest.raises(UsageError) as caught:
        check_environment({"M3PATCH_FAULT": "zz"})
    assert caught.value.hint == "unset M3PATCH_FAULT"  # before: "unset X, or unset X"
