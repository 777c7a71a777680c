"""Where an eval task's data comes from, whether it is there, and the one way to fetch it.

A local task (`task-dir`) carries its data; a hub task names its dataset (`dataset: ORG/NAME`)
and must be in the Hugging Face hub cache (`datasets--ORG--NAME/snapshots/<commit>/`) before the
offline run: the harness runs with the hub offline and would otherwise fail late, after the
sweep. `fetch` is the effect: lm-eval's own interpreter loads each dataset once, online, into
that cache (the same `datasets` library that will read it offline).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path

from m3patch.errors import EvalError, M3PatchError, ModelMissing
from m3patch.eval.harness import setup_hint
from m3patch.recipe.evals import EvalSpec, EvalTask
from m3patch.recipe.model_files import env_hub_cache

FETCH_TIMEOUT_S = 1800
# Run in lm-eval's venv: load the dataset online (and so into the hub cache), print its splits.
FETCH_SCRIPT = ("import sys, datasets; "
                "d = datasets.load_dataset(sys.argv[1], sys.argv[2] or None); "
                "print({k: len(v) for k, v in d.items()})")


def dataset_folder(cache: Path, dataset: str) -> Path:
    return cache / ("datasets--" + dataset.replace("/", "--"))


def is_cached(task: EvalTask, cache: Path) -> bool:
    if task.dataset is None:
        return True  # a local task, or one whose data the recipe does not name
    snapshots = dataset_folder(cache, task.dataset) / "snapshots"
    return snapshots.is_dir() and any(p.is_dir() and any(p.iterdir()) for p in snapshots.iterdir())


def missing(spec: EvalSpec, env: Mapping[str, str] | None = None) -> tuple[EvalTask, ...]:
    cache = env_hub_cache(os.environ if env is None else env)
    return tuple(t for t in spec.tasks if not is_cached(t, cache))


def require_cached(spec: EvalSpec, recipe_path: Path, env: Mapping[str, str] | None = None) -> None:
    """Fail before the harness starts (and before the sweep) when a dataset is not cached."""
    absent = missing(spec, env)
    if absent:
        cache = env_hub_cache(os.environ if env is None else env)
        names = ", ".join(f"{t.task} ({t.dataset})" for t in absent)
        msg = f"{recipe_path}: eval dataset not in {cache}: {names} (the eval runs offline)"
        raise EvalError(msg, hint=f"m3patch model fetch {recipe_path}")


def fetch(spec: EvalSpec, recipe_path: Path) -> tuple[str, ...]:
    """Download each missing hub dataset with lm-eval's interpreter; returns what was fetched."""
    fetched = []
    for task in missing(spec):
        assert task.dataset is not None
        env = {k: v for k, v in os.environ.items()
               if k not in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE")}
        argv = [spec.python, "-c", FETCH_SCRIPT, task.dataset, task.dataset_name or ""]
        what = f"{recipe_path}: cannot fetch eval dataset {task.dataset}"
        folder = run_fetch(argv, env, FETCH_TIMEOUT_S, what=what, failed=what,
                           spawn_error=ModelMissing,
                           spawn_hint=f"{setup_hint(spec.python)}; check the network",
                           fail_hint="check the network (HTTPS_PROXY) and the dataset id")
        fetched.append(f"{task.dataset} {folder}")
    return tuple(fetched)


def run_fetch(argv: list[str], env: Mapping[str, str] | None, timeout: float, *, what: str,
              failed: str, spawn_error: type[M3PatchError], spawn_hint: str,
              fail_hint: str) -> str:
    """Run a hub download script in a client's own interpreter (lm-eval's, AIPerf's); what it
    printed (the snapshot folder). A child that cannot start or overruns is `spawn_error`
    ("WHAT: why"); one that exits non-zero is ModelMissing with its last stderr lines."""
    try:
        done = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=timeout,
                              check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"{what}: {exc}"
        raise spawn_error(msg, hint=spawn_hint) from None
    if done.returncode != 0:
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        msg = f"{failed}:\n{tail}"
        raise ModelMissing(msg, hint=fail_hint)
    return done.stdout.strip()
