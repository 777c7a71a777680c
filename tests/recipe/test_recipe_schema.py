"""Recipe schema: shipped recipes load, strict keys, the `vllm serve --config` flattening rules."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from m3patch.bench.client import CELL_DEADLINE_HINT
from m3patch.recipe.launch import flatten_vllm_args
from m3patch.recipe.loader import doubling, load_recipe
from m3patch.schema import SchemaError

REPO = Path(__file__).resolve().parents[2]
RECIPES = sorted((REPO / "recipes").glob("*.yaml"))
GPU_RECIPES = ["mi355x_tp4", "mi300x_tp8", "mi300x_tp8_ep8", "mi300x_tp8_mtp",
               "mi300x_tp8_eagle3", "h200_tp8"]


def variant(tmp_path: Path, change: dict[str, object]) -> Path:
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data.update(change)
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_every_shipped_recipe_is_present_and_loads() -> None:
    names = {p.stem for p in RECIPES}
    assert {"cpu_tiny_moe", *GPU_RECIPES} <= names
    for path in RECIPES:
        recipe = load_recipe(path)
        assert recipe.series_dir.joinpath("series.yaml").is_file(), path


@pytest.mark.parametrize("name", GPU_RECIPES)
def test_gpu_recipes_sweep_1k1k_and_8k1k(name: str) -> None:
    recipe = load_recipe(REPO / "recipes" / f"{name}.yaml")
    shapes = {(r.isl, r.osl) for r in recipe.sweep.rows}
    assert {(1024, 1024), (8192, 1024)} <= shapes
    tp_only = recipe.parallelism.ep == 1 and not recipe.parallelism.dp_attention
    if tp_only:  # latency rows start at concurrency 1
        assert all(r.concurrencies[0] == 1 for r in recipe.sweep.rows)
    assert recipe.sweep.num_prompts(8) == 80 and recipe.sweep.num_warmups(8) == 16


def test_cpu_recipe_resolves_the_documented_launch() -> None:
    recipe = load_recipe(REPO / "recipes" / "cpu_tiny_moe.yaml")
    args = recipe.serve_args()
    assert args[0].endswith("tiny-moe") and args[args.index("--port") + 1] == "8765"
    assert "--enforce-eager" in args and args[args.index("--dtype") + 1] == "float32"
    assert recipe.target.platform == "cpu" and recipe.target.vllm_version == "0.32.0"
    assert dict(recipe.env)["VLLM_CPU_KVCACHE_SPACE"] == "1"


def test_flattening_matches_vllm_config_rules() -> None:
    argv = flatten_vllm_args({
        "enforce-eager": True, "enable-prefix-caching": False, "max_model_len": 512,
        "compilation-config": {"level": 3, "sizes": [1, 2]}, "served-lora": ["a", "b"],
        "kv_transfer_config.kv_role": "kv_both",
    })
    assert argv == ("--enforce-eager", "--no-enable-prefix-caching", "--max-model-len", "512",
                    "--compilation-config", json.dumps({"level": 3, "sizes": [1, 2]},
                                                       separators=(",", ":")),
                    "--served-lora", "a", "b", "--kv-transfer-config.kv_role", "kv_both")


@pytest.mark.parametrize(("args", "needle"), [
    ({"tokenizer-mode": []}, "empty list"),
    ({"dtype": None}, "null"),
    ({"--dtype": "float32"}, "without dashes"),
    ({"port": 1}, "server.port"),
    ({"tensor-parallel-size": 2}, "parallelism.tp"),
    # before: each of these reached the launch, the last two past m3patch's own settings
    ({"max-model-len=512": True}, "the option name alone as the key"),
    ({"max_model_len": 512, "max-model-len": 1024}, "the same option as 'max_model_len'"),
    ({"speculative-config.method": "eagle3"}, "set this through speculative instead"),
    ({"tensor_parallel_size.x": 1}, "parallelism.tp"),
])
def test_flattening_refuses_what_vllm_would_drop_or_double(args: dict[str, object],
                                                           needle: str) -> None:
    with pytest.raises(SchemaError) as info:
        flatten_vllm_args(args)
    assert needle in str(info.value)


def test_unknown_key_suggests_and_names_the_file(tmp_path: Path) -> None:
    path = variant(tmp_path, {"deadline": {"ready-s": 5}})
    with pytest.raises(SchemaError) as info:
        load_recipe(path)
    text = str(info.value)
    assert f"File {path}" in text and "Perhaps you meant 'deadlines'?" in text
    assert info.value.exit_code == 2


@pytest.mark.parametrize(("change", "needle"), [
    ({"parallelism": {"tp": 8, "ep": 4}}, "ep must be 1 or tp x dp = 8"),
    ({"env": {"VLLM_ROCM_USE_AITER": True}}, "quote booleans"),
    ({"sweep": {"rows": [{"isl": 1, "osl": 1, "conc-start": 8, "conc-end": 2}]}},
     "conc-start 8 is above conc-end 2"),
    ({"speculative": {"method": "eagle3", "num_speculative_tokens": 3}}, "needs model.draft"),
    ({"target": {"platform": "rocm-gfx924", "vllm-version": "0.32.0"}},
     "Perhaps you meant 'rocm-gfx942'?"),
    ({"markers": {"required": [{"id": "x", "text": "y", "count": 0}]}}, ">= 1"),
    # a bad pattern fails at load, not with a traceback at the first log line
    ({"markers": {"forbidden": [{"id": "x", "text": "regex:Using ('"}]}},
     "==> At key: forbidden\n==> At index 0\n==> At key: text\n=====> invalid regex"),
    ({"sweep": {"rows": [{"isl": 1, "osl": 1, "conc-start": 1, "conc-end": 2}],
                "regions": [{"when": {"isl-min": 1}, "vllm-args": ["x"]}]}},
     "==> At key: regions\n==> At index 0\n==> At key: vllm-args\n=====> expected a mapping"),
    ({"sweep": {"rows": [{"isl": 1, "osl": 1, "conc-start": 1, "conc-end": 2}],
                "regions": [{"when": {"isl-min": 2048, "isl-max": 1024}, "env": {"A": "1"}}]}},
     "==> At key: when\n=====> isl-min 2048 is above isl-max 1024: the region would match no cell"),
    # a role name is a file name and a word of the sbatch script
    ({"topology": {"roles": {"h$(id)": {"kind": "dp-head"}}}},
     "==> At key: h$(id)\n=====> a role name is letters"),
    ({"topology": {"roles": {"head:0": {"kind": "dp-head"}}}}, "a role name is letters"),
])
def test_invalid_values_fail_with_a_breadcrumb(tmp_path: Path, change: dict[str, object],
                                               needle: str) -> None:
    with pytest.raises(SchemaError) as info:
        load_recipe(variant(tmp_path, change))
    assert needle in str(info.value)


def test_concurrency_doubling_clamps_to_the_end() -> None:
    assert doubling(1, 6) == (1, 2, 4, 6)
    assert doubling(1, 64) == (1, 2, 4, 8, 16, 32, 64)
    assert doubling(256, 256) == (256,)


def test_env_variables_in_paths_expand(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_TINY_MODEL", str(tmp_path / "m"))
    recipe = load_recipe(REPO / "recipes" / "cpu_tiny_moe.yaml")
    assert recipe.model.source == str(tmp_path / "m") and recipe.model.is_local
    assert recipe.model.tokenizer == recipe.model.source


def test_a_variable_in_an_env_value_is_refused_where_nothing_expands_it(tmp_path: Path) -> None:
    """Before: `HF_HOME: ${SCRATCH}/hf` reached the server as that very text (no shell stands
    between m3patch and the server); only topology.network.env expands on each node."""
    with pytest.raises(SchemaError) as info:
        load_recipe(variant(tmp_path, {"env": {"HF_HOME": "${SCRATCH}/hf"}}))
    text = str(info.value)
    assert "At key: env\n==> At key: HF_HOME" in text and "topology.network.env" in text
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe_pd.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["topology"]["roles"]["prefill"]["env"] = {"X": "${HOME}"}
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    with pytest.raises(SchemaError) as info:
        load_recipe(path)
    assert "prefill" in str(info.value) and "passed to the server as written" in str(info.value)
    data["topology"]["roles"]["prefill"].pop("env")
    data["topology"].setdefault("network", {})["env"] = {"X": "${HOME}"}
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    assert load_recipe(path).topology is not None  # expanded on each node


@pytest.mark.parametrize(("ratio", "ok"), [(0.0, True), (0.5, True), (0.9, False), (1.0, False)])
def test_sampled_lengths_must_fit_max_model_len(tmp_path: Path, ratio: float, ok: bool) -> None:
    # cpu_tiny_moe: isl 32 + osl 16 under max-model-len 512 fits up to r < 1; shrink the limit so
    # r = 0.9 overflows: ceil(32*1.9) + ceil(16*1.9) = 61 + 31 = 92 > 90.
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    vllm_args = {**data["vllm-args"], "max-model-len": 90}
    sweep = {**data["sweep"], "range-ratio": ratio, "rows": [{"isl": 32, "osl": 16, "concurrency": [1]}]}
    path = variant(tmp_path, {"vllm-args": vllm_args, "sweep": sweep})
    if ok:
        assert load_recipe(path).sweep.range_ratio == ratio
        return
    with pytest.raises(SchemaError) as info:
        load_recipe(path)
    assert "sweep" in info.value.trail[1] and "range-ratio" in str(info.value)


def test_every_recipe_lets_vllm_wait_as_long_as_its_ready_deadline(pristine_033: Path) -> None:
    """m3patch waits ready-s for /health, but vLLM gives up on its engine after
    VLLM_ENGINE_READY_TIMEOUT_S (default read from the real 0.33.0 envs.py): a recipe whose
    ready-s is longer must raise vLLM's wait itself, not rely on an image to set it."""
    envs = (pristine_033 / "vllm" / "envs.py").read_text()
    default = re.search(r'"VLLM_ENGINE_READY_TIMEOUT_S", "(\d+)"', envs)
    assert default is not None
    for path in RECIPES:
        recipe = load_recipe(path)
        vllm_wait = float(dict(recipe.env).get("VLLM_ENGINE_READY_TIMEOUT_S", default.group(1)))
        assert vllm_wait >= recipe.deadlines.ready_s, path.name


def test_the_cell_deadline_hint_names_a_key_the_schema_accepts(tmp_path: Path) -> None:
    keys = re.findall(r"deadlines\.([a-z-]+)", CELL_DEADLINE_HINT)
    assert keys == ["request-s"]
    for key in keys:
        recipe = load_recipe(variant(tmp_path, {"deadlines": {key: 777}}))
        assert recipe.deadlines.request_s == 777
