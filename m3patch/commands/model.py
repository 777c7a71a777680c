"""`m3patch model check RECIPE` and `m3patch model fetch RECIPE`.

    check   is the recipe's model (and draft, tokenizer) on disk where the offline launch reads
            it: a local folder, or the Hugging Face cache at the pinned `model.revision`
            (read-only; exit 19 naming what is missing)
    fetch   download whatever of it is not there with huggingface_hub (`pip install
            'm3patch[models]'`), honouring HF_TOKEN, HF_HOME / HF_HUB_CACHE and the pinned
            revision, then check again

`serve`, `bench` and `ci` run the same check before they apply the series. A recipe with an
`eval:` section has its hub datasets checked too (the eval runs offline); `fetch` downloads
them with lm-eval's own interpreter (eval.python) into the Hugging Face cache.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from m3patch.bench.agentic.preflight import fetch_trace, require_trace, trace_missing
from m3patch.bench.agentic.synthesize import cache_state, synthesized
from m3patch.eval import datasets
from m3patch.output import info, table
from m3patch.recipe import model_files
from m3patch.recipe.agentic import AGENTIC_CODE, AgenticScenario
from m3patch.recipe.evals import EvalSpec
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("check", "is the recipe's model on disk (local folder or HF cache)?"),
                       ("fetch", "download the recipe's model, draft and tokenizer (huggingface_hub)")):
        action = sub.add_parser(name, help=text)
        action.add_argument("recipe", type=recipe_path, metavar="RECIPE",
                            help="recipe YAML or a shipped recipe's name (e.g. mi300x_tp8)")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    env = model_files.launch_env(recipe)
    cache = model_files.hub_cache(recipe, env)
    if args.action == "fetch":
        model_files.fetch(recipe, env)
    found = model_files.check(recipe, env)
    table(f"model files of {recipe.name} (Hugging Face cache {cache})",
          ["part", "source", "revision", "state", "folder / problem"],
          [[p.need.role, p.need.source, p.need.revision or ("-" if p.need.is_local else "main"),
            "present" if p.present else "MISSING", p.folder if p.present else p.problem]
           for p in found])
    if recipe.eval is not None:  # listed whether or not the model is there: one look, all parts
        _eval_datasets(recipe.eval, recipe.path, fetch=args.action == "fetch")
    model_files.require_present(recipe, env)
    info(f"{recipe.path}: model files present; the offline launch can load them")
    if recipe.eval is not None:
        datasets.require_cached(recipe.eval, recipe.path)
        hub = sum(t.dataset is not None for t in recipe.eval.tasks)
        info(f"{recipe.path}: eval datasets present ({hub} from the hub, "
             f"{len(recipe.eval.tasks) - hub} local); the offline eval can load them")
    if recipe.sweep.agentic is not None:
        _trace(recipe.sweep.agentic, recipe.path, fetch=args.action == "fetch")
    return 0


def _trace(scenario: AgenticScenario, path: Path, *, fetch: bool) -> None:
    """The agentic scenario's trace: a hub dataset fetched (AIPerf's interpreter) and checked
    like an eval dataset; a local file checked; a synthesized one needs nothing."""
    trace = scenario.trace
    if fetch and trace.kind == "public-dataset" and trace_missing(trace) is not None:
        info(f"trace dataset fetched: {fetch_trace(trace, scenario.client_python)}")
    if trace.kind == AGENTIC_CODE:
        _agentic_code(scenario, path, fetch=fetch)
        return
    problem = trace_missing(trace)
    table("agentic trace", ["source", "state"],
          [[trace.dataset or str(trace.path or trace.label), problem or "present"]])
    require_trace(trace, path)
    info(f"{path}: agentic trace {trace.label} present; the offline replay can load it")


def _agentic_code(scenario: AgenticScenario, path: Path, *, fetch: bool) -> None:
    """fetch: synthesized into the cache (or its entry checked); check: the manifest on disk and
    whether the cache holds the synthesis (a run makes it before any server starts)."""
    trace = scenario.trace
    require_trace(trace, path)
    if fetch:
        made = synthesized(trace, scenario.client_python)
        state = (f"synthesized: {made.summary.sessions} sessions, {made.summary.rows} turns, "
                 f"sha256 {made.sha256[:16]}")
        where = str(made.cached)
    else:
        cached, problem = cache_state(trace)
        where, state = str(cached), problem or "cached, valid"
    table("agentic trace", ["source", "cache entry", "state"], [[trace.label, where, state]])
    info(f"{path}: agentic-code manifest {trace.manifest} present")


def _eval_datasets(spec: EvalSpec, path: Path, *, fetch: bool) -> None:
    """The eval's hub datasets and their state (fetched first with `fetch`)."""
    if fetch:
        for line in datasets.fetch(spec, path):
            info(f"eval dataset fetched: {line}")
    hub = [t for t in spec.tasks if t.dataset is not None]
    cache = model_files.env_hub_cache(os.environ)
    table(f"eval datasets (Hugging Face cache {cache})", ["task", "dataset", "state"],
          [[t.task, t.dataset, "present" if datasets.is_cached(t, cache) else "MISSING"]
           for t in hub])
