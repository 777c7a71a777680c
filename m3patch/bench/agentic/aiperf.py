"""AIPerf, the agentic client: its command line (pure), its environment and the version check.

AIPerf lives in its own venv (pinned: SETUP_HINT says how to make it), as lm-eval does: it pulls
transformers, pandas, datasets and scipy, none of which the serving venv may be pinned by.
The argv follows InferenceX's replay command (benchmark_lib.sh build_replay_cmd) where AIPerf
0.13.0 on PyPI has the option: chat endpoint, streaming, server token counts, no GPU telemetry,
the server's `/metrics` scraped, a fixed random seed.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from m3patch.bench.cells import AgenticCell
from m3patch.errors import AgenticClientError, M3PatchError, TreeIOError
from m3patch.fsio import owned_dir, owned_dirs, path_is
from m3patch.recipe.agentic import AGENTIC_CODE, AgenticScenario, TraceSource
from m3patch.recipe.model_files import env_hub_cache
from m3patch.serving.launch_plan import LOOPBACK_ENV

AIPERF_VERSION = "0.13.0"
SETUP_HINT = (f"python3 -m venv ~/.cache/m3patch/aiperf-venv && ~/.cache/m3patch/aiperf-venv/bin/pip "
              f"install 'aiperf=={AIPERF_VERSION}'  (or set sweep.client.python / "
              "$M3PATCH_AIPERF_PYTHON)")
VERSION_PROBE_S = 60.0
# AIPerf 0.13.0 resolves a tokenizer offline through the hub cache only and refuses a local
# folder (common/tokenizer.py, _resolve_local_snapshot); its hash_id prompt synthesis (Mooncake
# and Weka traces) forces offline mode in its decode workers. A local tokenizer is therefore
# handed to it as a repo of a hub cache of the run's own (links to the folder's files, and to the
# trace dataset's real cache entry), always offline: never looked up on the hub.
LOCAL_TOKENIZER_REPO = "m3patch-local/tokenizer"
VIEW_REVISION = "local"


@dataclass(frozen=True)
class AgenticTarget:
    """The server a cell replays against."""

    base_url: str
    served_model: str
    tokenizer: str


def aiperf_binary(python: str) -> Path:
    """The `aiperf` console script beside the venv's python."""
    return Path(python).parent / "aiperf"


def trace_args(trace: TraceSource) -> list[str]:
    if trace.kind == "file":
        return ["--input-file", str(trace.path), "--custom-dataset-type", str(trace.loader)]
    if trace.kind == "public-dataset":
        return ["--public-dataset", str(trace.loader)]
    if trace.kind == AGENTIC_CODE:
        # The synthesized Mooncake trace, the run's validated copy (synthesize.for_run). Its first
        # rows carry timestamps, which would switch AIPerf to a timed replay: the cell's
        # concurrency drives it instead, the sessions' delays kept.
        assert trace.path is not None and trace.block_size is not None
        return ["--input-file", str(trace.path), "--custom-dataset-type", "mooncake_trace",
                "--isl-block-size", str(trace.block_size), "--no-fixed-schedule"]
    synth = dict(trace.synthetic)
    return ["--conversation-num", str(synth["conversations"]),
            "--conversation-turn-mean", str(synth["turns"]), "--conversation-turn-stddev", "0",
            "--synthetic-input-tokens-mean", str(synth["input-tokens"]),
            "--synthetic-input-tokens-stddev", "0",
            "--output-tokens-mean", str(synth["output-tokens"]), "--output-tokens-stddev", "0"]


def seed_of(trace: TraceSource, seed: int) -> int:
    """A synthesized trace carries its own seed (the sessions are part of the recipe)."""
    own = trace.kind in ("synthetic", AGENTIC_CODE)
    return dict(trace.synthetic).get("seed", seed) if own else seed


def aiperf_argv(python: str, target: AgenticTarget, cell: AgenticCell,
                scenario: AgenticScenario, artifact_dir: Path, seed: int) -> list[str]:
    """`aiperf profile` for one cell; its exports land in `artifact_dir`."""
    stop = (["--benchmark-duration", str(cell.duration_s)] if cell.duration_s is not None
            else ["--request-count", str(cell.request_count)])
    warmup = (["--warmup-request-count", str(cell.warmup_request_count)]
              if cell.warmup_request_count else [])
    named = ["--scenario", scenario.aiperf_scenario] if scenario.aiperf_scenario else []
    extra = [arg for key, value in scenario.extra_inputs
             for arg in ("--extra-inputs", f"{key}:{_scalar(value)}")]
    return [
        str(aiperf_binary(python)), "profile", *named,
        "--model", target.served_model, "--url", target.base_url,
        "--endpoint-type", "chat", "--endpoint", "/v1/chat/completions", "--streaming",
        "--tokenizer", target.tokenizer,
        "--concurrency", str(cell.concurrency), *stop, *warmup,
        "--random-seed", str(seed_of(scenario.trace, seed)),
        *trace_args(scenario.trace), *extra,
        # AIPerf scrapes the endpoint's own /metrics unasked (server_metrics_export.json).
        "--use-server-token-count", "--no-gpu-telemetry",
        "--output-artifact-dir", str(artifact_dir), "--no-auto-plot", "--ui-type", "none",
    ]  # fmt: skip


def _scalar(value: object) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def client_env(view: Path | None) -> dict[str, str]:
    """The server's loopback-only settings (hub offline); with a tokenizer view, its hub cache."""
    env = {**os.environ, **dict(LOOPBACK_ENV)}
    if view is not None:
        env["HF_HUB_CACHE"] = str(view)
    return env


def _repo_folder(kind: str, repo: str) -> str:
    return f"{kind}--{repo.replace('/', '--')}"


def tokenizer_view(target: AgenticTarget, trace: TraceSource, view: Path,
                   env: Mapping[str, str]) -> tuple[AgenticTarget, Path | None]:
    """For a local tokenizer folder: `view` laid out as a hub cache holding it as
    LOCAL_TOKENIZER_REPO (and a link to the trace dataset's entry in the real cache), and the
    target naming that repo. A hub tokenizer: the target unchanged, no view."""
    folder = Path(target.tokenizer)
    if not folder.is_dir():
        return target, None
    _fresh_view(view)
    repo = view / _repo_folder("models", LOCAL_TOKENIZER_REPO)
    snapshot = repo / "snapshots" / VIEW_REVISION
    owned_dirs(view, snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(VIEW_REVISION)
    for item in sorted(folder.resolve().iterdir()):
        (snapshot / item.name).symlink_to(item)
    if trace.kind == "public-dataset" and trace.dataset:
        real = env_hub_cache(env) / _repo_folder("datasets", trace.dataset)
        (view / real.name).symlink_to(real)
    return replace(target, tokenizer=LOCAL_TOKENIZER_REPO), view


def _fresh_view(view: Path) -> None:
    """`view` emptied and made again (the run's own, rebuilt from the folder each time) as a
    real folder this user owns: a link or another user's folder planted there is refused (34),
    never emptied through nor written through."""
    if os.path.lexists(view):
        owned_dir(view)
        try:
            shutil.rmtree(view)
        except OSError as exc:
            msg = f"{view}: cannot empty the run's tokenizer view: {exc.strerror or exc}"
            raise TreeIOError(msg, hint=f"remove {view} and run again") from None
    owned_dir(view, create=True)


def check_client(python: str) -> str:
    """AIPerf installed in `python`'s venv at the pinned version; its version, or raise (31)."""
    binary = aiperf_binary(python)
    if not path_is(Path(python), "file") or not path_is(binary, "file"):
        msg = f"AIPerf is not installed: no {binary} (the agentic client runs from its own venv)"
        raise AgenticClientError(msg, hint=SETUP_HINT)
    version = installed_version(python, "aiperf", AgenticClientError, SETUP_HINT)
    if version != AIPERF_VERSION:
        msg = (f"{python}: AIPerf {version or 'nothing'} installed; m3patch scores AIPerf "
               f"{AIPERF_VERSION}'s export")
        raise AgenticClientError(msg, hint=SETUP_HINT)
    return version


def installed_version(python: str, dist: str, error: type[M3PatchError], hint: str) -> str | None:
    """The version of `dist` that `python` has installed, or None; `error` when it cannot say."""
    probe = f"import importlib.metadata as m; print(m.version({dist!r}))"
    try:
        done = subprocess.run([python, "-c", probe], capture_output=True, text=True,
                              timeout=VERSION_PROBE_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        msg = f"{python}: cannot read {dist}'s version: {exc}"
        raise error(msg, hint=hint) from None
    return done.stdout.strip() or None if done.returncode == 0 else None
