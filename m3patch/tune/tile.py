"""One tile config of vLLM's fused-MoE Triton kernel, and which configs a run refines. Pure.

Its own module so that both the search space (space.py) and vLLM's defaults (naming.py) can
use it without importing each other in a cycle. The quick pass times every config of the
space once; the refine pass re-times the fastest few and vLLM's default with more
repetitions, and the pick is the fastest refined one. A resumed run takes quick results from
the cache, so only what it will still launch is precompiled.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from m3patch.tune.cache import ResultCache

_KEY = re.compile(r"M(\d+)-N(\d+)-K(\d+)-G(\d+)-w(\d+)-s(\d+)(?:-k(\d+))?")


@dataclass(frozen=True, order=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int
    # K slices per C tile: only a kernel patched for split-K (patch 0007) runs more than 1;
    # at 1 the key and the table entry are spelled as vLLM's own
    split_k: int = 1

    @property
    def key(self) -> str:
        split = f"-k{self.split_k}" if self.split_k > 1 else ""
        return (f"M{self.block_m}-N{self.block_n}-K{self.block_k}-G{self.group_m}"
                f"-w{self.num_warps}-s{self.num_stages}{split}")

    @classmethod
    def from_key(cls, key: str) -> TileConfig:
        """Inverse of `key` (the spelling in tune-cache.jsonl and bench.json)."""
        match = _KEY.fullmatch(key)
        if match is None:
            msg = f"{key!r} is not a tile key like M16-N64-K128-G1-w4-s3"
            raise ValueError(msg)
        return cls(*(int(group) for group in match.groups() if group is not None))

    def to_vllm(self) -> dict[str, int]:
        """The dict vLLM's table holds for one batch size (and passes as **config)."""
        entry = {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n,
                 "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m,
                 "num_warps": self.num_warps, "num_stages": self.num_stages}
        if self.split_k > 1:
            entry["SPLIT_K"] = self.split_k
        return entry

    @classmethod
    def from_vllm(cls, entry: dict[str, int]) -> TileConfig:
        return cls(entry["BLOCK_SIZE_M"], entry["BLOCK_SIZE_N"], entry["BLOCK_SIZE_K"],
                   entry["GROUP_SIZE_M"], entry["num_warps"], entry["num_stages"],
                   entry.get("SPLIT_K", 1))


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
