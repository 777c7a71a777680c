"""`m3patch model check RECIPE` and `m3patch model fetch RECIPE`.

    check   is the recipe's model (and draft, tokenizer) on disk where the offline launch reads
            it: a local folder, or the Hugging Face cache at the pinned `model.revision`
            (read-only; exit 19 naming what is missing)
    fetch   download whatever of it is not there with huggingface_hub (`pip install
            'm3patch[models]'`), honouring HF_TOKEN, HF_HOME / HF_HUB_CACHE and the pinned
            revision, then check again

`serve`, `bench` and `ci` run the same check before they apply the series.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m3patch.output import info, table
from m3patch.recipe import model_files
from m3patch.recipe.loader import load_recipe


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    for name, text in (("check", "is the recipe's model on disk (local folder or HF cache)?"),
                       ("fetch", "download the recipe's model, draft and tokenizer (huggingface_hub)")):
        action = sub.add_parser(name, help=text)
        action.add_argument("recipe", type=Path, metavar="RECIPE", help="recipe YAML")


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
    model_files.require_present(recipe, env)
    info(f"{recipe.path}: model files present; the offline launch can load them")
    return 0
