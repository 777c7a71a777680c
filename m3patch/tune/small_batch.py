"""Small-batch decode against the fp8 weight-read floor: the configs to try and how a run is
read. Pure (scripts/measure/h200/small_batch_h200.py measures; tests/tune/test_tune_small_batch.py checks
this module on the recorded H200 figures).

At M <= 8 the TP8 shape (E=128, N=384, top-4) runs vLLM's naive path: one token-expert pair
per M tile, so GEMM1 (K = 6144) has only 2N/BLOCK_SIZE_N programs per pair (48 at M=1 with
vLLM's default 64-wide tile) and each streams a 6144-deep K loop on its own SM. The space
below adds what vLLM's tuning space lacks for that regime: narrower N tiles (16), fewer warps
(1, 2), deeper pipelines (6, 8 stages), and split-K (K slices per tile, patch 0007).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from m3patch.errors import ResultsInvalid
from m3patch.tune.tile import TileConfig

FLOOR_TARGET = 0.70  # the fraction of the weight-read floor asked of M <= 4
BLOCK_M = 16  # one valid row per tile on the naive path: the smallest tl.dot tile

NO_SPLIT_N = (16, 32, 64, 128)
NO_SPLIT_WARPS = (1, 2, 4)
NO_SPLIT_STAGES = (3, 4, 5, 6, 8)
SPLIT_N = (32, 64, 128)
SPLIT_WARPS = (2, 4)
SPLIT_STAGES = (3, 4, 6)
SPLITS = (2, 3, 4, 6, 8, 12)


def candidate_configs(extra: Iterable[TileConfig] = ()) -> list[TileConfig]:
    """The small-batch grid (BLOCK_SIZE_K is the quant block, GROUP_SIZE_M is moot with one
    valid row per tile) plus `extra` (vLLM's default and the shipped entry), sorted."""
    plain = [TileConfig(BLOCK_M, n, 128, 1, w, s)
             for n, w, s in itertools.product(NO_SPLIT_N, NO_SPLIT_WARPS, NO_SPLIT_STAGES)
             if not (n == 128 and w == 1)]  # a 16x128 fp32 tile in one warp spills
    split = [TileConfig(BLOCK_M, n, 128, 1, w, s, k)
             for n, w, s, k in itertools.product(SPLIT_N, SPLIT_WARPS, SPLIT_STAGES, SPLITS)]
    return sorted({*plain, *split, *extra})


def extra_configs(extra: Iterable[TileConfig] = ()) -> list[TileConfig]:
    """A second grid around the first one's winners: 2-stage pipelines (GEMM2's K loop is 3
    iterations long) and 64-deep K tiles (half the bytes per load, twice the iterations to
    split), with and without split-K, plus `extra`."""
    two_stage = [TileConfig(BLOCK_M, n, 128, 1, w, 2, k)
                 for n, w, k in itertools.product(SPLIT_N, SPLIT_WARPS, (1, *SPLITS))]
    k64 = [TileConfig(BLOCK_M, n, 64, 1, w, s, k)
           for n, w, s, k in itertools.product((32, 64), SPLIT_WARPS, (3, 4), (1, 4, 8, 12))]
    return sorted({*two_stage, *k64, *extra})


@dataclass(frozen=True)
class Timed:
    """One config's quick result at one batch size: microseconds and relative error."""

    config: TileConfig
    us: float
    rel_err: float

    @classmethod
    def from_row(cls, row: Mapping[str, Any]) -> Timed:
        return cls(TileConfig.from_key(str(row["config"])), float(row["us"]),
                   float(row["rel_err"]))


def fastest(rows: Sequence[Timed], *, split: bool | None = None) -> Timed | None:
    """The fastest config (`split` False: only split_k 1, the ones vLLM's kernel runs
    unpatched; True: only split-K; None: any)."""
    pool = [r for r in rows if split is None or (r.config.split_k > 1) == split]
    return min(pool, key=lambda r: (r.us, r.config)) if pool else None


def floor_fraction(floor_us: float, us: float) -> float:
    """How close a time comes to the floor: 1.0 is reading the weights at the floor's rate."""
    if not (us > 0 and floor_us > 0):
        msg = f"times must be positive, got floor {floor_us!r} and {us!r}"
        raise ValueError(msg)
    return floor_us / us


def reaches_target(floor_us: float, us: float, target: float = FLOOR_TARGET) -> bool:
    return floor_fraction(floor_us, us) >= target


def time_at_target(floor_us: float, target: float = FLOOR_TARGET) -> float:
    """The pass time that would just reach `target` of the floor."""
    return floor_us / target


def split_k_picks(run: Mapping[str, Any], tolerance: float, where: str = "small-batch run"
                  ) -> dict[int, dict[str, Any]]:
    """From a small-batch run (scripts/measure/h200/small_batch_h200.py's JSON): per batch size the judge's
    record for its fastest split-K config, kept only where the judge chose it over vLLM's
    default and its relative error on both seeds is a number within `tolerance` (NaN fails).
    The run is read back as untrusted: a missing or mistyped field is ResultsInvalid naming it."""
    picks: dict[int, dict[str, Any]] = {}
    for batch, entry in _field(run, "batches", where, Mapping).items():
        at = f"{where}: batches.{batch}"
        for i, detail in enumerate(_field(entry, "details", at, list)):
            at_detail = f"{at}.details[{i}]"
            judge = _field(detail, "judge", at_detail, Mapping)
            if (_field(detail, "label", at_detail, str) != "best-split-k"
                    or _field(judge, "decision", f"{at_detail}.judge", str) != "tuned"):
                continue
            errors = (detail.get("rel_err"), detail.get("rel_err_fresh_seed"))
            if all(isinstance(e, float) and e <= tolerance for e in errors):
                _field(judge, "tuned_config", f"{at_detail}.judge", str)
                picks[_batch(batch, at)] = dict(judge)
    return picks


def confirmed(picks: Mapping[int, Mapping[str, Any]], checks: Sequence[Mapping[str, Any]]
              ) -> dict[int, Mapping[str, Any]]:
    """The picks that every `tune --check` run of the table holding them (each its own
    process) also judged a win for the same config: one run's noise estimate can be beaten
    by the scatter between processes, so a shipped entry needs both."""
    rows_per_check = [_check_rows(c, f"check run {i + 1}") for i, c in enumerate(checks)]
    kept: dict[int, Mapping[str, Any]] = {}
    for batch, pick in picks.items():
        rows = [next((r for r in rows if r["batch"] == batch), None) for rows in rows_per_check]
        if checks and all(r is not None and r["tuned_config"] == pick["tuned_config"]
                          and r["verdict"] == "wins" for r in rows):
            kept[batch] = pick
    return kept


def _check_rows(check: Mapping[str, Any], where: str) -> list[Mapping[str, Any]]:
    rows = _field(check, "per_batch", where, (Mapping, list))
    listed = list(rows.values()) if isinstance(rows, Mapping) else list(rows)
    for i, row in enumerate(listed):
        at = f"{where}: per_batch[{i}]"
        if not isinstance(row, Mapping):
            msg = f"{at}: expected an object, got {type(row).__name__}"
            raise ResultsInvalid(msg, hint=_HINT)
        _batch(_field(row, "batch", at, int), at)
        _field(row, "tuned_config", at, str)
        _field(row, "verdict", at, str)
    return listed


_HINT = "pass the JSON files the small-batch script and `m3patch tune --check --json` wrote"


def _field(record: object, key: str, where: str, kind: type | tuple[type, ...]) -> Any:
    """record[key], which must be of `kind` (a bool is never an int here)."""
    if not isinstance(record, Mapping):
        msg = f"{where}: expected an object, got {type(record).__name__}"
        raise ResultsInvalid(msg, hint=_HINT)
    value = record.get(key)
    if not isinstance(value, kind) or isinstance(value, bool):
        msg = f"{where}: '{key}' missing or not {_kind_name(kind)} (got {value!r:.60})"
        raise ResultsInvalid(msg, hint=_HINT)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(k.__name__ for k in kinds)


def _batch(value: object, where: str) -> int:
    try:
        batch = int(str(value))
    except ValueError:
        batch = 0
    if batch < 1:
        msg = f"{where}: batch size {value!r} is not a positive integer"
        raise ResultsInvalid(msg, hint=_HINT)
    return batch
