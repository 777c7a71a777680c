"""Hostile variants of every state file m3patch reads back (tests/shared/state_fuzz.py): no exit
70, no write or delete outside what m3patch owns, no exit 0 the files on disk contradict.

The default suite runs a fast sample; the extended suite (`-m extended`) runs 10,500 inputs over
the tree and run files, and 10,800 over the resumed cells, recipes, the series' launch spec, rendezvous records and
caches
(tests/shared/state_fuzz_more.py)."""

from __future__ import annotations

from pathlib import Path

import pytest
import state_fuzz as sf
import state_fuzz_more as sm

SAMPLE = 210  # 30 per target: about 10 s on the CI machine
EXTENDED = 10_500  # 1,500 per target


MORE_TARGETS = 10
MORE_SAMPLE = 30 * MORE_TARGETS  # about 9 s on the CI machine
MORE_EXTENDED = 1_200 * MORE_TARGETS


def _check(tallies: dict[str, sf.Tally], per_target: int) -> None:
    for name, tally in tallies.items():  # the table (shown with -s / -rP)
        codes = ", ".join(f"{c}: {n}" for c, n in sorted(tally.by_code.items()))
        print(f"{name}: {tally.tried} inputs, {len(tally.failures)} failures ({codes}; "
              f"cache misses {tally.misses})")
    failures = [f for t in tallies.values() for f in t.failures]
    assert failures == [], "\n".join(failures[:8])
    for name, tally in tallies.items():
        assert tally.tried == per_target, name
        # the fuzz must reach refusals (or, for a cache, misses), or it is not exercising the
        # reader
        refused = sum(c for code, c in tally.by_code.items() if code != 0)
        assert refused + tally.misses > 0, (name, tally.by_code)


def test_hostile_state_files_sample(tmp_path: Path) -> None:
    _check(sf.fuzz(tmp_path, SAMPLE, seed=0), SAMPLE // 7)


@pytest.mark.extended
def test_hostile_state_files_extended(tmp_path: Path) -> None:
    _check(sf.fuzz(tmp_path, EXTENDED, seed=1), EXTENDED // 7)


def test_hostile_cells_recipes_records_and_caches_sample(tmp_path: Path) -> None:
    _check(sm.fuzz(tmp_path, MORE_SAMPLE, seed=0), MORE_SAMPLE // MORE_TARGETS)


@pytest.mark.extended
def test_hostile_cells_recipes_records_and_caches_extended(tmp_path: Path) -> None:
    _check(sm.fuzz(tmp_path, MORE_EXTENDED, seed=1), MORE_EXTENDED // MORE_TARGETS)


def test_the_state_oracle_sees_a_write_outside(tmp_path: Path) -> None:
    """The sentinel snapshot must change when something outside is written: else the oracle
    above could not fail."""
    folder = tmp_path / "outside"
    folder.mkdir()
    (folder / "victim.json").write_text("{}")
    before = sf.snapshot(folder)
    (folder / "victim.json").write_text("{} ")
    assert sf.snapshot(folder) != before
    (folder / "victim.json").unlink()
    assert sf.snapshot(folder) != before
