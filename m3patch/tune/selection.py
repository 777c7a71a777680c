"""Which configs a (possibly resumed) tuning run launches and refines. Pure.

The quick pass times every config of the space once; the refine pass re-times the fastest few
and vLLM's default with more repetitions, and the pick is the fastest refined one. A resumed
run takes quick results from the cache, so only what it will still launch is precompiled.
"""

from __future__ import annotations

from m3patch.tune.cache import ResultCache
from m3patch.tune.tile import TileConfig


def refine_candidates(timed: list[tuple[float, TileConfig]], top: int,
                      default: TileConfig | None) -> list[TileConfig]:
    """The `top` fastest quick results, plus vLLM's default when it was timed: the pick is
    then never slower than the default on the refine measurement."""
    picks = [cfg for _, cfg in timed[:top]]
    if default is not None and default not in picks and any(c == default for _, c in timed):
        picks.append(default)
    return picks


def launches_needed(cache: ResultCache, shape_key: str, plan: dict[int, list[TileConfig]],
                    refine_top: int, defaults: dict[int, TileConfig]
                    ) -> dict[int, list[TileConfig]]:
    """The configs a resumed run still launches, per batch size: those with no cached quick
    result or failure, plus the fastest cached ones and the default, which the refine step
    may time. Precompiling only these keeps a resumed run from recompiling the whole space."""
    needed: dict[int, list[TileConfig]] = {}
    for batch, configs in plan.items():
        cached: list[tuple[float, TileConfig]] = []
        fresh: list[TileConfig] = []
        for cfg in configs:
            if cache.failed(shape_key, batch, cfg.key):
                continue
            hit = cache.get(shape_key, batch, cfg.key, "quick")
            if hit is not None and hit.us is not None:
                cached.append((hit.us, cfg))
            else:
                fresh.append(cfg)
        cached.sort()
        refine = [cfg for _, cfg in cached[:refine_top]]
        default = defaults.get(batch)
        if default is not None and default not in fresh and default not in refine:
            refine.append(default)
        needed[batch] = fresh + refine
    return needed
