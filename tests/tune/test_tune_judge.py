"""CPU tests for the judge (m3patch/tune/judge.py): its decision on recorded H200 timings.

The fixtures are read from the two recorded bench runs in docs/results/tune-h200 (bench.json
of the third call, run1-bench.txt of the first); no timing here is typed in except in the
small synthetic cases that pin the rule's edges.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from m3patch.tune.judge import Judgement, format_table, judge, measure
from m3patch.tune.tile import TileConfig

RESULTS = Path(__file__).resolve().parents[2] / "docs/results/tune-h200"
EP8_PREFIX = "E=16,"
TP8_PREFIX = "E=128,"
_ROW = re.compile(r"^(EP8 E16|TP8 E128)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s")


def _run1() -> dict[tuple[str, int], tuple[float, float]]:
    """(shape prefix, batch) -> (tuned us, default us) from the first run's printed table."""
    rows = {}
    for line in (RESULTS / "run1-bench.txt").read_text(encoding="utf-8").splitlines():
        match = _ROW.match(line)
        if match:
            prefix = EP8_PREFIX if match[1] == "EP8 E16" else TP8_PREFIX
            rows[(prefix, int(match[2]))] = (float(match[3]), float(match[4]))
    return rows


def _run2() -> dict[tuple[str, int], tuple[float, float]]:
    rows: list[dict[str, Any]] = json.loads((RESULTS / "bench.json").read_text())["rows"]
    return {(row["shape"].split(",")[0] + ",", row["batch"]): (row["tuned_us"], row["default_us"])
            for row in rows}


def _recorded(prefix: str, batch: int) -> Judgement:
    """The two recorded runs as two paired rounds of one judgement."""
    first, second = _run1()[(prefix, batch)], _run2()[(prefix, batch)]
    return judge(batch, "tuned", "default", (first[0], second[0]), (first[1], second[1]))


def test_the_fixtures_hold_both_runs_at_every_batch() -> None:
    assert set(_run1()) == set(_run2())
    assert len(_run1()) == 38


@pytest.mark.parametrize("batch", [4, 8, 16, 24, 32, 48, 64, 96, 128])
def test_shipped_ep8_table_keeps_the_default_where_both_runs_saw_it_lose(batch: int) -> None:
    verdict = _recorded(EP8_PREFIX, batch)
    assert verdict.ratio > 1.0
    assert verdict.decision == "default"
    assert verdict.verdict == "loses"  # both runs slower: beyond the two runs' own spread


@pytest.mark.parametrize("batch", [96, 128, 256])
def test_tp8_gains_both_runs_agree_on_are_kept(batch: int) -> None:
    verdict = _recorded(TP8_PREFIX, batch)
    assert verdict.verdict == "wins" and verdict.decision == "tuned"
    assert verdict.ratio < 0.9


def test_runs_that_disagree_on_the_sign_are_a_tie_and_keep_the_default() -> None:
    """EP8 M=1: one run 2 % faster, the other 2 % slower: the gain is within the noise."""
    verdict = _recorded(EP8_PREFIX, 1)
    assert min(verdict.tuned_rounds[i] / verdict.default_rounds[i] for i in range(2)) < 1
    assert max(verdict.tuned_rounds[i] / verdict.default_rounds[i] for i in range(2)) > 1
    assert verdict.verdict == "tie" and verdict.decision == "default"


def test_no_recorded_entry_the_judge_keeps_was_slower_in_either_run() -> None:
    for (prefix, batch), (tuned, default) in _run2().items():
        verdict = _recorded(prefix, batch)
        if verdict.decision == "tuned":
            first = _run1()[(prefix, batch)]
            assert tuned < default and first[0] < first[1], (prefix, batch)


def test_rule_edges() -> None:
    steady = judge(8, "a", "b", (97.0, 98.0, 97.5), (100.0, 100.0, 100.0))
    assert steady.verdict == "wins" and steady.chosen == "a"
    assert steady.noise == pytest.approx(0.005)
    noisy = judge(8, "a", "b", (90.0, 104.0, 97.0), (100.0, 100.0, 100.0))
    assert noisy.verdict == "tie" and noisy.chosen == "b"
    slow = judge(8, "a", "b", (103.0, 104.0), (100.0, 100.0))
    assert slow.loses and slow.chosen == "b"
    same = judge(8, "a", "a", (99.0, 101.0), (100.0, 100.0))
    assert same.verdict == "same" and same.decision == "default" and not same.loses


def test_timings_must_pair_and_be_real() -> None:
    with pytest.raises(ValueError, match="paired rounds"):
        judge(1, "a", "b", (1.0,), (1.0,))
    with pytest.raises(ValueError, match="paired rounds"):
        judge(1, "a", "b", (1.0, 2.0), (1.0,))
    with pytest.raises(ValueError, match="positive finite"):
        judge(1, "a", "b", (1.0, float("nan")), (1.0, 1.0))


def test_record_and_table_carry_tuned_default_noise_and_decision() -> None:
    verdict = _recorded(EP8_PREFIX, 16)
    record = verdict.to_dict()
    assert {"tuned_us", "default_us", "noise", "verdict", "decision"} <= set(record)
    assert record["decision"] == "default"
    table = format_table([("EP8 E16", verdict)])
    assert "loses -> default" in table and "noise" in table.splitlines()[0]


class _ReplayBench:
    """Replays recorded timings in call order, and logs which config ran when. A stand-in for
    the GPU bench: what is tested is the order of the rounds, not a timing."""

    def __init__(self, tuned: TileConfig, timings: dict[TileConfig, list[float]]) -> None:
        self.tuned = tuned
        self.timings = timings
        self.calls: list[str] = []
        self.checked: list[TileConfig] = []

    def setup(self, batch: int) -> int:
        return batch

    def check(self, setup: int, cfg: TileConfig) -> float:
        self.checked.append(cfg)
        return 0.0

    def time(self, setup: int, cfg: TileConfig, reps: int) -> float:
        self.calls.append("t" if cfg == self.tuned else "d")
        return self.timings[cfg].pop(0)


def test_measure_checks_both_then_alternates_the_order() -> None:
    tuned, default = TileConfig(16, 64, 128, 1, 4, 5), TileConfig(16, 64, 128, 1, 4, 4)
    recorded = _recorded(EP8_PREFIX, 16)
    cold = [1.12 * recorded.tuned_rounds[0]]  # a slow first slot, as the H200 showed
    bench = _ReplayBench(tuned, {tuned: cold + list(recorded.tuned_rounds) * 2,
                                 default: [recorded.default_rounds[0]]
                                 + list(recorded.default_rounds) * 2})
    verdict = measure(bench, 16, tuned, default, rounds=4, reps=3)
    assert bench.checked == [tuned, default]
    warmup, rounds = bench.calls[:2], bench.calls[2:]
    assert warmup == ["t", "d"] and rounds == ["t", "d", "d", "t", "t", "d", "d", "t"]
    assert verdict.warmup_us == (cold[0], recorded.default_rounds[0])
    assert verdict.tuned_rounds == recorded.tuned_rounds * 2  # the warm-up is kept apart
    assert verdict.decision == "default" and verdict.tuned == tuned.key
    with pytest.raises(ValueError, match="rounds"):
        measure(bench, 16, tuned, default, rounds=1)


def test_the_table_sidecar_records_each_judgement(tmp_path: Path) -> None:
    from m3patch.tune.writer import JUDGE_RULE, Provenance, write_table

    verdict = _recorded(EP8_PREFIX, 16)
    prov = Provenance("NVIDIA H200", "580", "2.11", "3.6", "2026-12-01T00:00:00Z", "m3patch tune",
                      "source:x", "0" * 64, "E=16,N=3072,K=6144,topk=4,dtype=fp8_w8a8,block=128x128,ep",
                      {16: verdict.default_us}, True, judged={16: verdict})
    path = write_table(tmp_path, "t.json", {16: TileConfig(16, 64, 128, 1, 4, 4)}, prov)
    sidecar = json.loads((path.parent / "t.json.provenance.json").read_text())
    assert sidecar["judge"]["rule"] == JUDGE_RULE
    assert sidecar["judge"]["per_batch"]["16"] == json.loads(json.dumps(verdict.to_dict()))


JUDGE_RUNS = RESULTS / "judge"
JUDGED_TABLES = RESULTS / "judged-tables"


def _recorded_rows() -> list[tuple[str, dict[str, Any]]]:
    rows = []
    for path in sorted(JUDGE_RUNS.glob("call*/*.json")):
        data = json.loads(path.read_text())
        for row in data.get("per_batch") or data.get("rows", []):
            rows.append((f"{path.parent.name}/{path.name} M={row['batch']}", row))
    return rows


def test_every_recorded_device_verdict_is_what_the_rule_gives() -> None:
    """The H200 runs' verdicts come from this pure rule applied to their own rounds (recorded
    to 0.01 us: a verdict may differ only where that rounding moves the ratio across the
    noise band)."""
    rows = _recorded_rows()
    assert len(rows) > 300
    differ = 0
    for where, row in rows:
        again = judge(row["batch"], row["tuned_config"], row["default_config"],
                      row["tuned_rounds_us"], row["default_rounds_us"])
        assert again.ratio == pytest.approx(row["ratio"], abs=2e-3), where
        if again.verdict != row["verdict"]:
            rounding = 4 * 0.005 / min(*row["tuned_rounds_us"], *row["default_rounds_us"])
            assert abs(abs(again.ratio - 1) - again.noise) < rounding, where
            differ += 1
    assert differ <= 3


def test_without_a_warm_up_round_the_first_slot_inflates_the_noise() -> None:
    """call1 had no warm-up round: in its A/A rows (entry == default) dropping the first round
    shrinks the noise at most batch sizes; call2 on has the warm-up kept apart."""
    same = [row for where, row in _recorded_rows()
            if where.startswith("call1/check-") and row["verdict"] == "same"]
    shrunk = [judge(r["batch"], "a", "a", r["tuned_rounds_us"][1:], r["default_rounds_us"][1:]
                    ).noise < r["noise"] for r in same]
    assert len(same) > 20 and sum(shrunk) > 0.8 * len(same)
    later = [row for where, row in _recorded_rows() if not where.startswith("call1/")]
    assert all(len(row["warmup_us"]) == 2 for row in later)


def test_candidate_tables_are_what_call3_measured_and_no_entry_lost() -> None:
    from m3patch.tune.writer import read_table

    runs = sorted(JUDGE_RUNS.glob("call3/bench-*run*.json"))
    assert len(runs) == 2
    for run in runs:
        rows = json.loads(run.read_text())["rows"]
        for table_path in JUDGED_TABLES.glob("E=*].json"):
            prov = json.loads((table_path.parent / (table_path.name + ".provenance.json"))
                              .read_text())
            mine = {r["batch"]: r for r in rows if r["shape"] == prov["shape"]}
            table = read_table(table_path)
            assert sorted(mine) == sorted(table)
            for batch, cfg in table.items():
                assert mine[batch]["tuned_config"] == cfg.key, (run.name, batch)
                assert mine[batch]["verdict"] != "loses", (run.name, batch)
            assert set(prov["judge"]["per_batch"]) == {str(b) for b in table}
    ep8 = json.loads(next(JUDGED_TABLES.glob("E=16,*.provenance.json")).read_text())
    assert "--routing ep-rank --ep-ranks 8" in ep8["routing"]


class _ScriptedBench(_ReplayBench):
    """The tuner's view of a bench (shape, cache key, setup/check/time) replaying scripted
    timings per config in call order: quick, refine, then the judge's rounds."""

    def __init__(self, tuned: TileConfig, timings: dict[TileConfig, list[float]]) -> None:
        from m3patch.tune.shapes import MoEShape

        super().__init__(tuned, timings)
        self.shape = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", (128, 128), True)
        self.cache_key = self.shape.key


@pytest.mark.parametrize(("judged_us", "expect_tuned"), [(104.0, False), (97.0, True)])
def test_the_tuners_final_choice_is_the_judges(judged_us: float, expect_tuned: bool) -> None:
    """The refine step times the pick faster than the default either way; the judge's
    head-to-head decides what the table gets."""
    pytest.importorskip("torch")
    from m3patch.tune.cache import ResultCache
    from m3patch.tune.tuner import Progress, TuneOptions, tune_batch

    pick, default = TileConfig(16, 64, 128, 1, 4, 5), TileConfig(16, 64, 128, 1, 4, 4)
    bench = _ScriptedBench(pick, {pick: [90.0, 95.0, 100.0] + [judged_us] * 6,
                                  default: [100.0, 100.0, 100.0] + [100.0] * 6})
    best = tune_batch(bench, 16, [pick, default], ResultCache(None),  # type: ignore[arg-type]
                      TuneOptions(refine_top=1), Progress(2, "t"), default)
    assert best is not None and best.judgement is not None
    assert best.judgement.verdict == ("wins" if expect_tuned else "loses")
    assert best.config == (pick if expect_tuned else default)
    assert best.us == pytest.approx(judged_us if expect_tuned else 100.0)
