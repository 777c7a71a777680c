"""A recipe named by path or by name: `recipes/mi300x_tp8.yaml` or `mi300x_tp8`.

A name is looked up among the recipes that ship with m3patch (m3patch.shipped: the checkout's
`recipes/` or the installed copy), so `m3patch serve cpu_tiny_moe` works from any folder. A file
that exists always wins, and anything that looks like a path is left for the loader to open, so
an explicit path keeps meaning exactly that file. A bare name that is both a shipped recipe and a
NAME.yaml here is refused: either could be meant.
"""

from __future__ import annotations

from pathlib import Path

from m3patch.errors import UsageError
from m3patch.fsio import path_is
from m3patch.schema import suggest
from m3patch.shipped import shipped_dir

SUFFIXES = (".yaml", ".yml")


def shipped_recipe_names() -> tuple[str, ...]:
    """Names of the shipped recipes (file stems), sorted; empty when none ship."""
    folder = shipped_dir("recipes")
    if folder is None:
        return ()
    return tuple(sorted(p.stem for p in folder.glob("*.yaml") if p.is_file()))


def is_bare_name(text: str) -> bool:
    """No folder part and no path prefix: `mi300x_tp8` or `mi300x_tp8.yaml`, not `./x`."""
    return bool(text) and "/" not in text and not text.startswith(("~", ".", "$"))


def recipe_path(text: str) -> Path:
    """The recipe file for a RECIPE argument (argparse type): an existing file, a path, or a
    shipped recipe's name; an unknown bare name is a usage error listing the shipped names."""
    path = Path(text)
    if path_is(path, "file") or not is_bare_name(text):
        return path
    stem = next((text[: -len(s)] for s in SUFFIXES if text.endswith(s)), text)
    folder = shipped_dir("recipes")
    if folder is not None and path_is(folder / f"{stem}.yaml", "file"):
        _refuse_local_twin(stem, folder / f"{stem}.yaml")
        return folder / f"{stem}.yaml"
    names = shipped_recipe_names()
    msg = f"{text}: no such recipe file, and no shipped recipe is named {stem!r}.{suggest(stem, names)}"
    shown = ", ".join(names) if names else "none ship with this m3patch"
    raise UsageError(msg, hint=f"give a recipe file path, or a shipped recipe name ({shown})")


def _refuse_local_twin(stem: str, shipped: Path) -> None:
    """A bare name that is both a shipped recipe and a file here (`mine` and ./mine.yaml): the
    user may mean either, and taking the shipped one silently would run another recipe."""
    for suffix in SUFFIXES:
        local = Path(f"{stem}{suffix}")
        if path_is(local, "file") and not _same_file(local, shipped):
            msg = (f"{stem}: both a shipped recipe ({shipped}) and a file here ({local}); "
                   "say which")
            raise UsageError(msg, hint=f"give ./{local} for the file here, or {shipped}")


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.samefile(b)
    except OSError:
        return False
