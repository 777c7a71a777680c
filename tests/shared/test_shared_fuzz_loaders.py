"""Mutated inputs to every loader, through the CLI entry: a documented exit code and an m3patch
message for each, never a traceback, a crash log (exit 70) or a hang.

The mutation engine and the oracle live in scripts/measure/fuzz_loaders.py, which runs many more inputs
for docs/reliability.md; here each loader gets FUZZ_INPUTS inputs with a fixed seed, so a failure
reproduces with `python scripts/measure/fuzz_loaders.py --per-loader 120 --only LOADER`.
"""

from __future__ import annotations

import json
from pathlib import Path

import fuzz_harness as fz
import pytest

FUZZ_INPUTS = 120
AGGREGATE_BUG = ("bug: bench/aggregate.py _check_row accepted a non-scalar dp_attention; "
                 "`bench compare` then dies with TypeError unhashable (exit 70, not 17)")
# Found by this fuzz and fixed by their owners; kept as regression tests below.
UTF8_BUG = ("bug: bench/results.py read_json_object let UnicodeDecodeError escape "
            "(a result file that is not UTF-8 exited 70, not 17)")
@pytest.mark.parametrize("loader", fz.LOADERS, ids=lambda loader: loader.name.replace(" ", "-"))
def test_mutated_inputs_keep_the_cli_contract(loader: fz.Loader) -> None:
    tally = fz.fuzz(loader, FUZZ_INPUTS, seed=0)
    assert tally.tried == FUZZ_INPUTS
    assert tally.failures == [], "\n".join(tally.failures[:5])
    # the fuzz must reach both outcomes, or it is not exercising the loader
    assert tally.by_code.get(0, 0) >= 1 and sum(tally.by_code.values()) > tally.by_code.get(0, 0)


def test_the_oracle_catches_an_internal_error(tmp_path: Path) -> None:
    """The judge must fail a crash; otherwise every test above could not fail."""
    crash = tmp_path / "crash"
    crash.mkdir()
    outcome = fz.run_cli(["bench", "compare", str(tmp_path / "x"), str(tmp_path / "x")], crash)
    assert fz.judge(outcome, crash) is None and outcome.code == 17  # a missing file: exit 17
    assert fz.judge(fz.Outcome(70, "m3patch: error: internal error", 0.1), crash) is not None
    assert fz.judge(fz.Outcome(0, "Traceback (most recent call last)", 0.1), crash) is not None
    assert fz.judge(fz.Outcome(-1, "", 10.0), crash) is not None


def _aggregate(tmp_path: Path) -> dict[str, object]:
    return dict(json.loads(fz._aggregate_seed(tmp_path)))


def test_bench_compare_on_a_non_utf8_aggregate_exits_17(tmp_path: Path) -> None:
    path = tmp_path / "aggregate.json"
    path.write_bytes(json.dumps(_aggregate(tmp_path)).encode().replace(b"cpu_tiny", b"cpu\xfftiny"))
    crash = tmp_path / "crash"
    crash.mkdir()
    outcome = fz.run_cli(["bench", "compare", str(path), str(path)], crash)
    assert outcome.code == 17, outcome.stderr


def test_bench_compare_with_a_mapping_for_dp_attention_exits_17(tmp_path: Path) -> None:
    data = _aggregate(tmp_path)
    data["rows"][0]["dp_attention"] = {"k": 1}  # type: ignore[index]
    path = tmp_path / "aggregate.json"
    path.write_text(json.dumps(data))
    crash = tmp_path / "crash"
    crash.mkdir()
    outcome = fz.run_cli(["bench", "compare", str(path), str(path)], crash)
    assert outcome.code == 17, outcome.stderr
