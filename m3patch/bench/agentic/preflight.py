"""What an agentic run checks before any server starts: AIPerf installed at the pinned version,
the trace on disk (a local file, the hub dataset in the cache: the client runs offline, or an
agentic-code trace synthesized from its manifest into the cache), and
LMCache installed at the recipe's pinned version where a row asks for it.

`trace_missing` / `fetch_trace` are what `model check` / `model fetch` use for the trace dataset,
as they do for eval datasets.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from m3patch.bench.agentic.aiperf import SETUP_HINT, check_client
from m3patch.bench.agentic.lmcache import check_lmcache
from m3patch.bench.agentic.synthesize import synthesized
from m3patch.errors import AgenticClientError, ModelMissing
from m3patch.eval.datasets import dataset_folder, run_fetch
from m3patch.fsio import path_is
from m3patch.recipe.agentic import AGENTIC_CODE, AgenticScenario, TraceSource
from m3patch.recipe.model_files import env_hub_cache

FETCH_TIMEOUT_S = 3600
# Run with AIPerf's interpreter (its huggingface_hub): the dataset into the hub cache, offline-ready.
FETCH_SCRIPT = ("import sys; from huggingface_hub import snapshot_download; "
                "print(snapshot_download(sys.argv[1], repo_type='dataset', "
                "revision=sys.argv[2] or None))")


def trace_missing(trace: TraceSource, env: Mapping[str, str] | None = None) -> str | None:
    """Why the trace is not available offline, or None when it is (synthetic needs nothing)."""
    if trace.kind == "file":
        assert trace.path is not None
        return None if path_is(trace.path, "file") else f"trace file {trace.path} does not exist"
    if trace.kind == "public-dataset":
        assert trace.dataset is not None
        cache = env_hub_cache(os.environ if env is None else env)
        snapshots = dataset_folder(cache, trace.dataset) / "snapshots"
        present = path_is(snapshots, "dir") and any(p.is_dir() and any(p.iterdir())
                                             for p in snapshots.iterdir())
        return None if present else f"trace dataset {trace.dataset} is not in {cache}"
    if trace.kind == AGENTIC_CODE:
        assert trace.manifest is not None
        return (None if path_is(trace.manifest, "file")
                else f"agentic-code manifest {trace.manifest} does not exist")
    return None


def require_trace(trace: TraceSource, recipe_path: Path) -> None:
    problem = trace_missing(trace)
    if problem is not None:
        fix = (f"m3patch model fetch {recipe_path}" if trace.kind == "public-dataset"
               else f"put the manifest there, or correct sweep.trace.agentic-code.manifest in "
                    f"{recipe_path}" if trace.kind == AGENTIC_CODE
               else f"put the trace file there, or correct sweep.trace.file in {recipe_path}")
        msg = f"{recipe_path}: {problem}"
        raise ModelMissing(msg, hint=fix)


def fetch_trace(trace: TraceSource, python: str) -> str:
    """Download a hub trace dataset with AIPerf's interpreter; the snapshot folder it wrote."""
    assert trace.dataset is not None
    what = f"fetching trace dataset {trace.dataset}"
    return run_fetch([python, "-c", FETCH_SCRIPT, trace.dataset, trace.revision or ""], None,
                     FETCH_TIMEOUT_S, what=what, failed=f"{what} failed",
                     spawn_error=AgenticClientError,
                     spawn_hint=f"{SETUP_HINT}, then retry",
                     fail_hint="check the dataset id and your hub access, then retry")


def preflight(scenario: AgenticScenario, recipe_path: Path, serving_python: str) -> str:
    """Every check that needs no server; a one-line summary for the recipe step."""
    version = check_client(scenario.client_python)
    require_trace(scenario.trace, recipe_path)
    made = ""
    if scenario.trace.kind == AGENTIC_CODE:
        # Synthesized (or its cache entry checked) now: a manifest AIPerf refuses stops the run
        # before any server starts.
        trace = synthesized(scenario.trace, scenario.client_python)
        made = f" ({trace.summary.sessions} sessions, {trace.summary.rows} turns)"
    pins = sorted({row.kv_offload.version for row in scenario.rows
                   if row.kv_offload.backend == "lmcache" and row.kv_offload.version})
    for pin in pins:
        check_lmcache(serving_python, pin)
    lmcache = f"; LMCache {', '.join(pins)}" if pins else ""
    return f"AIPerf {version}; trace {scenario.trace.label}{made}{lmcache}"
