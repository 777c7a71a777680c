"""One tile config of vLLM's fused-MoE Triton kernel, in the tuner's and vLLM's spellings. Pure.

Its own module so that both the search space (space.py) and vLLM's defaults (naming.py) can
use it without importing each other in a cycle.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_KEY = re.compile(r"M(\d+)-N(\d+)-K(\d+)-G(\d+)-w(\d+)-s(\d+)")


@dataclass(frozen=True, order=True)
class TileConfig:
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    @property
    def key(self) -> str:
        return (f"M{self.block_m}-N{self.block_n}-K{self.block_k}-G{self.group_m}"
                f"-w{self.num_warps}-s{self.num_stages}")

    @classmethod
    def from_key(cls, key: str) -> TileConfig:
        """Inverse of `key` (the spelling in tune-cache.jsonl and bench.json)."""
        match = _KEY.fullmatch(key)
        if match is None:
            msg = f"{key!r} is not a tile key like M16-N64-K128-G1-w4-s3"
            raise ValueError(msg)
        return cls(*(int(group) for group in match.groups()))

    def to_vllm(self) -> dict[str, int]:
        """The dict vLLM's table holds for one batch size (and passes as **config)."""
        return {"BLOCK_SIZE_M": self.block_m, "BLOCK_SIZE_N": self.block_n,
                "BLOCK_SIZE_K": self.block_k, "GROUP_SIZE_M": self.group_m,
                "num_warps": self.num_warps, "num_stages": self.num_stages}

    @classmethod
    def from_vllm(cls, entry: dict[str, int]) -> TileConfig:
        return cls(entry["BLOCK_SIZE_M"], entry["BLOCK_SIZE_N"], entry["BLOCK_SIZE_K"],
                   entry["GROUP_SIZE_M"], entry["num_warps"], entry["num_stages"])
