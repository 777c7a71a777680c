"""CPU tests for m3patch tune: shapes, pruning, naming against vLLM 0.33.0's source, JSON."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from m3patch.errors import ResultsInvalid, UsageError
from m3patch.patching.pristine import pristine_tree
from m3patch.tune import kernel_source, naming
from m3patch.tune.cache import Result, ResultCache
from m3patch.tune.shapes import (
    DEFAULT_BATCH_SIZES,
    MoEShape,
    parse_batch_sizes,
    parse_block_shape,
    parse_explicit_shape,
    shapes_from_model_config,
)
from m3patch.tune.tile import TileConfig, launches_needed, refine_candidates
from m3patch.tune.writer import (
    ROUTING_DENSE,
    ROUTING_EP,
    Provenance,
    SearchRecord,
    nearest_config,
    read_table,
    write_table,
)

M3_CONFIG = {"hidden_size": 6144, "intermediate_size": 3072, "num_local_experts": 128,
             "num_experts_per_tok": 4, "n_shared_experts": 1}
BLOCK = (128, 128)
EP8 = MoEShape(16, 3072, 6144, 4, "fp8_w8a8", BLOCK, True)
TP8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", BLOCK, False)


def _fused_moe_source() -> str:
    root = pristine_tree("0.33.0")
    return (root / kernel_source.FUSED_MOE_RELPATH).read_text(encoding="utf-8")


@pytest.mark.parametrize(("tp", "ep", "fse", "expected"), [
    (8, False, False, (128, 384)), (8, True, False, (16, 3072)), (8, False, True, (129, 384)),
    (4, False, False, (128, 768)), (4, True, False, (32, 3072)), (2, False, True, (129, 1536)),
])
def test_shapes_from_m3_config_match_the_design_table(tp: int, ep: bool, fse: bool,
                                                      expected: tuple[int, int]) -> None:
    shape = shapes_from_model_config(M3_CONFIG, tp=tp, ep=ep, fused_shared_experts=fse,
                                     dtype="fp8_w8a8", block_shape=BLOCK)
    assert (shape.num_experts, shape.width, shape.hidden, shape.top_k) == (*expected, 6144, 4)
    assert shape.expert_parallel is ep


def test_shape_errors_say_what_and_how() -> None:
    with pytest.raises(UsageError, match="fused shared experts"):
        shapes_from_model_config(M3_CONFIG, tp=8, ep=True, fused_shared_experts=True,
                                 dtype="fp8_w8a8", block_shape=BLOCK)
    with pytest.raises(UsageError, match="does not divide"):
        shapes_from_model_config(M3_CONFIG, tp=5, ep=False, fused_shared_experts=False,
                                 dtype="fp8_w8a8", block_shape=BLOCK)
    with pytest.raises(UsageError, match="shared-expert count"):
        shapes_from_model_config({**M3_CONFIG, "n_shared_experts": 0}, tp=8, ep=False,
                                 fused_shared_experts=True, dtype="fp8_w8a8", block_shape=BLOCK)
    with pytest.raises(UsageError, match="expert count"):
        shapes_from_model_config({"hidden_size": 1}, tp=1, ep=False,
                                 fused_shared_experts=False, dtype="bf16", block_shape=None)
    with pytest.raises(UsageError, match="four positive integers"):
        parse_explicit_shape("16,3072,6144", dtype="fp8_w8a8", block_shape=BLOCK)
    with pytest.raises(UsageError, match="top-k"):
        parse_explicit_shape("2,3072,6144,4", dtype="fp8_w8a8", block_shape=BLOCK)


def test_explicit_shape_and_list_parsing() -> None:
    shape = parse_explicit_shape("16,3072,6144,4,ep", dtype="fp8_w8a8", block_shape=BLOCK)
    assert shape == EP8
    assert parse_block_shape("128x128") == BLOCK
    assert parse_block_shape("none") is None
    assert parse_batch_sizes("default") == DEFAULT_BATCH_SIZES
    assert parse_batch_sizes("64,1,64") == (1, 64)
    with pytest.raises(UsageError):
        parse_batch_sizes("0,4")


def test_file_names_follow_vllm() -> None:
    assert naming.normalized_device_name("NVIDIA H200") == "NVIDIA_H200"
    assert naming.normalized_device_name("NVIDIA H200 NVL") == "NVIDIA_H200"
    assert naming.normalized_device_name("AMD Instinct MI300X") == "AMD_Instinct_MI300X"
    assert naming.normalized_device_name("NVIDIA H100 80GB HBM3") == "NVIDIA_H100_80GB_HBM3"
    assert (naming.table_file_name(EP8, "NVIDIA H200")
            == "E=16,N=3072,device_name=NVIDIA_H200,dtype=fp8_w8a8,block_shape=[128,128].json")
    bf16 = MoEShape(128, 384, 6144, 4, "bf16", None)
    assert naming.table_file_name(bf16, "NVIDIA H200") == "E=128,N=384,device_name=NVIDIA_H200.json"


def test_upstream_tables_parse_with_our_reader() -> None:
    """The names we build match files vLLM ships, and its tables load through read_table."""
    configs = pristine_tree("0.33.0") / "vllm/model_executor/layers/fused_moe/configs"
    name = naming.config_file_name(128, 384, "fp8_w8a8", BLOCK, "AMD Instinct MI300X")
    assert (configs / name).is_file()
    table = read_table(configs / name)
    assert 1 in table and isinstance(table[1], TileConfig)


def test_naming_and_defaults_mirror_the_0_33_0_source() -> None:
    """Guard against a vLLM edit that our reimplementation would silently miss."""
    src = _fused_moe_source()
    assert 'if "H200" in device_name.split("_"):' in src
    assert 'f",block_shape={block_shape}"' in src
    assert '"BLOCK_SIZE_M": 16 if M <= 64 else 64,' in src
    assert '"GROUP_SIZE_M": 1 if M <= 16 else 32,' in src
    assert "num_stages = 4 if M <= 4 else 3" in src
    assert "BLOCK_SIZE_K = min(BLOCK_SIZE_K, min(block_shape[0], block_shape[1]))" in src
    assert 'tuned_config.pop("triton_version", None)' in src


def test_default_config_block_fp8_cuda() -> None:
    assert naming.default_config(EP8, 1) == TileConfig(16, 64, 128, 1, 4, 4)
    assert naming.default_config(EP8, 8) == TileConfig(16, 64, 128, 1, 4, 3)
    assert naming.default_config(EP8, 16) == TileConfig(16, 128, 128, 1, 4, 3)
    assert naming.default_config(EP8, 64) == TileConfig(16, 128, 128, 32, 4, 3)
    assert naming.default_config(EP8, 65) == TileConfig(64, 128, 128, 32, 4, 3)
    assert naming.default_config(EP8, 4096, rocm=True) == TileConfig(64, 128, 128, 32, 4, 2)


def test_kernel_extraction_takes_the_kernel_and_its_callees_only() -> None:
    texts = kernel_source.extract_kernel_functions(_fused_moe_source())
    names = [re.search(r"def (\w+)\(", text)[1] for text in texts]  # type: ignore[index]
    assert names == ["write_zeros_to_output", "fused_moe_kernel"]
    assert all(text.startswith("@triton.jit") for text in texts)
    module = kernel_source.generated_module_text(_fused_moe_source(), "test")
    compile(module, "generated", "exec")  # valid Python on its own
    assert "import vllm" not in module and "from vllm" not in module


def test_kernel_source_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(Exception, match="no vllm/model_executor"):
        kernel_source.find_fused_moe_file(tmp_path)
    with pytest.raises(Exception, match="defines no function"):
        kernel_source.extract_kernel_functions("def other():\n    pass\n")


def _prov() -> Provenance:
    return Provenance("NVIDIA H200", "580", "2.11", "3.6.0", "2026-11-29T00:00:00Z",
                      "m3patch tune ...", "source:x", "ab" * 32, EP8.key, {1: 10.0, 64: 20.0})


def test_written_table_is_what_vllm_loads(tmp_path: Path) -> None:
    best = {64: TileConfig(16, 64, 128, 1, 4, 4), 1: TileConfig(16, 32, 128, 1, 4, 5)}
    path = write_table(tmp_path, naming.table_file_name(EP8, "NVIDIA H200"), best, _prov())
    raw = json.loads(path.read_text())
    assert list(raw) == ["triton_version", "1", "64"]
    raw.pop("triton_version")  # exactly what get_moe_configs does before int(key)
    loaded = {int(k): v for k, v in raw.items()}
    assert loaded[1] == best[1].to_vllm()
    assert read_table(path) == best
    assert nearest_config(read_table(path), 30) == best[1]
    prov = json.loads(path.with_name(path.name + ".provenance.json").read_text())
    assert prov["device"] == "NVIDIA H200" and prov["median_us_gemm1_plus_gemm2"]["64"] == 20.0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [path.name, path.name + ".provenance.json"])  # no staging files left


def test_read_table_rejects_keys_vllm_would_crash_on(tmp_path: Path) -> None:
    bad = tmp_path / "t.json"
    bad.write_text(json.dumps({"provenance": {"x": 1}, "1": TileConfig(16, 32, 128, 1, 4,
                                                                         3).to_vllm()}))
    with pytest.raises(ResultsInvalid, match="provenance"):
        read_table(bad)


def test_result_cache_resumes_and_skips_torn_lines(tmp_path: Path) -> None:
    path = tmp_path / "cache.jsonl"
    cache = ResultCache(path)
    cache.add(Result(EP8.key, 64, "M16", "quick", 12.5, 0.003))
    cache.add(Result(EP8.key, 64, "M32", "failed", None, note="OutOfResources"))
    with path.open("a") as fh:
        fh.write('{"shape": "torn')
    again = ResultCache(path)
    hit = again.get(EP8.key, 64, "M16", "quick")
    assert hit is not None and hit.us == 12.5
    assert again.failed(EP8.key, 64, "M32") and not again.failed(EP8.key, 64, "M16")


def test_provenance_records_the_routing_convention_and_the_search(tmp_path: Path) -> None:
    search = {1: SearchRecord(48, 48, 24, 0, "M16-N64-K128-G1-w4-s4", 65.4)}
    ep = dataclasses.replace(_prov(), expert_parallel=True, search=search)
    path = write_table(tmp_path, naming.table_file_name(EP8, "NVIDIA H200"),
                       {1: TileConfig(16, 64, 128, 1, 4, 4)}, ep)
    prov = json.loads(path.with_name(path.name + ".provenance.json").read_text())
    assert prov["routing"] == ROUTING_EP and "benchmark_moe.py" in prov["routing"]
    assert prov["search"]["1"] == {"space": 48, "timed": 48, "resumed_from_cache": 24,
                                   "failed": 0, "vllm_default": "M16-N64-K128-G1-w4-s4",
                                   "vllm_default_us": 65.4}
    dense = write_table(tmp_path / "d", "t.json", {1: TileConfig(16, 64, 128, 1, 4, 4)}, _prov())
    assert json.loads((dense.parent / "t.json.provenance.json").read_text())["routing"] == (
        ROUTING_DENSE)


def test_tile_key_round_trips() -> None:
    cfg = TileConfig(64, 128, 128, 32, 4, 3)
    assert cfg.key == "M64-N128-K128-G32-w4-s3"
    assert TileConfig.from_key(cfg.key) == cfg
    with pytest.raises(ValueError, match="not a tile key"):
        TileConfig.from_key("M64-N128")


def test_refine_takes_the_fastest_and_vllms_default() -> None:
    a, b, c, d = (TileConfig(16, n, 128, 1, 4, 3) for n in (32, 64, 128, 256))
    timed = [(1.0, a), (2.0, b), (3.0, c), (4.0, d)]
    assert refine_candidates(timed, 2, d) == [a, b, d]
    assert refine_candidates(timed, 2, a) == [a, b]
    failed_default = TileConfig(128, 256, 128, 1, 8, 5)  # not timed: nothing to refine
    assert refine_candidates(timed, 2, failed_default) == [a, b]


def test_a_resumed_run_precompiles_only_what_it_will_launch(tmp_path: Path) -> None:
    a, b, c, d = (TileConfig(16, n, 128, 1, 4, 3) for n in (32, 64, 128, 256))
    cache = ResultCache(tmp_path / "c.jsonl")
    for us, cfg in ((5.0, a), (1.0, b), (9.0, c)):
        cache.add(Result(EP8.key, 64, cfg.key, "quick", us))
    cache.add(Result(EP8.key, 64, d.key, "failed", None, note="OutOfResources"))
    new = TileConfig(64, 128, 128, 32, 4, 3)
    plan = {64: [a, b, c, d, new]}
    assert launches_needed(cache, EP8.key, plan, 1, {64: c}) == {64: [new, b, c]}
    assert launches_needed(cache, EP8.key, plan, 2, {64: new}) == {64: [new, b, a]}


def test_shipped_h200_tables_match_the_results_and_document_routing() -> None:
    """The series ships docs/results/tune-h200/tables byte for byte; each table loads the way
    vLLM loads it, covers the tuned batch sizes, its sidecar states the routing it was judged
    under (EP8: what an EP rank sees; TP8: vLLM's benchmark convention), and every entry is
    exactly the judge's decision: vLLM's default unless the tuned config won beyond the noise."""
    from m3patch.patching.diffs import parse_patch
    from m3patch.tune.judge import judge
    from m3patch.tune.routing import Routing

    repo = Path(__file__).resolve().parents[2]
    results = repo / "docs/results/tune-h200/tables"
    patch = repo / "patches/vllm-0.33.0/0005-tuned-tables-h200.patch"
    shipped = {Path(fp.path).name for fp in parse_patch(patch.read_bytes(), patch.name).files}
    assert shipped == {p.name for p in results.iterdir()}
    text = patch.read_text(encoding="utf-8")
    for path in results.iterdir():
        body = "".join("+" + line for line in path.read_text(encoding="utf-8").splitlines(True))
        assert body in text, path.name
    routings = {EP8: Routing("ep-rank", 8), TP8: Routing()}
    for shape in (EP8, TP8):
        table = results / naming.table_file_name(shape, "NVIDIA H200")
        assert sorted(read_table(table)) == list(DEFAULT_BATCH_SIZES)
        prov = json.loads(table.with_name(table.name + ".provenance.json").read_text())
        assert prov["shape"] == shape.key
        assert prov["routing"] == routings[shape].describe(shape)
        judged = prov["judge"]["per_batch"]
        for batch, entry in read_table(table).items():
            record = judged[str(batch)]
            again = judge(batch, record["tuned_config"], record["default_config"],
                          record["tuned_rounds_us"], record["default_rounds_us"])
            assert again.decision == record["decision"], batch
            if record["decision"] == "tuned":
                assert entry.key == record["tuned_config"], batch
            else:
                assert entry == naming.default_config(shape, batch), batch
