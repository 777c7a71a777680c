"""Patch 0006: the E8M0 packing layout, FNUZ adjustment and gate, from the patched tree.

The module under test is the file the real series adds to a private copy of vLLM 0.33.0; it imports
only torch and triton, so it is imported here straight from that tree without vLLM's runtime.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from core_helpers import REPO

from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import load_series

torch = pytest.importorskip("torch")
pytest.importorskip("triton")

SERIES = REPO / "patches" / "vllm-0.33.0"
MODULE = "vllm/model_executor/layers/fused_moe/experts/m3patch_packed_e8m0.py"


def load_patched_module(root: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("m3patch_packed_e8m0", root / MODULE)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def pk(pristine_033: Path, tmp_path_factory: pytest.TempPathFactory) -> ModuleType:
    root = copy_tree(pristine_033, tmp_path_factory.mktemp("packed") / "site-packages")
    assert "packed-e8m0-scales" in apply_series(tree_at(root), load_series(SERIES)).applied
    return load_patched_module(root)


def random_scales(e: int, n: int, groups: int, seed: int = 0) -> Any:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (e, n, groups), generator=gen, dtype=torch.uint8)


def test_round_trip_random(pk: ModuleType) -> None:
    scale = random_scales(3, 40, 48)
    packed = pk.pack_e8m0_scales(scale)
    assert packed.dtype == torch.int32
    assert packed.shape == (3, 12, 40)
    assert packed.is_contiguous()
    assert torch.equal(pk.unpack_e8m0_scales(packed), scale)


def test_layout_is_word_per_four_groups_contiguous_along_n(pk: ModuleType) -> None:
    scale = random_scales(2, 5, 8, seed=1)
    packed = pk.pack_e8m0_scales(scale)
    for e, w, n in [(0, 0, 0), (1, 1, 4), (0, 1, 3)]:
        want = sum(int(scale[e, n, 4 * w + j]) << (8 * j) for j in range(4))
        assert int(packed[e, w, n]) & 0xFFFFFFFF == want
    assert packed.stride() == (2 * 5, 5, 1)  # n is the fastest dimension


def test_edge_bytes_0_254_255_survive_in_every_position(pk: ModuleType) -> None:
    edges = torch.tensor([0, 254, 255, 1], dtype=torch.uint8)
    rows = torch.stack([edges.roll(i) for i in range(4)])  # each edge byte in each word position
    scale = rows.reshape(1, 4, 4)
    packed = pk.pack_e8m0_scales(scale)
    # 255 in the top byte makes the int32 negative: the unpack must not sign-extend.
    assert int(packed[0, 0, 0]) == 0x01FFFE00
    assert int(packed[0, 0, 1]) < 0
    assert torch.equal(pk.unpack_e8m0_scales(packed), scale)


def test_fnuz_adds_one_and_keeps_layout(pk: ModuleType) -> None:
    scale = torch.tensor([[[0, 127, 200, 253]]], dtype=torch.uint8)
    unpacked = pk.unpack_e8m0_scales(pk.pack_e8m0_scales(scale, fnuz=True))
    assert unpacked.tolist() == [[[1, 128, 201, 254]]]


@pytest.mark.parametrize("bad", [254, 255])
def test_fnuz_rejects_bytes_from_254(pk: ModuleType, bad: int) -> None:
    scale = torch.full((2, 3, 4), 127, dtype=torch.uint8)
    scale[1, 2, 3] = bad
    with pytest.raises(ValueError, match=rf"byte {bad} at \[e, n, g\]=\[1, 2, 3\].*NaN"):
        pk.pack_e8m0_scales(scale, fnuz=True)


@pytest.mark.parametrize("groups", [1, 6, 12 + 2])
def test_groups_not_multiple_of_four_is_a_clear_error(pk: ModuleType, groups: int) -> None:
    with pytest.raises(ValueError, match=rf"K/32={groups} groups, not a multiple of 4"):
        pk.pack_e8m0_scales(torch.zeros(1, 8, groups, dtype=torch.uint8))


def test_m3_shapes_pack(pk: ModuleType) -> None:
    # K = H = 6144 for w13 and K = I_tp in {384, 768, 1536, 3072} for w2 (TP8/TP4/TP2/EP).
    for k in (6144, 384, 768, 1536, 3072):
        packed = pk.pack_e8m0_scales(torch.zeros(1, 2, k // 32, dtype=torch.uint8))
        assert packed.shape == (1, k // 128, 2)


def test_wrong_dtype_or_rank_rejected(pk: ModuleType) -> None:
    with pytest.raises(ValueError, match="expected uint8 E8M0 scales"):
        pk.pack_e8m0_scales(torch.zeros(1, 2, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match="expected uint8 E8M0 scales"):
        pk.pack_e8m0_scales(torch.zeros(2, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match="expected int32"):
        pk.unpack_e8m0_scales(torch.zeros(1, 2, 4, dtype=torch.uint8))


@pytest.mark.parametrize(("env", "mode"), [(None, "auto"), ("", "auto"), ("ON", "on"), ("off", "off")])
def test_gate_values(pk: ModuleType, monkeypatch: pytest.MonkeyPatch, env: str | None,
                     mode: str) -> None:
    if env is None:
        monkeypatch.delenv("M3PATCH_PACKED_E8M0", raising=False)
    else:
        monkeypatch.setenv("M3PATCH_PACKED_E8M0", env)
    assert pk.packed_e8m0_mode() == mode


def test_gate_rejects_unknown_value(pk: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("M3PATCH_PACKED_E8M0", "yes")
    with pytest.raises(ValueError, match=r"'yes' is not one of auto\|on\|off"):
        pk.packed_e8m0_mode()


def test_gate_decisions(pk: ModuleType) -> None:
    assert pk.use_packed_e8m0("auto", enable_eplb=False)[0] is True
    assert pk.use_packed_e8m0("on", enable_eplb=False)[0] is True
    assert pk.use_packed_e8m0("off", enable_eplb=False) == (False, "M3PATCH_PACKED_E8M0=off")
    assert pk.use_packed_e8m0("auto", enable_eplb=True) == (False, "EPLB enabled")
    with pytest.raises(ValueError, match="incompatible with --enable-eplb"):
        pk.use_packed_e8m0("on", enable_eplb=True)
