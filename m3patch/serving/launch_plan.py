"""From a recipe to a launch: the series' markers, the argv and env (pure), and the patched tree.

`plan_launch` is pure (it reads the series manifest, nothing else), so `recipe show` and
`serve --dry-run` print exactly what `serve` would run. `ensure_tree` is the effect: apply and
verify the recipe's series on the tree the launch interpreter imports (patching.api.ensure_series),
fail closed; `prepare_tree` checks the model first, for a launch that applies on its own.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from m3patch import markers as mk
from m3patch.errors import UsageError
from m3patch.output import info
from m3patch.patching.api import ensure_series
from m3patch.patching.locate import VllmTree, find_vllm
from m3patch.patching.series import load_series
from m3patch.recipe.loader import Recipe
from m3patch.recipe.model_files import require_present
from m3patch.serving.supervisor import LaunchSpec
from m3patch.serving.vllm_parser import LaunchCheck, check_launch

if TYPE_CHECKING:
    from m3patch.patching.api import EnsuredTree

VLLM_MAIN = ("-m", "vllm.entrypoints.cli.main", "serve")
PROVENANCE_PREFIX = "m3patch[provenance]: "
# Keep all traffic on loopback and stop vLLM / HF from phoning home (shared/design/vllm-cpu.md).
LOOPBACK_ENV = (
    ("HF_HUB_OFFLINE", "1"), ("TRANSFORMERS_OFFLINE", "1"), ("VLLM_NO_USAGE_STATS", "1"),
    ("DO_NOT_TRACK", "1"), ("VLLM_HOST_IP", "127.0.0.1"), ("PYTHONUNBUFFERED", "1"),
)
# vLLM copies only some prefixes (VLLM_, HF_, NCCL_, ...) to Ray actors (vllm/ray/ray_env.py):
# without this the series' M3PATCH_* gates never reach a Ray worker, which then runs `auto`.
RAY_PREFIXES_VAR = "VLLM_RAY_EXTRA_ENV_VAR_PREFIXES_TO_COPY"
GATE_PREFIX = "M3PATCH_"


def with_gate_prefix(prefixes: str) -> str:
    """vLLM's comma-separated extra prefixes plus M3PATCH_, keeping what the user/recipe set."""
    kept = [p.strip() for p in prefixes.split(",") if p.strip()]
    return ",".join(kept if GATE_PREFIX in kept else [*kept, GATE_PREFIX])


@dataclass(frozen=True)
class LaunchPlan:
    spec: LaunchSpec
    env_overrides: tuple[tuple[str, str], ...]  # what m3patch and the recipe set on top of os.environ
    markers: tuple[mk.MarkerSpec, ...]
    marker_hint: str


def series_markers(recipe: Recipe) -> tuple[mk.MarkerSpec, ...]:
    """The markers the recipe's series declares for the recipe's platform."""

    series = load_series(recipe.series_dir)
    if series.target_version != recipe.target.vllm_version:
        msg = (f"{recipe.path}: target.vllm-version {recipe.target.vllm_version} but series "
               f"{series.id} targets {series.target_version}")
        raise UsageError(msg, hint=f"point `series:` at the series for vLLM "
                         f"{recipe.target.vllm_version}: a shipped series' name as `m3patch "
                         f"series list` prints it (vllm-{recipe.target.vllm_version}) or its folder")
    return series.markers_for(recipe.target.platform)


def all_markers(recipe: Recipe, ledger_sha256: str | None) -> tuple[mk.MarkerSpec, ...]:
    """Series markers (recipe counts applied), the recipe's own, and the exact ledger digest."""
    from_series = series_markers(recipe)
    merged = mk.merge_markers(from_series, recipe.markers, dict(recipe.marker_counts),
                              dict(recipe.marker_waivers))
    provenance = any(m.text.startswith(PROVENANCE_PREFIX) for m in from_series)
    if ledger_sha256 is None or not provenance:
        return merged
    # The server must report the very ledger this run's apply left, not just any patched tree.
    exact = mk.MarkerSpec("provenance-ledger", "required", f"ledger=sha256:{ledger_sha256}",
                          "m3patch serve (the ledger apply just verified)")
    return (*merged, exact)


def plan_launch(recipe: Recipe, python: str, port: int, log_path: Path,
                ledger_sha256: str | None) -> LaunchPlan:
    overrides = dict(LOOPBACK_ENV)
    overrides.update(recipe.env)  # the recipe wins: it may know better for its platform
    overrides[RAY_PREFIXES_VAR] = with_gate_prefix(
        overrides.get(RAY_PREFIXES_VAR, os.environ.get(RAY_PREFIXES_VAR, "")))
    env = {**os.environ, **overrides}
    args = list(recipe.serve_args())
    args[args.index("--port") + 1] = str(port)
    fix = f"m3patch serve {recipe.path}"
    hint = (f"check the backend the log chose (recipe env / vllm-args); re-check a saved log "
            f"with `m3patch markers check {log_path} --recipe {recipe.path}`; re-run: {fix}")
    spec = LaunchSpec(
        argv=(python, *VLLM_MAIN, *args), env=env, log_path=log_path,
        base_url=f"http://{recipe.host}:{port}", served_model=recipe.model.served_name,
        ready_deadline_s=recipe.deadlines.ready_s, request_deadline_s=recipe.deadlines.request_s,
        fix_hint=fix,
    )
    return LaunchPlan(spec, tuple(overrides.items()), all_markers(recipe, ledger_sha256), hint)


def ensure_tree(recipe: Recipe, python: str, tree: VllmTree | None = None) -> EnsuredTree:
    """The tree `python` imports (`tree`: as the launch check found it), made exactly the
    recipe's series and verified."""
    return ensure_series(tree or find_vllm(python=python), load_series(recipe.series_dir))


def prepare_tree(recipe: Recipe, python: str) -> tuple[str, LaunchCheck]:
    """Check the model and the launch before the tree changes, apply and verify; the ledger's
    sha256 hex, and the check (vLLM's own parser may still be owed: the session runs it beside
    the server)."""
    require_present(recipe)
    checked = check_launch(recipe, python, defer=True)
    ensured = ensure_tree(recipe, python, checked.tree)
    info(ensured.report.summary().removeprefix("m3patch: "))
    return ensured.ledger_sha256, checked
