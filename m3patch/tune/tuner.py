"""Tune one shape: per batch size, check every config, time it briefly, refine the best few,
then let the judge (judge.py) decide between the fastest refined config and vLLM's default.

Every finished measurement goes to the resumable cache first; a run past its deadline stops
between configs and reports which batch sizes it finished.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from m3patch.tune.cache import Result, ResultCache
from m3patch.tune.judge import DEFAULT_ROUNDS, Judgement, measure
from m3patch.tune.kernel_timer import ConfigFailed, MoEBench
from m3patch.tune.naming import default_config
from m3patch.tune.shapes import MoEShape
from m3patch.tune.space import TileConfig
from m3patch.tune.tile import refine_candidates


@dataclass(frozen=True)
class TuneOptions:
    quick_reps: int = 5
    refine_reps: int = 25
    refine_top: int = 4
    deadline: float | None = None  # time.monotonic() value
    judge_rounds: int = DEFAULT_ROUNDS


@dataclass(frozen=True)
class BatchBest:
    batch: int
    config: TileConfig
    us: float
    timed: int
    failed: int
    resumed: int = 0  # quick results taken from the cache instead of timed in this run
    default_us: float | None = None  # vLLM's default, refined beside the best quick picks
    judgement: Judgement | None = None  # the final choice: fastest refined vs the default


class Progress:
    """A rich progress bar where rich is importable, else one line per step."""

    def __init__(self, total: int, description: str) -> None:
        self._bar: Any = None
        self._task: Any = None
        self._done = 0
        self.total = total
        self.description = description

    @contextmanager
    def running(self) -> Iterator[Progress]:
        try:
            # deferred: rich: loaded only when something is printed (keeps --version fast)
            from rich.progress import Progress as RichProgress

            from m3patch.output import console
        except ImportError:
            yield self
            return
        with RichProgress(console=console(), transient=False) as bar:
            self._bar, self._task = bar, bar.add_task(self.description, total=self.total)
            yield self
        self._bar = None

    def advance(self, count: int = 1) -> None:
        self._done += count
        if self._bar is not None:
            self._bar.update(self._task, advance=count)

    def log(self, message: str) -> None:
        if self._bar is not None:
            self._bar.console.log(message)
        else:
            print(f"m3patch tune: [{self._done}/{self.total}] {message}", file=sys.stderr,
                  flush=True)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() > deadline


@dataclass
class _Quick:
    timed: list[tuple[float, TileConfig]]
    failed: int = 0
    resumed: int = 0


def _quick_pass(bench: MoEBench, shape: MoEShape, batch: int, configs: list[TileConfig],
                cache: ResultCache, opts: TuneOptions, progress: Progress) -> _Quick | None:
    setup = None
    quick = _Quick([])
    timed = quick.timed
    for cfg in configs:
        if _past(opts.deadline):
            return None
        progress.advance()
        if cache.failed(bench.cache_key, batch, cfg.key):
            quick.failed += 1
            continue
        hit = cache.get(bench.cache_key, batch, cfg.key, "quick")
        if hit is not None and hit.us is not None:
            timed.append((hit.us, cfg))
            quick.resumed += 1
            continue
        setup = setup or bench.setup(batch)
        try:
            error = bench.check(setup, cfg)
        except ConfigFailed as exc:
            cache.add(Result(bench.cache_key, batch, cfg.key, "failed", None, note=str(exc)))
            quick.failed += 1
            continue
        us = bench.time(setup, cfg, opts.quick_reps)
        cache.add(Result(bench.cache_key, batch, cfg.key, "quick", us, error))
        timed.append((us, cfg))
    timed.sort()
    return quick


def _refine(bench: MoEBench, batch: int, cfg: TileConfig, cache: ResultCache,
            opts: TuneOptions) -> float | None:
    """The refine timing of one config (cached or measured now); None past the deadline."""
    hit = cache.get(bench.cache_key, batch, cfg.key, "refine")
    if hit is not None and hit.us is not None:
        return hit.us
    if _past(opts.deadline):
        return None
    us = bench.time(bench.setup(batch), cfg, opts.refine_reps)
    cache.add(Result(bench.cache_key, batch, cfg.key, "refine", us))
    return us


def tune_batch(bench: MoEBench, batch: int, configs: list[TileConfig], cache: ResultCache,
               opts: TuneOptions, progress: Progress, default: TileConfig | None = None
               ) -> BatchBest | None:
    shape = bench.shape
    quick = _quick_pass(bench, shape, batch, configs, cache, opts, progress)
    if quick is None:
        return None
    if not quick.timed:
        progress.log(f"{shape.key} M={batch}: every config failed")
        return None
    refined: list[tuple[float, TileConfig]] = []
    for cfg in refine_candidates(quick.timed, opts.refine_top, default):
        try:
            us = _refine(bench, batch, cfg, cache, opts)
        except ConfigFailed as exc:  # a resumed quick result that fails its check here
            cache.add(Result(bench.cache_key, batch, cfg.key, "failed", None, note=str(exc)))
            progress.log(f"{shape.key} M={batch}: {exc}")
            continue
        if us is None:
            return None
        refined.append((us, cfg))
    if not refined:
        progress.log(f"{shape.key} M={batch}: every refine candidate failed")
        return None
    best_us, best = min(refined)
    default_us = next((us for us, cfg in refined if cfg == default), None)
    verdict = _judge(bench, batch, best, default, opts, progress)
    config, us = best, best_us
    if verdict is not None:
        config = TileConfig.from_key(verdict.chosen)
        us = verdict.tuned_us if verdict.decision == "tuned" else verdict.default_us
    progress.log(f"{shape.key} M={batch}: best {best.key} {best_us:.1f} us "
                 f"({len(quick.timed)} timed, {quick.resumed} of them resumed, "
                 f"{quick.failed} failed)"
                 + (f"; judge: {verdict.verdict} (t/d {verdict.ratio:.3f} +- "
                    f"{100 * verdict.noise:.1f}%) -> {config.key}" if verdict else ""))
    return BatchBest(batch, config, us, len(quick.timed), quick.failed, quick.resumed,
                     default_us, verdict)


def _judge(bench: MoEBench, batch: int, best: TileConfig, default: TileConfig | None,
           opts: TuneOptions, progress: Progress) -> Judgement | None:
    """The final choice, head to head with the default; None where no default is known or it
    fails its own reference check (the tuned pick then stands, and the log says so)."""
    if default is None:
        return None
    try:
        return measure(bench, batch, best, default, rounds=opts.judge_rounds,
                       reps=opts.refine_reps)
    except ConfigFailed as exc:
        progress.log(f"{bench.shape.key} M={batch}: cannot judge against the default: {exc}")
        return None


def tune_shape(bench: MoEBench, plan: dict[int, list[TileConfig]], cache: ResultCache,
               opts: TuneOptions, progress: Progress, *, rocm: bool = False
               ) -> dict[int, BatchBest]:
    """Best config per batch size; batch sizes missing from the result were not finished."""
    results: dict[int, BatchBest] = {}
    for batch in sorted(plan):
        default = default_config(bench.shape, batch, rocm=rocm)
        best = tune_batch(bench, batch, plan[batch], cache, opts, progress, default)
        if best is None and _past(opts.deadline):
            progress.log(f"{bench.shape.key}: deadline reached before M={batch}")
            break
        if best is not None:
            results[batch] = best
    return results
