"""The real vLLM 0.33.0 series: applies, compiles, reverts, is locked; patch text checks."""

from __future__ import annotations

import ast
import py_compile
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from series_lock_check import assert_lock_is_current

from m3patch.patching.api import apply_series, revert_series, verify_tree
from m3patch.patching.diffs import parse_patch
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree, verify_against_record
from m3patch.patching.series import load_series

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.33.0"
NEW_MODULE = "vllm/model_executor/layers/quantization/utils/m3patch_mxfp8_block.py"
MINE = ("block-fp8-moe", "minimax-m3-mtp-fse", "tuned-moe-tables")


def touched_files() -> list[str]:
    series = load_series(SERIES)
    return sorted({fp.path for entry in series.patches
                   for fp in parse_patch(series.patch_path(entry).read_bytes(), entry.file).files})


def test_series_applies_compiles_and_reverts(vllm_tree: Path, tmp_path: Path) -> None:
    tree, series = tree_at(vllm_tree), load_series(SERIES)
    report = apply_series(tree, series)
    assert set(MINE) <= set(report.applied)
    assert verify_tree(tree, series).ok
    for rel in touched_files():
        py_compile.compile(str(vllm_tree / rel), cfile=str(tmp_path / "x.pyc"), doraise=True)
    assert apply_series(tree, series).applied == ()  # idempotent
    revert_series(tree, series)
    assert verify_against_record(vllm_tree) == []
    assert not (vllm_tree / NEW_MODULE).exists()


def test_lock_is_current(tmp_path: Path) -> None:
    assert_lock_is_current("vllm-0.33.0", tmp_path)


def test_conversion_module_imports_only_torch_and_triton(vllm_tree: Path) -> None:
    apply_series(tree_at(vllm_tree), load_series(SERIES))
    tree = ast.parse((vllm_tree / NEW_MODULE).read_text())
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            roots.add((node.module or "").split(".")[0])
    assert roots == {"__future__", "math", "torch", "triton"}


def test_manifest_declares_the_block_fp8_markers() -> None:
    series = load_series(SERIES)
    gfx942 = {m.id: m for m in series.markers_for("rocm-gfx942")}
    assert gfx942["block-fp8-layer"].kind == "required"
    assert gfx942["block-fp8-selfcheck"].kind == "required"
    forbidden = {m.text for m in gfx942.values() if m.kind == "forbidden"}
    assert {"Using 'EMULATION' MxFp8 MoE backend", "Mxfp8EmulationTritonExperts",
            "MXFP8->BF16 load-time dequant complete"} <= forbidden
    # the self-check line must not be counted as a per-layer line (58 = 57 + MTP)
    layer_text = gfx942["block-fp8-layer"].text
    assert layer_text is not None and layer_text not in "m3patch[mxfp8->block_fp8 self-check]: x"
    cuda = {m.id for m in series.markers_for("cuda")}
    assert "block-fp8-layer" not in cuda  # on CUDA conversion is opt-in, so never required


@pytest.mark.parametrize(("rel", "needles"), [
    ("vllm/model_executor/layers/quantization/modelopt.py",
     ['"m3patch[mxfp8->block_fp8]: %s: MXFP8 1x32 -> block FP8', "self.moe_block_shape",
      "_m3patch_convert_to_block_fp8(layer)\n            return"]),
    ("vllm/model_executor/layers/fused_moe/oracle/mxfp8.py",
     ['"emulation": Fp8MoeBackend.EMULATION']),
    ("vllm/models/minimax_m3/amd/mtp.py", ['f".experts.{sid}.w1."', "n_shared if fse else 0"]),
])
def test_patched_text_has_the_change(vllm_tree: Path, rel: str, needles: list[str]) -> None:
    apply_series(tree_at(vllm_tree), load_series(SERIES))
    text = (vllm_tree / rel).read_text()
    for needle in needles:
        assert needle in text, f"{rel}: missing {needle!r}"


def test_table_lookup_order(vllm_tree: Path) -> None:
    """m3patch folder after VLLM_TUNED_CONFIG_FOLDER and before upstream, tolerated if missing."""
    apply_series(tree_at(vllm_tree), load_series(SERIES))
    src = (vllm_tree / "vllm/model_executor/layers/fused_moe/fused_moe.py").read_text()
    body = src[src.index("def get_moe_configs("):src.index("def _ensure_block_size_k_divisible")]
    user, ours, upstream = (body.index(s) for s in (
        "user_defined_config_file_path)", '"m3patch",', "default_config_file_path)"))
    assert user < ours < upstream
    assert "if os.path.exists(config_file_path):" in body  # a missing file falls through


def test_make_patch_reproduces_the_committed_patches(pristine_033: Path, vllm_tree: Path,
                                                     tmp_path: Path) -> None:
    """0002-0004 against the pristine tree; 0007 (split-K, which edits fused_moe.py after
    0004 did) against the tree with 0001-0006 applied."""
    series = load_series(SERIES)
    upto = next(i for i, e in enumerate(series.patches) if e.id == "moe-split-k")
    base = copy_tree(pristine_033, tmp_path / "base" / "site-packages")
    apply_series(tree_at(base), replace(series, patches=series.patches[:upto]))
    apply_series(tree_at(vllm_tree), series)
    script = REPO / "scripts" / "maintain" / "make_patch.py"
    for patch in sorted([*SERIES.glob("000[234]-*.patch"), *SERIES.glob("0007-*.patch")]):
        files = [fp.path for fp in parse_patch(patch.read_bytes(), patch.name).files]
        out = tmp_path / patch.name
        before, after = ((base, vllm_tree) if patch.name.startswith("0007")
                         else (pristine_033, base))
        subprocess.run([sys.executable, str(script), "--base", str(before), "--edited",
                        str(after), "-o", str(out), *files], check=True)
        assert out.read_bytes() == patch.read_bytes(), patch.name
