"""A multi-node recipe's roles are launch-checked as a single server's recipe is: a typo in a
role's vllm-args or env fails `recipe validate` and `serve --dry-run` with 24, naming the role's
key, before any node starts."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from m3patch.cluster.node_plan import role_recipes
from m3patch.errors import LaunchRejected
from m3patch.recipe.loader import load_recipe
from m3patch.serving.vllm_parser import argv_sources, check_launch

REPO = Path(__file__).resolve().parents[2]
Cli = Callable[..., subprocess.CompletedProcess[str]]


def pd_recipe(tmp_path: Path, *, arg: str = "", env: str = "") -> Path:
    text = (REPO / "recipes" / "cpu_tiny_moe_pd.yaml").read_text().replace(
        "series: vllm-0.32.0", f"series: {REPO / 'patches' / 'vllm-0.32.0'}")
    if arg:  # the prefill role's vllm-args
        text = text.replace("      vllm-args:\n        kv-transfer-config:",
                            f"      vllm-args:\n        {arg}\n        kv-transfer-config:", 1)
    if env:  # the decode role's env
        text = text.replace('        VLLM_CPU_OMP_THREADS_BIND: "1"', f"        {env}", 1)
    path = tmp_path / "pd.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize("dry_run", [False, True])
def test_a_typo_in_a_roles_vllm_args_is_24_naming_the_role(m3patch_cli: Cli, tmp_path: Path,
                                                            dry_run: bool) -> None:
    path = str(pd_recipe(tmp_path, arg="max-num-sqs: 4"))
    # serve --dry-run with an interpreter without vLLM: checked against the series' spec
    result = m3patch_cli(*(["serve", path, "--dry-run", "--python", sys.executable] if dry_run
                           else ["recipe", "validate", "--no-lint-markers", path]))
    assert result.returncode == 24, result.stderr
    assert "topology.roles.prefill.vllm-args.max-num-sqs: vLLM 0.32.0 has no option " \
           "--max-num-sqs" in result.stderr
    assert "role prefill" in result.stderr


def test_a_typo_in_a_roles_env_is_24_naming_the_role(m3patch_cli: Cli, tmp_path: Path) -> None:
    path = pd_recipe(tmp_path, env='VLLM_CPU_OMP_THREADS_BND: "1"')
    result = m3patch_cli("recipe", "validate", "--no-lint-markers", str(path))
    assert result.returncode == 24, result.stderr
    assert "topology.roles.decode.env.VLLM_CPU_OMP_THREADS_BND: vLLM 0.32.0 has no such " \
           "variable" in result.stderr
    assert "Perhaps you meant 'VLLM_CPU_OMP_THREADS_BIND'?" in result.stderr


def test_the_shipped_topology_recipes_pass_the_check_of_every_role() -> None:
    for name in ("cpu_tiny_moe_pd", "cpu_tiny_moe_dp2", "mi300x_ep16_2node", "mi355x_tp4_pd"):
        recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
        variants = role_recipes(recipe)
        assert variants, name
        for variant in variants:
            check_launch(variant, sys.executable, {}, spawn=False)


def test_a_roles_keys_are_named_by_the_role_the_recipes_by_the_recipe(tmp_path: Path) -> None:
    recipe = load_recipe(pd_recipe(tmp_path, arg="max-num-seqs: 4"))
    prefill = next(r for r in role_recipes(recipe) if r.launch_role == "prefill")
    keys = [src.key for src in argv_sources(prefill)]
    assert "vllm-args.dtype" in keys and "topology.roles.prefill.vllm-args.max-num-seqs" in keys
    assert "topology.roles.prefill.vllm-args.kv-transfer-config" in keys
    with pytest.raises(LaunchRejected):
        check_launch(next(r for r in role_recipes(load_recipe(pd_recipe(
            tmp_path, arg="max-num-sqs: 4"))) if r.launch_role == "prefill"),
            sys.executable, {}, spawn=False)


def test_the_no_parser_note_is_said_once_for_every_launch_form(m3patch_cli: Cli) -> None:
    """A two-node recipe is three launch forms (the group and two roles): the note that vLLM's
    parser is not here was printed three times."""
    result = m3patch_cli("serve", "mi300x_ep16_2node", "--dry-run")
    assert result.returncode == 0, result.stderr
    assert result.stderr.count("not checked by vLLM's parser here") == 1, result.stderr


def test_a_node_started_alone_checks_its_roles_launch_first(m3patch_cli: Cli,
                                                            tmp_path: Path) -> None:
    """`serve RECIPE --role R --rank K` (what a Slurm task or a per-host container runs) went
    on to the model check and the tree's patching; vLLM itself refused the typo later. The
    role's launch is checked first, from the series' spec (no parser probe on a node's start)."""
    path = str(pd_recipe(tmp_path, arg="max-num-sqs: 4"))
    result = m3patch_cli("serve", path, "--role", "prefill", "--rank", "0", "--run-dir",
                         str(tmp_path / "run"), "--hold", "1", "--quiet",
                         env={"M3PATCH_SET_ID": "set-typo", "M3PATCH_TINY_MODEL": str(tmp_path)})
    assert result.returncode == LaunchRejected.exit_code, result.stderr
    assert "topology.roles.prefill.vllm-args.max-num-sqs" in result.stderr
