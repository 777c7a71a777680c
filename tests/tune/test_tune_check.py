"""CPU tests for `m3patch tune --check TABLE`: which shape a table is judged at, the report,
the exit code when an entry loses, and failing closed on a machine with no GPU."""

from __future__ import annotations

import json
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from m3patch.errors import BenchFailed, UsageError
from m3patch.tune import naming
from m3patch.tune.judge import judge
from m3patch.tune.shapes import MoEShape, shape_from_key
from m3patch.tune.table_check import fail_on_losses, report, shape_for_table, table_entries

REPO = Path(__file__).resolve().parents[2]
TABLES = REPO / "docs/results/tune-h200/tables"
EP8 = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", (128, 128), True)
TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
Cli = Callable[..., subprocess.CompletedProcess[str]]


def _table(shape: MoEShape) -> Path:
    return TABLES / naming.table_file_name(shape, "NVIDIA H200")


@pytest.mark.parametrize("shape", [EP8, TP8, MoEShape(8, 64, 128, 2, "bf16", None)])
def test_shape_key_round_trips(shape: MoEShape) -> None:
    assert shape_from_key(shape.key, "x") == shape


@pytest.mark.parametrize("key", [None, 7, "E=16,N=3072", "E=0,N=1,K=1,topk=1,dtype=bf16,block=none",
                                 "E=4,N=1,K=1,topk=5,dtype=bf16,block=none",
                                 "E=4,N=1,K=1,topk=1,dtype=int4,block=none"])
def test_hostile_shape_keys_are_usage_errors(key: object) -> None:
    with pytest.raises(UsageError, match=r"sidecar\.json key 'shape'"):
        shape_from_key(key, "sidecar.json key 'shape'")  # type: ignore[arg-type]


@pytest.mark.parametrize("shape", [EP8, TP8])
def test_shipped_tables_are_judged_at_the_shape_their_sidecar_records(shape: MoEShape) -> None:
    assert shape_for_table(_table(shape), None) == shape
    assert sorted(table_entries(_table(shape)))[0] == 1


def test_a_given_shape_must_match_the_table_name(tmp_path: Path) -> None:
    assert shape_for_table(_table(EP8), EP8) == EP8
    with pytest.raises(UsageError, match="E=16,N=3072 but the shape is E=128,N=384"):
        shape_for_table(_table(EP8), TP8)
    bare = tmp_path / _table(EP8).name
    shutil.copy(_table(EP8), bare)
    with pytest.raises(UsageError, match=r"no .*provenance.json beside it"):
        shape_for_table(bare, None)
    assert shape_for_table(bare, EP8) == EP8
    with pytest.raises(UsageError, match="no such table file"):
        shape_for_table(tmp_path / "missing.json", EP8)
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(UsageError, match="not a vLLM fused-MoE table name"):
        shape_for_table(tmp_path / "x.json", EP8)


@pytest.mark.parametrize("sidecar", ["[1, 2]", "{not json", '{"shape": "E=16,N=3072,K=1"}'])
def test_a_hostile_sidecar_fails_with_one_message(tmp_path: Path, sidecar: str) -> None:
    table = tmp_path / _table(EP8).name
    shutil.copy(_table(EP8), table)
    table.with_name(table.name + ".provenance.json").write_text(sidecar)
    with pytest.raises(UsageError, match=r"provenance\.json"):
        shape_for_table(table, None)


def test_losing_entries_exit_with_bench_failed_and_name_each_batch(tmp_path: Path) -> None:
    wins = judge(2, "a", "b", (92.0, 92.5), (100.0, 100.0))
    loses = judge(16, "a", "b", (104.0, 103.0), (100.0, 100.0))
    same = judge(1, "b", "b", (99.0, 101.0), (100.0, 100.0))
    fail_on_losses(_table(EP8), [wins, same], tmp_path / "c.json")  # nothing loses: no error
    with pytest.raises(BenchFailed, match=r"1 of 3 entries .* M=16 1.035x") as caught:
        fail_on_losses(_table(EP8), [wins, loses, same], tmp_path / "c.json")
    assert caught.value.exit_code == 14 and "re-tune" in (caught.value.hint or "")


def test_report_records_tuned_default_noise_and_verdict_per_batch() -> None:
    verdicts = [judge(16, "a", "b", (104.0, 103.0), (100.0, 100.0)),
                judge(32, "a", "b", (99.0, 100.5), (100.0, 100.0))]
    data = report(_table(EP8), EP8, "bench", verdicts, {"device": "NVIDIA H200"})
    assert data["losing_batches"] == [16] and data["shape"] == EP8.key
    assert [row["verdict"] for row in data["per_batch"]] == ["loses", "tie"]
    assert all({"tuned_us", "default_us", "noise", "decision"} <= set(row)
               for row in data["per_batch"])
    json.dumps(data, allow_nan=False)


def test_check_on_a_machine_without_a_gpu_fails_closed(m3patch_cli: Cli, tmp_path: Path) -> None:
    """This machine has no CUDA device (with or without torch): one message, exit 2, no
    traceback, nothing written."""
    result = m3patch_cli("tune", "--check", str(_table(EP8)), "--out-dir", str(tmp_path),
                         env={"CUDA_VISIBLE_DEVICES": ""})
    assert result.returncode == 2, result.stderr
    assert ("needs a GPU" in result.stderr or "needs torch and triton" in result.stderr)
    assert "Traceback" not in result.stderr and "fix:" in result.stderr
    assert not list(tmp_path.iterdir())


def test_check_option_errors_come_before_any_gpu_work(m3patch_cli: Cli, tmp_path: Path) -> None:
    result = m3patch_cli("tune", "--check", str(_table(EP8)), "--judge-rounds", "1")
    assert result.returncode == 2 and "--judge-rounds must be >= 2" in result.stderr
    result = m3patch_cli("tune", "--check", str(_table(EP8)), "--shape", "128,384,6144,4")
    assert result.returncode == 2 and "but the shape is E=128,N=384" in result.stderr
