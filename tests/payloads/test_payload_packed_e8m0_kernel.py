"""Patch 0006: the kernel-side unpack and the markers, on CPU.

The unpack helper is the real @triton.jit function from the patched tree, run under Triton's
interpreter (TRITON_INTERPRET=1, in a subprocess because the flag is read when kernels are
defined). dot_scaled itself cannot run here; scripts/measure/h200/gpu_packed_e8m0.py checks the full GEMM on
the GPU (docs/results/packed-e8m0/).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from core_helpers import REPO

from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import load_series

SERIES = REPO / "patches" / "vllm-0.33.0"
EXPERTS_DIR = "vllm/model_executor/layers/fused_moe/experts"

PROBE = textwrap.dedent("""
    import sys
    import torch
    import triton
    import triton.language as tl
    sys.path.insert(0, sys.argv[1])
    from m3patch_packed_e8m0 import _unpack_scale_tile, pack_e8m0_scales

    @triton.jit
    def probe(words_ptr, out_ptr, N, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_w = tl.arange(0, BLOCK_K // 128)
        words = tl.load(words_ptr + offs_w[None, :] * N + offs_n[:, None])
        tile = _unpack_scale_tile(words, BLOCK_N, BLOCK_K)
        offs_g = tl.arange(0, BLOCK_K // 32)
        tl.store(out_ptr + offs_n[:, None] * (BLOCK_K // 32) + offs_g[None, :], tile)

    for block_k in (128, 256):  # the two BLOCK_K values _select_cfg picks
        groups, n = block_k // 32, 256
        # Every byte value 0..255 at every group position (so every byte of a word).
        grid = torch.arange(n)[:, None] + 37 * torch.arange(groups)[None, :]
        scale = (grid % 256).to(torch.uint8)[None]
        out = torch.empty(n, groups, dtype=torch.uint8)
        probe[(n // 64,)](pack_e8m0_scales(scale), out, n, BLOCK_N=64, BLOCK_K=block_k)
        assert torch.equal(out, scale[0]), (block_k, (out != scale[0]).nonzero()[:5].tolist())
    print("probe ok")
""")


@pytest.fixture(scope="module")
def patched_root(pristine_033: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = copy_tree(pristine_033, tmp_path_factory.mktemp("packed") / "site-packages")
    assert "packed-e8m0-scales" in apply_series(tree_at(root), load_series(SERIES)).applied
    return root


def test_kernel_unpack_matches_packing_for_every_byte(patched_root: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", PROBE, str(patched_root / EXPERTS_DIR)],
                          env=env, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "probe ok" in proc.stdout


def test_series_markers_are_logged_by_the_patch() -> None:
    series = load_series(SERIES)
    entry = next(p for p in series.patches if p.id == "packed-e8m0-scales")
    added = [line[1:] for line in series.patch_path(entry).read_text().splitlines()
             if line.startswith("+") and not line.startswith("+++")]
    kinds = {m.id: m.kind for m in entry.markers}
    assert kinds == {"packed-e8m0": "required", "unpacked-e8m0": "forbidden"}
    assert entry.platforms == ("rocm-gfx950",)
    for marker in entry.markers:
        assert marker.text is not None
        assert any(marker.text in line for line in added), marker.id


def test_native_path_dispatches_on_packed_dtype(patched_root: Path) -> None:
    # The experts class packs at construction and _grouped_gemm_mxfp8 routes int32 scales to the
    # packed kernel; both edits must be in the applied file (a reordered series could drop one).
    text = (patched_root / EXPERTS_DIR / "mxfp8_native_moe.py").read_text()
    assert "if w_scale.dtype == torch.int32:" in text
    assert "return grouped_gemm_mxfp8_packed(" in text
    assert "self._m3patch_pack_weight_scales()" in text
