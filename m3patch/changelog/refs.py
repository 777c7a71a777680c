"""Cross-references from entries to the repository: recipes, series, patch ids (pure).

`config-keys` name recipes, the YAML files directly in recipes/ (its subfolders hold other data:
the eval tasks under recipes/evals/ are no recipes): a key matches a recipe file by its path from the repository root
(`recipes/cpu_tiny_moe.yaml`), its path under recipes/ (`cpu_tiny_moe.yaml`), that without
the suffix (`cpu_tiny_moe`) or the recipe's `inferencex.config-entry`; `*`, `?` and `[...]` globs
work, and every key, glob or not, must match at least one recipe (a typo would otherwise select
nothing and pass).

An InferenceX checkout (its master configs present) is judged as its own check judges it: each
key must be an entry of those master configs, or a `*` glob matching one; a recipe name that
InferenceX does not know would pass here and fail there.
"""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from m3patch.changelog.entries import ChangelogEntry
from m3patch.changelog.findings import Finding, error
from m3patch.schema import suggest

RECIPES_DIR = "recipes"
PATCHES_DIR = "patches"
RECIPE_SUFFIXES = (".yaml", ".yml")
# Where InferenceX keeps the entries its changelog's config-keys name (older checkouts: .github/).
MASTER_CONFIGS = ("configs/amd-master.yaml", "configs/nvidia-master.yaml",
                  ".github/configs/amd-master.yaml", ".github/configs/nvidia-master.yaml")


@dataclass(frozen=True)
class Catalog:
    """What the entries may name, read from the head (work tree or git ref)."""

    recipes: tuple[str, ...]  # repository-relative paths of the YAML files directly in recipes/
    series: Mapping[str, tuple[str, ...]] = field(default_factory=dict)  # folder -> patch ids
    series_errors: Mapping[str, str] = field(default_factory=dict)  # folder -> why unreadable
    config_entries: Mapping[str, str] = field(default_factory=dict)  # recipe path -> config-entry
    recipes_shipped: bool = False  # no recipes/ here: the recipes that ship with m3patch
    # An InferenceX checkout: the master configs read and their entries; () elsewhere.
    master_files: tuple[str, ...] = ()
    master_entries: tuple[str, ...] = ()


def is_recipe_path(path: str) -> bool:
    """A recipe: a YAML file directly in recipes/ (as recipe names resolve); not eval tasks."""
    head, _, name = path.rpartition("/")
    return head == RECIPES_DIR and name.endswith(RECIPE_SUFFIXES)


def recipe_names(path: str) -> tuple[str, ...]:
    under = path[len(RECIPES_DIR) + 1 :] if path.startswith(f"{RECIPES_DIR}/") else path
    stem = next((under[: -len(s)] for s in RECIPE_SUFFIXES if under.endswith(s)), under)
    return path, under, stem


def matching_recipes(key: str, catalog: Catalog) -> list[str]:
    return [
        path for path in catalog.recipes
        if any(fnmatch.fnmatchcase(name, key)
               for name in (*recipe_names(path), catalog.config_entries.get(path, "")) if name)
    ]


def selected_recipes(keys: list[str], catalog: Catalog) -> list[str]:
    """The recipes `keys` select, as a RECIPE argument names them: a path in this repository,
    or a shipped recipe's name where the repository has no recipes/ of its own."""
    paths = {p for key in keys for p in matching_recipes(key, catalog)}
    return sorted(recipe_names(p)[2] if catalog.recipes_shipped else p for p in paths)


def matching_master_entries(key: str, catalog: Catalog) -> list[str]:
    """InferenceX's own rule: `*` is the only wildcard, anything else is literal."""
    pattern = re.compile(re.escape(key).replace(r"\*", ".*"))
    return [name for name in catalog.master_entries if pattern.fullmatch(name)]


def reference_findings(entry: ChangelogEntry, catalog: Catalog) -> list[Finding]:
    missing = _missing_master_entry if catalog.master_files else _missing_recipe
    findings = [missing(entry, key, catalog) for key in entry.config_keys]
    findings += _series_findings(entry, catalog)
    return [f for f in findings if f is not None]


def _missing_master_entry(entry: ChangelogEntry, key: str, catalog: Catalog) -> Finding | None:
    if matching_master_entries(key, catalog):
        return None
    files = ", ".join(catalog.master_files)
    nearest = suggest(key, list(catalog.master_entries)) if catalog.master_entries else ""
    msg = (f"config-keys: {key!r} is no entry of this InferenceX checkout's master configs "
           f"({files}), so InferenceX's own check refuses it.{nearest}")
    return error("config-keys", msg, entry.line,
                 "name the recipe's inferencex.config-entry (`m3patch bench compare BASE NEW "
                 f"--changelog-entry` writes it), or an entry of {files}")


def _missing_recipe(entry: ChangelogEntry, key: str, catalog: Catalog) -> Finding | None:
    if matching_recipes(key, catalog):
        return None
    kind = "glob " if any(c in key for c in "*?[") else ""
    stems = sorted(recipe_names(p)[2] for p in catalog.recipes)
    nearest = suggest(key, stems) if stems else f" There are no recipes under {RECIPES_DIR}/."
    msg = f"config-keys: {kind}{key!r} matches no recipe under {RECIPES_DIR}/.{nearest}"
    return error("config-keys", msg, entry.line,
                 f"fix the key (`ls {RECIPES_DIR}/*.yaml` lists the {len(stems)} recipe(s)), or "
                 f"add {RECIPES_DIR}/{key}.yaml")


def _series_findings(entry: ChangelogEntry, catalog: Catalog) -> list[Finding]:
    if entry.series is None:
        return []
    where = f"{PATCHES_DIR}/{entry.series}/series.yaml"
    if entry.series in catalog.series_errors:
        msg = f"series {entry.series!r}: {where} is unreadable: {catalog.series_errors[entry.series]}"
        return [error("series", msg, entry.line, f"m3patch series show {PATCHES_DIR}/{entry.series}")]
    if entry.series not in catalog.series:
        known = ", ".join(sorted(catalog.series)) or "none"
        msg = f"series {entry.series!r} does not exist: no {where} (known: {known})"
        return [error("series", msg, entry.line, f"name a folder under {PATCHES_DIR}/")]
    ids = catalog.series[entry.series]
    return [
        error("patches", f"patch {pid!r} is not in {where} (ids: {', '.join(ids) or 'none'})",
              entry.line, f"use a patch id listed in {where}")
        for pid in entry.patches if pid not in ids
    ]
