"""`m3patch eval RECIPE [--url URL]`: the recipe's accuracy gate against a running server.

    m3patch serve recipes/cpu_tiny_moe.yaml --hold 600 &      # or any server of the recipe
    m3patch eval recipes/cpu_tiny_moe.yaml                     # http://<server.host>:<port>
    m3patch eval recipes/h200_tp8.yaml --url http://node:8000 --run-dir results/h200_tp8/x
    m3patch eval recipes/cpu_tiny_moe.yaml --baseline BASE_RUN/eval/eval.json --max-drop 0.05

`--baseline FILE --max-drop X` judges every task against an earlier run's score as well as its
floor (the recipe's per-task `baseline:` / `max-drop:`, given for this run only): score the
unpatched or known-good server once, then the candidate against it.

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
from m3patch.commands.flags import add_python_flag
from m3patch.errors import UsageError
from m3patch.eval.harness import Endpoint
from m3patch.eval.runner import evaluate, preflight
from m3patch.output import info
from m3patch.recipe.evals import EvalSpec
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipe", type=recipe_path, metavar="RECIPE", help="recipe YAML or name")
    parser.add_argument("--url", metavar="BASE_URL",
                        help="the server to evaluate (default: the recipe's server host:port)")
    parser.add_argument("--run-dir", type=Path,
                        help="where eval/ goes (default: RESULTS/eval-TIME under the recipe's results)")
    add_python_flag(parser, what="lm-eval's interpreter (default: the recipe's eval.python); "
                                 "--lm-eval-python is its older spelling",
                    aliases=("--lm-eval-python",))
    parser.add_argument("--baseline", type=Path, metavar="FILE",
                        help="an earlier run's eval/eval.json (or a harness results file): every "
                             "task fails when it scores more than its max-drop below it")
    parser.add_argument("--max-drop", type=float, metavar="X",
                        help="the drop below --baseline that fails a task (default: the task's "
                             "max-drop in the recipe)")


def run(args: argparse.Namespace) -> int:
    recipe = load_recipe(args.recipe)
    if recipe.eval is None:
        msg = f"{recipe.path}: no eval section; nothing to gate on"
        raise UsageError(msg, hint="add eval: tasks: [...] to the recipe (README: accuracy gate)")
    spec = recipe.eval
    if args.python:
        spec = dataclasses.replace(spec, python=args.python)
    spec = with_baseline(spec, args.baseline, args.max_drop)
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


def with_baseline(spec: EvalSpec, baseline: Path | None, max_drop: float | None) -> EvalSpec:
    """Every task judged against `baseline` with `max_drop` (or its own max-drop)."""
    if baseline is None and max_drop is None:
        return spec
    if baseline is None:
        msg = "--max-drop needs --baseline: the drop is measured against it"
        raise UsageError(msg, hint="m3patch eval RECIPE --baseline BASE_RUN/eval/eval.json --max-drop X")
    if max_drop is not None and not (max_drop >= 0.0 and max_drop < float("inf")):
        msg = f"--max-drop {max_drop:g}: expected a finite number >= 0"
        raise UsageError(msg, hint="a drop in the metric's own units, e.g. --max-drop 0.05")
    tasks = []
    for task in spec.tasks:
        drop = max_drop if max_drop is not None else task.max_drop
        if drop is None:
            msg = f"--baseline: task {task.task} has no max-drop in the recipe"
            raise UsageError(msg, hint="add --max-drop X (the drop below the baseline that fails)")
        tasks.append(dataclasses.replace(task, baseline=baseline, max_drop=drop))
    return dataclasses.replace(spec, tasks=tuple(tasks))
