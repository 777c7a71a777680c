"""The server's Prometheus `/metrics`, read by m3patch itself around and during each cell.

AIPerf keeps its own scrape (server_metrics_export.json, kept in the cell's artifacts); m3patch
reads the counters before and after the cell and samples the KV-cache usage gauge while the
client runs, so the hit rate in a row is the cell's own (the counters are cumulative over the
server's life, and one server serves several cells). Field names are InferenceX's
(utils/agentic/aggregation/backends/vllm.py): server_gpu_cache_hit_rate = prefix-cache hits /
queries, server_cpu_cache_hit_rate from the external (offload) counters, gpu_kv_cache_usage_pct
and cpu_kv_cache_usage_pct as fractions (their max over the cell).
"""

from __future__ import annotations

import math
import re
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from m3patch.errors import AgenticClientError

PREFIX = "vllm:"  # InferenceX: AIPERF_REQUIRED_SERVER_METRIC_PREFIX for a vLLM server
SCRAPE_TIMEOUT_S = 5.0
SAMPLE_EVERY_S = 2.0
COUNTERS = ("prefix_cache_hits", "prefix_cache_queries", "external_prefix_cache_hits",
            "external_prefix_cache_queries", "prompt_tokens", "generation_tokens")
GAUGES = {"gpu_kv_cache_usage_pct": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
          "cpu_kv_cache_usage_pct": ("cpu_kv_cache_usage_perc",)}
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+(\S+)")


def parse(text: str) -> dict[str, float]:
    """Prometheus text -> {metric name: sum over its label sets}; comments and NaN dropped."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match is None:
            continue
        try:
            value = float(match.group(3))
        except ValueError:
            continue
        if math.isfinite(value):
            out[match.group(1)] = out.get(match.group(1), 0.0) + value
    return out


def counter(sample: dict[str, float], name: str) -> float | None:
    """A counter's value: vLLM exports `<name>_total` (prometheus_client appends it)."""
    for key in (f"{PREFIX}{name}_total", f"{PREFIX}{name}"):
        if key in sample:
            return sample[key]
    return None


def scrape(base_url: str) -> dict[str, float]:
    url = f"{base_url}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=SCRAPE_TIMEOUT_S) as reply:
            text = reply.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError) as exc:
        msg = f"{url}: {exc}"
        raise AgenticClientError(msg, hint="the server must export Prometheus metrics "
                                 "(vLLM does unless --disable-log-stats)") from None
    sample = parse(text)
    if not any(name.startswith(PREFIX) for name in sample):
        msg = f"{url} exports no {PREFIX} metric: the hit rate and KV usage cannot be read"
        raise AgenticClientError(msg, hint="drop --disable-log-stats from the recipe's vllm-args")
    return sample


@dataclass
class CellMetrics:
    """One cell's scrape: counters before and after, the usage gauges' samples between."""

    before: dict[str, float]
    after: dict[str, float] = field(default_factory=dict)
    gauges: dict[str, list[float]] = field(default_factory=dict)

    def sample(self, now: dict[str, float]) -> None:
        for name, sources in GAUGES.items():
            values = [now[f"{PREFIX}{s}"] for s in sources if f"{PREFIX}{s}" in now]
            if values:
                self.gauges.setdefault(name, []).append(max(values))

    def delta(self, name: str) -> float | None:
        start, end = counter(self.before, name), counter(self.after, name)
        return None if start is None or end is None else max(end - start, 0.0)

    def fields(self) -> dict[str, Any]:
        """InferenceX's server-metric fields for this cell (null when the server lacks one)."""
        out: dict[str, Any] = {"server_scrapes": 2 + sum(len(v) for v in self.gauges.values())}
        deltas = {name: self.delta(name) for name in COUNTERS}
        out["server_prefix_cache_queries"] = deltas["prefix_cache_queries"]
        out["server_prefix_cache_hits"] = deltas["prefix_cache_hits"]
        out["server_gpu_cache_hit_rate"] = _rate(deltas["prefix_cache_hits"],
                                                 deltas["prefix_cache_queries"])
        out["server_cpu_cache_hit_rate"] = _rate(deltas["external_prefix_cache_hits"],
                                                 deltas["external_prefix_cache_queries"])
        out["server_overall_cache_hit_rate"] = _rate(
            _sum(deltas["prefix_cache_hits"], deltas["external_prefix_cache_hits"]),
            deltas["prefix_cache_queries"])
        for name in GAUGES:
            values = self.gauges.get(name)
            out[name] = max(values) if values else None
        return out


def _rate(hits: float | None, queries: float | None) -> float | None:
    return hits / queries if hits is not None and queries else None


def _sum(first: float | None, second: float | None) -> float | None:
    return None if first is None else first + (second or 0.0)


def sampling(base_url: str, metrics: CellMetrics,
             check_server: Callable[[], None]) -> Callable[[], None]:
    """check_server for the client's wait loop that also samples the gauges every few seconds."""
    due = [time.monotonic()]

    def check() -> None:
        check_server()
        if time.monotonic() >= due[0]:
            due[0] = time.monotonic() + SAMPLE_EVERY_S
            metrics.sample(scrape(base_url))
    return check


def series(values: dict[str, float]) -> Iterator[tuple[str, float]]:
    """The vLLM metrics of a scrape, sorted (what the cell file keeps of before/after)."""
    return iter(sorted((k, v) for k, v in values.items() if k.startswith(PREFIX)))
