"""LMCache as the DRAM tier of an agentic row: one `lmcache server` per TP rank, as InferenceX's
MiniMax-M3 launcher starts them (benchmarks/single_node/agentic/minimaxm3_fp8_mi300x_mtp.sh).

- the version installed in the serving interpreter must be the recipe's pin (KvOffloadError, 32);
- the row's DRAM budget (recipe.agentic.dram_budget_gb) is split evenly over the ranks
  (`--l1-size-gb TOTAL // TP`, refused under 1 GB per rank, as the launcher does);
- every server is started in its own process group (serving.processes.start_group), each one's
  `/healthcheck` must answer within the deadline while its process lives, and the set is
  stopped through the one stop ladder when the vLLM server using it is done, or when one fails;
- the connector's line in vLLM's log is a required marker of the row (recipe.agentic).
The plan (argv, ports, budget) is pure; `servers` is the effect.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from m3patch.bench.agentic.aiperf import installed_version
from m3patch.errors import KvOffloadError
from m3patch.recipe.agentic import (
    LMCACHE_HOST,
    LMCACHE_HTTP_PORT_BASE,
    LMCACHE_PORT_BASE,
    LMCACHE_TRANSFER_MODE,
    KvOffload,
)
from m3patch.serving.processes import StopRung, start_group, stop_group

HEALTH_DEADLINE_S = 600.0  # InferenceX: wait_for_ready --timeout 600 per shard
HEALTH_POLL_S = 1.0
HEALTH_TIMEOUT_S = 2.0
STOP_LADDER = (StopRung(signal.SIGINT, 10.0), StopRung(signal.SIGTERM, 10.0),
               StopRung(signal.SIGKILL, 5.0))
INSTALL_HINT = ("install the pinned LMCache into the serving interpreter (on ROCm from LMCache's "
                "v<version>-rocm release assets, as InferenceX does), or change the row's version")


@dataclass(frozen=True)
class ShardPlan:
    """One rank's LMCache server."""

    rank: int
    argv: tuple[str, ...]
    port: int
    http_port: int

    @property
    def health_url(self) -> str:
        return f"http://{LMCACHE_HOST}:{self.http_port}/healthcheck"

    @property
    def log_name(self) -> str:
        return f"lmcache_server_{self.rank}.log"


def shard_gb(budget_gb: int, tp: int) -> int:
    """Each rank's L1 size: the row's budget split evenly, at least 1 GB (the launcher's check)."""
    per_rank = budget_gb // tp
    if per_rank < 1:
        msg = (f"LMCache DRAM budget {budget_gb} GB over TP {tp} is under 1 GB per rank "
               f"(InferenceX refuses the same)")
        raise KvOffloadError(msg, hint="raise sweep.dram-utilization or node.available-cpu-dram-mib")
    return per_rank


def plan_shards(lmcache: str, budget_gb: int, tp: int,
                mode: str = LMCACHE_TRANSFER_MODE) -> tuple[ShardPlan, ...]:
    """InferenceX's per-rank `lmcache server` command lines (pure)."""
    l1 = shard_gb(budget_gb, tp)
    plans = []
    for rank in range(tp):
        port, http_port = LMCACHE_PORT_BASE + rank, LMCACHE_HTTP_PORT_BASE + rank
        argv = (lmcache, "server", "--host", LMCACHE_HOST, "--port", str(port),
                "--http-host", LMCACHE_HOST, "--http-port", str(http_port),
                "--l1-size-gb", str(l1), "--l1-init-size-gb", str(min(10, l1)),
                "--l1-read-ttl-seconds", "7200", "--chunk-size", "256", "--max-workers", "2",
                "--eviction-policy", "LRU", "--supported-transfer-mode", mode)
        plans.append(ShardPlan(rank, argv, port, http_port))
    return tuple(plans)


def lmcache_binary(python: str) -> str:
    return str(Path(python).parent / "lmcache")


def check_lmcache(python: str, version: str) -> None:
    """The serving interpreter's lmcache is exactly `version` (the recipe's pin)."""
    installed = installed_version(python, "lmcache", KvOffloadError, INSTALL_HINT)
    if installed != version:
        found = f"LMCache {installed}" if installed else "no LMCache"
        msg = f"{python}: {found} installed; the recipe pins LMCache {version}"
        raise KvOffloadError(msg, hint=INSTALL_HINT)


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=HEALTH_TIMEOUT_S) as reply:
            return bool(reply.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_healthy(proc: subprocess.Popen[bytes], plan: ShardPlan, log: Path,
                 deadline_s: float) -> None:
    """Until the shard's /healthcheck answers 200; raise if it exits or the deadline passes."""
    deadline = time.monotonic() + deadline_s
    while not _healthy(plan.health_url):
        if proc.poll() is not None:
            msg = f"LMCache server {plan.rank} exited with status {proc.returncode} (log {log})"
            raise KvOffloadError(msg, hint=f"see {log}")
        if time.monotonic() > deadline:
            msg = (f"LMCache server {plan.rank}: {plan.health_url} did not answer within "
                   f"{deadline_s:g} s (log {log})")
            raise KvOffloadError(msg, hint=f"see {log}; the ports {plan.port}/{plan.http_port} "
                                 "must be free")
        time.sleep(HEALTH_POLL_S)


@contextlib.contextmanager
def servers(plans: Sequence[ShardPlan], log_dir: Path, *, env: dict[str, str] | None = None,
            deadline_s: float = HEALTH_DEADLINE_S) -> Iterator[tuple[Path, ...]]:
    """Every shard started, each healthy by its deadline; all stopped on the way out."""
    started: list[subprocess.Popen[bytes]] = []
    logs = tuple(log_dir / plan.log_name for plan in plans)
    log_dir.mkdir(parents=True, exist_ok=True)
    try:
        for plan, log in zip(plans, logs, strict=True):
            with open(log, "wb") as out:
                try:
                    started.append(start_group(plan.argv, stdout=out, stderr=subprocess.STDOUT,
                                               env=env))
                except OSError as exc:
                    msg = f"cannot start LMCache server {plan.rank} ({plan.argv[0]}): {exc}"
                    raise KvOffloadError(msg, hint=INSTALL_HINT) from None
        for proc, plan, log in zip(started, plans, logs, strict=True):
            wait_healthy(proc, plan, log, deadline_s)
        yield logs
    finally:
        for proc in reversed(started):
            stop_group(proc, STOP_LADDER)


def row_servers(kv: KvOffload, budget_gb: int, tp: int, python: str, log_dir: Path,
                mode: str = LMCACHE_TRANSFER_MODE,
                ) -> contextlib.AbstractContextManager[tuple[Path, ...]]:
    """The LMCache set a row's server needs (nothing for another tier); `mode` is the transfer
    mode the row's connector uses (recipe.agentic.lmcache_transfer_mode)."""
    if kv.backend != "lmcache":
        return contextlib.nullcontext(())
    return servers(plan_shards(lmcache_binary(python), budget_gb, tp, mode), log_dir)
