"""`m3patch matrix RECIPE ...`: the CI job list as GitHub Actions `strategy.matrix` JSON.

    echo "matrix=$(m3patch matrix recipes/*.yaml)" >> "$GITHUB_OUTPUT"
    # then: strategy: {matrix: ${{ fromJSON(needs.plan.outputs.matrix) }}}
    #       run: m3patch bench ${{ matrix.recipe }} --only ${{ matrix.cell-id }}
    m3patch matrix --evals-only recipes/*.yaml   # eval jobs only (InferenceX's evals-only)
    m3patch matrix --all-evals recipes/*.yaml    # an eval job per recipe; each must declare one
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from m3patch.bench.matrix import EvalJobs, build_matrix
from m3patch.bench.spec import matrix_recipe
from m3patch.commands.recipe import check_static
from m3patch.errors import FileNameEncoding
from m3patch.output import info
from m3patch.recipe.loader import load_recipe
from m3patch.recipe.names import recipe_path


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("recipes", nargs="+", metavar="RECIPE",
                        help="recipe files or shipped recipe names; the matrix names each as "
                             "given (a name stays a name, a relative path relative), so it "
                             "works on the machine that runs the jobs")
    parser.add_argument("--per", choices=("cell", "group", "recipe"), default="cell",
                        help="one job per sweep cell (default, InferenceX's shape), per server "
                             "group (cells that share a server: `only` lists them), or per recipe")
    evals = parser.add_mutually_exclusive_group()
    evals.add_argument("--evals-only", dest="evals", action="store_const",
                       const=EvalJobs.EVALS_ONLY, default=EvalJobs.NONE,
                       help="only eval jobs, for the recipes with an eval section (no throughput)")
    evals.add_argument("--all-evals", dest="evals", action="store_const",
                       const=EvalJobs.ALL_EVALS,
                       help="an eval job for every recipe given (no throughput); each needs an eval")
    parser.add_argument("--indent", type=int, default=None,
                        help="pretty-print (default: one line, as $GITHUB_OUTPUT needs)")


def require_utf8_name(text: str) -> str:
    """A recipe name the matrix can hand on: its JSON is read by CI tools that cannot decode the
    lone surrogate a file name's non-UTF-8 byte becomes (`bad\\udcff.yaml`)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(text).decode("utf-8", "backslashreplace")
        msg = (f"{shown}: the recipe's file name is not UTF-8, so the matrix JSON (read by CI) "
               "cannot name it")
        raise FileNameEncoding(msg, hint="rename the recipe file to a UTF-8 name "
                                         "(e.g. `mv` it to plain ASCII), then re-run") from None
    return text


def distinct_recipes(texts: list[str]) -> list[tuple[str, Path]]:
    """Each recipe file once, as first named: `x`, `recipes/x.yaml` and its absolute path are
    one recipe, whose jobs a matrix lists once (twice, CI would run every one twice)."""
    seen: dict[Path, list[str]] = {}
    for text in texts:
        require_utf8_name(text)
        # realpath, not resolve(): a link loop is the loader's to refuse, never a crash here
        seen.setdefault(Path(os.path.realpath(recipe_path(text))), []).append(text)
    for names in seen.values():
        if len(names) > 1:
            info(f"matrix: {names[0]} given {len(names)} times ({', '.join(names)}); its jobs "
                 "are listed once")
    return [(names[0], path) for path, names in seen.items()]


def run(args: argparse.Namespace) -> int:
    recipes = []
    for text, path in distinct_recipes(args.recipes):
        recipe = load_recipe(path)
        # No job for a recipe `recipe validate` refuses: the matrix job would fail on its
        # runner (its launch check is the same), after the whole set was scheduled. The plan
        # job's shell is not the runners': its M3PATCH_* variables are not judged.
        check_static(recipe, env={})
        # matrix_recipe takes the cells from spec.recipe_cells, the function `bench --only`
        # selects from, and names the recipe in a sweep error.
        recipes.append(matrix_recipe(recipe, text))
    matrix = build_matrix(recipes, per=args.per, evals=args.evals)
    sys.stdout.write(json.dumps(matrix, indent=args.indent) + "\n")
    return 0
