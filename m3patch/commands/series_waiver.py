"""`m3patch series waiver --pr N`: InferenceX's docs/waiver/<N>.md for a recipe's series.

The recipe names the series, the image and the platform whose markers prove the patches ran;
the series manifest gives each patch's summary, why, upstream and drop-when; the lock gives the
patched files, the patch file its hunks. Rendering is m3patch.patching.waiver (pure).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from m3patch.bench.spec import image_of
from m3patch.commands.common import say
from m3patch.errors import UsageError
from m3patch.fsio import write_output
from m3patch.patching.diffs import parse_patch
from m3patch.patching.ledger import digest
from m3patch.patching.series import MANIFEST, Series, load_series
from m3patch.patching.series_lock import LOCK
from m3patch.patching.waiver import (
    Waiver,
    WaiverPatch,
    check_entries,
    master_config,
    patch_files,
    render,
)
from m3patch.recipe.loader import Recipe, load_recipe
from m3patch.recipe.names import recipe_path
from m3patch.yamlio import load_yaml_file

STDOUT = "-"


def write_waiver(args: argparse.Namespace) -> int:
    if args.pr < 1:
        msg = f"--pr must be a PR number, got {args.pr}"
        raise UsageError(msg, hint="m3patch series waiver --pr 2508")
    path = recipe_path(args.recipe)
    recipe = load_recipe(path)
    manifest = recipe.series_dir / MANIFEST
    check_entries(load_yaml_file(manifest), str(manifest))
    series = load_series(recipe.series_dir)
    text = render(_waiver(args, recipe, series, str(args.recipe)))
    if args.out == STDOUT:
        say(text.rstrip("\n"))
        return 0
    out = Path(args.out) if args.out else Path("docs") / "waiver" / f"{args.pr}.md"
    write_output(out, text.encode("utf-8"), flag="--out")
    say(f"m3patch: wrote {out}: waiver for PR #{args.pr}, {len(series.patches)} patch(es) of "
        f"{series.id}; file it in that PR")
    return 0


def _waiver(args: argparse.Namespace, recipe: Recipe, series: Series, shown: str) -> Waiver:
    ident = recipe.inferencex
    entry = args.config_entry or (ident.config_entry if ident else None)
    if not entry:
        msg = f"{recipe.path}: no InferenceX master-config entry to name in the waiver"
        raise UsageError(msg, hint=f"pass --config-entry NAME, or set inferencex.config-entry "
                         f"in {recipe.path}")
    image = args.image or image_of(recipe)
    if not image:
        msg = f"{recipe.path}: no pinned image to name in the waiver (target.image is null)"
        raise UsageError(msg, hint="pass --image IMAGE, or set target.image in the recipe")
    lock = series.require_lock()
    pins = {pin.id: pin for pin in lock.patches}
    platform = recipe.target.platform
    patches = []
    for entry_ in series.patches:
        patch_path = series.patch_path(entry_)
        parsed = parse_patch(patch_path.read_bytes(), entry_.file)
        hunks = {f.path: len(f.hunks) for f in parsed.files}
        markers = tuple(m for m in entry_.markers if not m.platforms or platform in m.platforms)
        patches.append(WaiverPatch(entry_, patch_files(pins[entry_.id].files, hunks), markers))
    return Waiver(
        pr=args.pr, config_entry=entry, master_config=master_config(platform), image=image,
        recipe=shown, platform=platform, series_id=series.id,
        vllm_version=series.target_version,
        lock_sha256=digest((series.directory / LOCK).read_bytes()), patches=tuple(patches),
        recipe_markers=recipe.markers)
