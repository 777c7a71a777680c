"""`m3patch matrix`: GitHub Actions strategy.matrix JSON from the shipped recipes and plain rows."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest
import yaml

from m3patch.bench.cells import Parallelism, sweep_cells
from m3patch.bench.matrix import GITHUB_MATRIX_LIMIT, MatrixRecipe, build_matrix
from m3patch.bench.runner import select_cells
from m3patch.errors import UsageError
from m3patch.main import main
from m3patch.recipe.loader import doubling, load_recipe

REPO = Path(__file__).resolve().parents[2]


def _recipe(par: Parallelism, rows: tuple[tuple[int, int, tuple[int, ...]], ...]) -> MatrixRecipe:
    """Per-cell sizing, as spec.matrix_recipe gives a GPU recipe: one server per isl/osl."""
    cells = sweep_cells(rows, par, 0.8)
    shapes = list(dict.fromkeys((c.seq.isl, c.seq.osl) for c in cells))
    groups = tuple(tuple(c.cell_id for c in cells if (c.seq.isl, c.seq.osl) == s) for s in shapes)
    return MatrixRecipe("recipes/x.yaml", "x", "rocm-gfx942", "img:1", "org/model", par, cells,
                        groups=groups, group_max_model_lens=tuple(i + o + 256 for i, o in shapes))


def test_doubling_clamps_the_last_step_to_the_end() -> None:
    assert doubling(1, 6) == (1, 2, 4, 6)
    assert doubling(4, 4) == (4,)
    assert doubling(16, 128) == (16, 32, 64, 128)


def test_one_job_per_cell_with_inferencex_fields() -> None:
    jobs = build_matrix([_recipe(Parallelism(tp=8), ((8192, 1024, doubling(1, 6)),))])["include"]
    assert [j["conc"] for j in jobs] == [1, 2, 4, 6]
    job = jobs[0]
    assert job["max-model-len"] == 8192 + 1024 + 256
    assert job["exp-name"] == "x_8k1k"
    assert job["cell-id"] == "isl8192-osl1024-tp8-pp1-ep1-dp1-c1"
    assert (job["tp"], job["ep"], job["dp-attn"], job["gpus"]) == (8, 1, False, 8)


def test_the_matrix_runs_the_rows_concurrencies_and_adds_none() -> None:
    # The latency point (concurrency 1 for TP-only rows) is the recipe's to write: a job the
    # matrix invented would be a cell `m3patch bench --only` refuses.
    tp_only = build_matrix([_recipe(Parallelism(tp=8), ((1024, 1024, (4, 8)),))])["include"]
    assert [j["conc"] for j in tp_only] == [4, 8]
    ep = build_matrix([_recipe(Parallelism(tp=8, ep=8), ((1024, 1024, (128, 256)),))])["include"]
    assert [j["conc"] for j in ep] == [128, 256]


def test_per_recipe_jobs_and_the_github_limit() -> None:
    recipe = _recipe(Parallelism(tp=8), ((1024, 1024, doubling(1, 256)), (8192, 1024, (1, 2))))
    (job,) = build_matrix([recipe], per="recipe")["include"]
    assert job["cells"] == 11 and job["max-model-len"] == 8192 + 1024 + 256
    many = _recipe(Parallelism(tp=8), ((1024, 1024, tuple(range(1, GITHUB_MATRIX_LIMIT + 2))),))
    with pytest.raises(UsageError, match="at most 256") as info:
        build_matrix([many])
    assert "--per recipe" in str(info.value.hint)


def test_cli_over_every_shipped_recipe(capsys: pytest.CaptureFixture[str]) -> None:
    recipes = sorted(str(p.relative_to(REPO)) for p in (REPO / "recipes").glob("*.yaml"))
    assert main(["matrix", *[str(REPO / r) for r in recipes]]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1  # one line, as $GITHUB_OUTPUT needs
    jobs = json.loads(out)["include"]
    assert {Path(j["recipe"]).name for j in jobs} == {Path(r).name for r in recipes}
    agentic = [j for j in jobs if j.get("scenario-type") == "agentic-coding"]
    # InferenceX's agentic entries: one job per concurrency, the tier and duration named.
    mi300x = [(j["kv-offloading"], j["conc"]) for j in agentic if j["name"] == "mi300x_agentic_mtp"]
    assert mi300x == [("none", 2), ("none", 4), ("none", 6), ("none", 8), ("none", 10), ("dram", 16)]
    assert {j["kv-offload-backend"]["name"] for j in agentic if j["kv-offloading"] == "dram"} == {
        "lmcache"}
    for job in jobs:
        if job in agentic:
            continue
        # Exactly what the job's server gets: per cell on GPU recipes (InferenceX's sizing),
        # the one value the others state.
        recipe = load_recipe(Path(job["recipe"]))
        stated = dict(recipe.vllm_args_raw)["max-model-len"] if not (
            recipe.sweep.per_cell_max_model_len) else job["isl"] + job["osl"] + 256
        sized = 512 if job["name"] == "cpu_tiny_moe" else stated
        assert job["max-model-len"] == sized, job["cell-id"]
        if job["ep"] == 1 and job["dp"] == 1 and not job["dp-attn"]:
            starts = [j["conc"] for j in jobs if j["recipe"] == job["recipe"]
                      and (j["isl"], j["osl"]) == (job["isl"], job["osl"])]
            assert min(starts) == 1, job["cell-id"]
    cpu = [j for j in jobs if j["name"] == "cpu_tiny_moe"]
    assert len(cpu) == 3  # the CI end-to-end sweep
    # InferenceX's last MiniMax-M3 MI300X TP8 config: 1-256 at 1k1k and 8k1k.
    for name in ("mi300x_tp8", "mi300x_pr1753_tp8"):
        for isl in (1024, 8192):
            concs = [j["conc"] for j in jobs if j["name"] == name and j["isl"] == isl]
            assert concs == [1, 2, 4, 8, 16, 32, 64, 128, 256], (name, isl)


def test_cli_names_the_recipe_of_a_bad_sweep(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    text = (REPO / "recipes" / "cpu_tiny_moe.yaml").read_text()
    bad = tmp_path / "bad.yaml"
    text = re.sub(r"range-ratio: [0-9.]+", "range-ratio: 1.0", text)
    bad.write_text(text.replace("series: vllm-", f"series: {REPO}/patches/vllm-"))
    assert main(["matrix", str(bad)]) == 2
    err = capsys.readouterr().err
    # The recipe loader refuses it first, with the breadcrumb to the key.
    assert f"File {bad}" in err and "At key: range-ratio" in err
    assert "range-ratio must be in [0, 1), got 1.0" in err


def _matrix_cell_ids(recipe: Path, capsys: pytest.CaptureFixture[str]) -> list[str]:
    assert main(["matrix", str(recipe)]) == 0
    return [job["cell-id"] for job in json.loads(capsys.readouterr().out)["include"]]


def _late_start_variant(tmp_path: Path, name: str, parallelism: dict[str, object]) -> Path:
    """The CPU recipe with a sweep that starts above concurrency 1."""
    data = yaml.safe_load((REPO / "recipes" / "cpu_tiny_moe.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.32.0")
    data["parallelism"] = parallelism
    data["sweep"]["rows"] = [{"isl": 32, "osl": 16, "concurrency": [2, 4]},
                             {"isl": 64, "osl": 16, "conc-start": 4, "conc-end": 8}]
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def test_bench_only_accepts_every_cell_the_matrix_prints(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`matrix` and `bench --only` share one cell function: no job the bench would refuse."""
    late_tp = _late_start_variant(tmp_path, "late_tp", {"tp": 1})
    late_ep = _late_start_variant(tmp_path, "late_ep", {"tp": 2, "ep": 2})
    for path in [*sorted((REPO / "recipes").glob("*.yaml")), late_tp, late_ep]:
        ids = _matrix_cell_ids(path, capsys)
        recipe = load_recipe(path)
        for cell_id in ids:  # what each CI job runs: m3patch bench RECIPE --only CELL
            assert [c.cell_id for c in select_cells(recipe, [cell_id])] == [cell_id], path
        assert [c.cell_id for c in select_cells(recipe, ())] == ids, path  # and nothing else
    for late in (late_tp, late_ep):  # exactly the rows' concurrencies, TP-only or not
        assert [i.rsplit("-", 1)[1] for i in _matrix_cell_ids(late, capsys)] == [
            "c2", "c4", "c4", "c8"]


def test_matrix_output_travels_to_another_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """A recipe given by name stays that name, a relative path stays relative, and the model
    keeps `~` as the recipe writes it: the jobs run on machines other than the one that made
    the matrix."""
    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    data["model"] = {"source": "~/models/MiniMax-M3", "served-name": "m3"}
    (tmp_path / "mine.yaml").write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    assert main(["matrix", "--per", "recipe", "mi300x_tp8", "mine.yaml"]) == 0
    jobs = json.loads(capsys.readouterr().out)["include"]
    assert [(j["recipe"], j["model"]) for j in jobs] == [
        ("mi300x_tp8", "MiniMaxAI/MiniMax-M3-MXFP8"), ("mine.yaml", "~/models/MiniMax-M3")]
    assert str(Path.home()) not in json.dumps(jobs) and str(REPO) not in json.dumps(jobs)


def test_a_recipe_name_that_is_not_utf8_is_refused(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """A non-UTF-8 byte in a file name becomes a lone surrogate ('\\udcff') that the JSON would
    carry to CI, which cannot decode it: refused as the tree commands refuse such a name (35)."""
    data = yaml.safe_load((REPO / "recipes" / "mi300x_tp8.yaml").read_text())
    data["series"] = str(REPO / "patches" / "vllm-0.33.0")
    name = os.fsdecode(b"bad\xff.yaml")
    (tmp_path / name).write_text(yaml.safe_dump(data))
    monkeypatch.chdir(tmp_path)
    assert main(["matrix", name]) == 35
    out, err = capsys.readouterr()
    assert out == ""
    assert "bad\\xff.yaml: the recipe's file name is not UTF-8" in err
    assert err.count("m3patch: error:") == 1 and "\udcff" not in err
