"""`m3patch eval RECIPE [--url URL]`: the recipe's accuracy gate against a running server.

    m3patch serve recipes/cpu_tiny_moe.yaml --hold 600 &      # or any server of the recipe
    m3patch eval recipes/cpu_tiny_moe.yaml                     # http://<server.host>:<port>
    m3patch eval recipes/h200_tp8.yaml --url http://node:8000 --run-dir results/h200_tp8/x

Runs lm-evaluation-harness (its own venv: scripts/setup/setup_lm_eval.sh, or eval.python) for every
task of the recipe's `eval:` section; writes RUN/eval/eval.json (scores, sample counts, floors,
provenance) beside the harness's own files; exits 20 when a score is under its floor, 21 when
no score could be read. `serve --bench` and `ci` run the same step inside the run pipeline.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from pathlib import Path

from m3patch.bench import spec as bench_spec
from m3patch.bench.runner import health_probe
from m3patch.errors import UsageError
from m3patch.eval.harness import Endpoint
from m3patch.eval.runner import evaluate, preflight
from m3patch.output import info
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path, metavar="RECIPE", help="recipe YAML or name")
    parser.add_argument("--url", metavar="BASE_URL",
                        help="the server to evaluate (default: the recipe's server host:port)")
    parser.add_argument("--run-dir", type=Path,
                        help="where eval/ goes (default: RESULTS/eval-TIME under the recipe's results)")
    parser.add_argument("--lm-eval-python", metavar="PATH",
                        help="lm-eval's interpreter (default: the recipe's eval.python)")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    if recipe.eval is None:
        msg = f"{recipe.path}: no eval section; nothing to gate on"
        raise UsageError(msg, hint="add eval: tasks: [...] to the recipe (README: accuracy gate)")
    spec = recipe.eval
    if args.lm_eval_python:
        spec = dataclasses.replace(spec, python=args.lm_eval_python)
    preflight(spec, recipe.path)
    base_url = (args.url or f"http://{recipe.host}:{recipe.port}").rstrip("/")
    run_dir = args.run_dir or recipe.results_dir / time.strftime("eval-%Y%m%d-%H%M%S")
    rerun = f"m3patch eval {args.recipe} --url {base_url}"
    check = health_probe(base_url, rerun)
    check()  # a server that is not there fails here, before the harness starts
    provenance = bench_spec.provenance(recipe, recipe.target.python,
                                       f"external {base_url} (not started or gated by m3patch)")
    endpoint = Endpoint(base_url, recipe.model.served_name, recipe.deadlines.request_s)
    outcome = evaluate(spec, run_dir, endpoint, check_server=check, provenance=provenance)
    info(f"eval passed: {outcome.summary()} ({outcome.record})")
    return 0
