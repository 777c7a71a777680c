"""The judge: is a tuned config really faster than vLLM's default at one batch size?

One measurement decides every shipped entry: the tuner's final pick, `m3patch tune --check`
and scripts/measure/h200/bench_moe_tables.py all call `measure`. Both configs run on the same inputs and
routing (one `MoEBench` setup), each timed as a CUDA-graph replay of GEMM1+GEMM2, in rounds
that alternate their order (tuned first, then default first, ...) so clock drift and order
effects hit both, after one warm-up round whose timings are kept apart: on the H200 the
first timing after a batch's setup ran 10-12 % slow whichever config took it (recorded in
docs/results/tune-h200/judge/), and the bench before this judge always gave that slot to the
tuned config. Each round gives one paired ratio tuned/default; their median is the
estimate and half their spread is the noise. The pure `judge` keeps vLLM's default unless the
tuned config wins by more than that noise: a table never ships an entry whose gain the
measurement cannot tell from its own scatter.

Pure apart from `measure`, which drives a bench object (kernel_timer.MoEBench) it is handed,
so this module imports no torch and its decision logic is tested on recorded timings.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from m3patch.tune.tile import TileConfig

Verdict = Literal["wins", "tie", "loses", "same"]
MIN_ROUNDS = 2
DEFAULT_ROUNDS = 6  # 3 of each order; half the spread of 6 paired ratios is the noise
JUDGE_RULE = ("per batch size the config under test (the tuner's fastest refined pick, or a "
              "table's entry) and vLLM's default are timed head to head (m3patch/tune/judge.py: "
              "same inputs, CUDA-graph replays, one warm-up round kept apart, then rounds "
              "alternating the order); the default stays unless the median tuned/default ratio "
              "is below 1 by more than the noise (half the spread of the per-round ratios)")


class Bench(Protocol):
    """What `measure` needs from kernel_timer.MoEBench (kept structural: no torch import)."""

    def setup(self, batch: int) -> Any: ...

    def check(self, setup: Any, cfg: TileConfig) -> float: ...

    def time(self, setup: Any, cfg: TileConfig, reps: int) -> float: ...


@dataclass(frozen=True)
class Judgement:
    """One batch size: tuned vs default, per-round timings, the noise and the verdict."""

    batch: int
    tuned: str  # config keys (TileConfig.key)
    default: str
    tuned_rounds: tuple[float, ...]  # microseconds, one median per round
    default_rounds: tuple[float, ...]
    ratio: float  # median of the per-round tuned/default ratios
    noise: float  # half the spread of those ratios (a fraction: 0.01 is 1 %)
    verdict: Verdict
    warmup_us: tuple[float, ...] = ()  # the discarded first round (tuned, default)

    @property
    def tuned_us(self) -> float:
        return float(statistics.median(self.tuned_rounds))

    @property
    def default_us(self) -> float:
        return float(statistics.median(self.default_rounds))

    @property
    def decision(self) -> Literal["tuned", "default"]:
        return "tuned" if self.verdict == "wins" else "default"

    @property
    def chosen(self) -> str:
        return self.tuned if self.decision == "tuned" else self.default

    @property
    def loses(self) -> bool:
        return self.verdict == "loses"

    def to_dict(self) -> dict[str, Any]:
        return {"batch": self.batch, "tuned_config": self.tuned, "default_config": self.default,
                "tuned_us": round(self.tuned_us, 2), "default_us": round(self.default_us, 2),
                "ratio": round(self.ratio, 4), "noise": round(self.noise, 4),
                "verdict": self.verdict, "decision": self.decision,
                "tuned_rounds_us": [round(t, 4) for t in self.tuned_rounds],
                "default_rounds_us": [round(t, 4) for t in self.default_rounds],
                "warmup_us": [round(t, 4) for t in self.warmup_us]}


def _check_rounds(tuned: Sequence[float], default: Sequence[float]) -> None:
    if len(tuned) != len(default) or len(tuned) < MIN_ROUNDS:
        msg = (f"the judge needs paired rounds, at least {MIN_ROUNDS}: got {len(tuned)} tuned "
               f"and {len(default)} default timings")
        raise ValueError(msg)
    for value in (*tuned, *default):
        if not (math.isfinite(value) and value > 0):
            msg = f"a timing must be a positive finite number of microseconds, got {value!r}"
            raise ValueError(msg)


def judge(batch: int, tuned: str, default: str, tuned_rounds: Sequence[float],
          default_rounds: Sequence[float], warmup_us: Sequence[float] = ()) -> Judgement:
    """Verdict from paired rounds: `wins` only when the median ratio is below 1 by more than
    the noise, `loses` when above 1 by more than the noise, else `tie`; the same config on
    both sides is `same` (its spread is then an A/A measure of the noise)."""
    _check_rounds(tuned_rounds, default_rounds)
    ratios = [t / d for t, d in zip(tuned_rounds, default_rounds, strict=True)]
    ratio = float(statistics.median(ratios))
    noise = (max(ratios) - min(ratios)) / 2
    verdict: Verdict
    if tuned == default:
        verdict = "same"
    elif ratio < 1 - noise:
        verdict = "wins"
    elif ratio > 1 + noise:
        verdict = "loses"
    else:
        verdict = "tie"
    return Judgement(batch, tuned, default, tuple(tuned_rounds), tuple(default_rounds), ratio,
                     noise, verdict, tuple(warmup_us))


def measure(bench: Bench, batch: int, tuned: TileConfig, default: TileConfig, *,
            rounds: int = DEFAULT_ROUNDS, reps: int = 30) -> Judgement:
    """Time both configs head to head on one setup: one warm-up round (kept apart), then
    `rounds` rounds alternating which goes first.

    Both are checked against the float32 reference first (kernel_timer raises ConfigFailed
    for a config that computes a wrong result: it never reaches the timing)."""
    if rounds < MIN_ROUNDS:
        msg = f"rounds must be >= {MIN_ROUNDS}, got {rounds}"
        raise ValueError(msg)
    setup = bench.setup(batch)
    bench.check(setup, tuned)
    bench.check(setup, default)
    times: dict[str, list[float]] = {"tuned": [], "default": []}
    pair = (("tuned", tuned), ("default", default))
    warmup = [bench.time(setup, cfg, reps) for _, cfg in pair]
    for index in range(rounds):
        for name, cfg in pair if index % 2 == 0 else pair[::-1]:
            times[name].append(bench.time(setup, cfg, reps))
    return judge(batch, tuned.key, default.key, times["tuned"], times["default"], warmup)


def format_table(rows: Sequence[tuple[str, Judgement]]) -> str:
    """One line per (label, judgement): the table `tune --check` and the bench print."""
    lines = [f"{'shape':<10} {'M':>5} {'tuned us':>9} {'default us':>10} {'t/d':>6} "
             f"{'noise':>6}  verdict"]
    for label, j in rows:
        lines.append(f"{label:<10} {j.batch:>5} {j.tuned_us:9.1f} {j.default_us:10.1f} "
                     f"{j.ratio:6.3f} {100 * j.noise:5.1f}%  {j.verdict} -> {j.decision}")
    return "\n".join(lines)
