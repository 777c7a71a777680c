"""Numerics of the MXFP8 -> 128x128 block-FP8 conversion (patch block-fp8-moe), on CPU.

The module is loaded by file path from a patched copy of the real 0.33.0 tree, as the GPU
benchmark does; nothing here imports vLLM. Bound under test (derivation in the series README):
|x' - x| <= 2^-4 |x| + 2^-10 S per element, S the block's fp32 scale (FN convention).
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import pytest

torch = pytest.importorskip("torch")
if TYPE_CHECKING:
    from torch import Tensor

from m3patch.patching.api import apply_series  # noqa: E402
from m3patch.patching.locate import tree_at  # noqa: E402
from m3patch.patching.pristine import copy_tree  # noqa: E402
from m3patch.patching.series import load_series  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
NEW_MODULE = "vllm/model_executor/layers/quantization/utils/m3patch_mxfp8_block.py"
FP32_SLACK = 2.0**-22  # fp32 division/scaling rounding on top of the e4m3 half-ulp


@pytest.fixture(scope="module")
def module_path(pristine_033: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = copy_tree(pristine_033, tmp_path_factory.mktemp("numerics") / "site-packages")
    apply_series(tree_at(root), load_series(REPO / "patches" / "vllm-0.33.0"))
    return root / NEW_MODULE


def load(path: Path, name: str = "m3patch_mxfp8_block") -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def blk(module_path: Path) -> ModuleType:
    return load(module_path)


def mxfp8(shape: tuple[int, int, int], lo: int, hi: int, seed: int) -> tuple[Tensor, Tensor]:
    """Gaussian e4m3fn values; one E8M0 byte per 1x32 group drawn from [lo, hi)."""
    gen = torch.Generator().manual_seed(seed)
    e, n, k = shape
    values = (torch.randn(shape, generator=gen) * 64).clamp_(-448, 448).to(torch.float8_e4m3fn)
    scales = torch.randint(lo, hi, (e, n, k // 32), generator=gen, dtype=torch.uint8)
    return values, scales


def assert_within_bound(blk: ModuleType, w: Tensor, s: Tensor, wq: Tensor,
                        sq: Tensor, fnuz: bool) -> float:
    ref, got = blk.dequant_mxfp8(w, s), blk.dequant_block_fp8(wq, sq)
    fn_scale = sq / 2 if fnuz else sq
    floor = 2.0**-10 * fn_scale.repeat_interleave(128, -2).repeat_interleave(128, -1)
    bound = (2.0**-4 + FP32_SLACK) * ref.abs() + floor
    assert torch.isfinite(got).all()
    ratio = float(((got - ref).abs() / bound).max())
    assert ratio <= 1.0, f"error exceeds the derived bound by {ratio:.3f}x"
    return ratio


@pytest.mark.parametrize(("lo", "hi"), [(127, 128), (120, 128), (100, 140)])
@pytest.mark.parametrize("fnuz", [False, True])
def test_conversion_within_derived_bound(blk: ModuleType, lo: int, hi: int, fnuz: bool) -> None:
    w, s = mxfp8((3, 256, 384), lo, hi, seed=lo + hi)
    wq, sq = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=fnuz)
    assert wq.dtype == (torch.float8_e4m3fnuz if fnuz else torch.float8_e4m3fn)
    assert sq.shape == (3, 2, 3) and sq.dtype == torch.float32
    ratio = assert_within_bound(blk, w, s, wq, sq, fnuz)
    assert ratio > 0.5  # the bound is tight: half-ulp errors do occur
    ref = blk.dequant_mxfp8(w[0, :256], s[0, :256])
    assert blk.self_check(ref, wq[0], sq[0], "t") <= blk.SELF_CHECK_BOUND


def zero_group_under_huge_scale() -> tuple[Tensor, Tensor]:
    """A block whose amax is tiny (S clamps to 2^-126) next to an all-zero group with E8M0 254:
    2^127 * (1/S) overflows fp32, and 0 * inf must not become a NaN byte."""
    raw = torch.zeros((1, 128, 128), dtype=torch.uint8)
    raw[0, :, 32:64] = 0x38  # 1.0 times 2^-127
    raw[0, 5, 40] = 0xB0  # -0.5
    scales = torch.zeros((1, 128, 4), dtype=torch.uint8)
    scales[0, :, 0] = 254
    return raw.view(torch.float8_e4m3fn), scales


def test_zero_group_under_huge_scale_stays_zero(blk: ModuleType) -> None:
    w, s = zero_group_under_huge_scale()
    wq, sq = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=False)
    assert float(sq) == blk.MIN_SCALE
    assert int(wq.view(torch.uint8)[0, :, :32].count_nonzero()) == 0
    assert_within_bound(blk, w, s, wq, sq, fnuz=False)


def all_bytes_block(scale_byte: int) -> tuple[Tensor, Tensor]:
    """One 128x128 block holding every e4m3fn byte 64 times (NaN bytes 0x7F/0xFF -> 0x00)."""
    raw = torch.arange(256, dtype=torch.int32).repeat(64).to(torch.uint8).view(1, 128, 128)
    raw = torch.where((raw & 0x7F) == 0x7F, 0, raw)
    return raw.view(torch.float8_e4m3fn), torch.full((1, 128, 4), scale_byte, dtype=torch.uint8)


@pytest.mark.parametrize("scale_byte", [0, 1, 126, 127])
def test_fnuz_matches_fn_exactly_for_all_bytes(blk: ModuleType, scale_byte: int) -> None:
    w, s = all_bytes_block(scale_byte)
    fn_q, fn_s = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=False)
    nz_q, nz_s = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=True)
    assert not bool((nz_q.view(torch.uint8) == 0x80).any())  # 0x80 is NaN in FNUZ
    assert torch.equal(fn_q.view(torch.uint8), nz_q.view(torch.uint8))
    assert torch.equal(nz_s, fn_s * 2)
    fn_val, nz_val = blk.dequant_block_fp8(fn_q, fn_s), blk.dequant_block_fp8(nz_q, nz_s)
    assert torch.isfinite(nz_val).all() and torch.equal(fn_val, nz_val)
    assert_within_bound(blk, w, s, nz_q, nz_s, fnuz=True)


@pytest.mark.parametrize(("scale_byte", "limit"), [(253, 4.0), (254, 1.5)])
def test_huge_scales_convert_small_values_and_reject_overflow(blk: ModuleType, scale_byte: int,
                                                               limit: float) -> None:
    """2^(s-127) * v overflows fp32 for large v: an error, never inf in the weights."""
    w, s = all_bytes_block(scale_byte)
    small = torch.where(w.float().abs() < limit, w.view(torch.uint8), 0).view(torch.float8_e4m3fn)
    for fnuz in (False, True):
        wq, sq = blk.convert_mxfp8_to_block_fp8(small, s, fnuz=fnuz)
        assert_within_bound(blk, small, s, wq, sq, fnuz=fnuz)
        assert not bool((wq.view(torch.uint8) == 0x80).any())
    with pytest.raises(blk.BlockFp8ConversionError, match=r"expert 0, rows 0-127.*>= 250.*: 512"):
        blk.convert_mxfp8_to_block_fp8(w, s, fnuz=True)


def test_scale_255_is_an_error(blk: ModuleType) -> None:
    w, s = all_bytes_block(127)
    s[0, 5, 2] = 255
    with pytest.raises(blk.BlockFp8ConversionError, match=r"E8M0 bytes 255 \(NaN\): 1"):
        blk.convert_mxfp8_to_block_fp8(w, s, fnuz=False)


def test_nan_input_is_an_error_naming_the_block(blk: ModuleType) -> None:
    w, s = mxfp8((2, 256, 256), 120, 128, seed=1)
    raw = w.view(torch.uint8).clone()
    raw[1, 200, 130] = 0xFF
    with pytest.raises(blk.BlockFp8ConversionError,
                       match=r"expert 1, rows 128-255, cols 128-255 .*e4m3fn NaN values: 1"):
        blk.convert_mxfp8_to_block_fp8(raw.view(torch.float8_e4m3fn), s, fnuz=True)


def test_zero_blocks_use_scale_one(blk: ModuleType) -> None:
    w, s = mxfp8((1, 256, 256), 120, 128, seed=2)
    raw = w.view(torch.uint8).clone()
    raw[0, :128, 128:] = 0x80  # -0 everywhere in one block
    raw[0, 128:, :128] = 0
    wq, sq = blk.convert_mxfp8_to_block_fp8(raw.view(torch.float8_e4m3fn), s, fnuz=True)
    assert sq[0, 0, 1] == 2.0 and sq[0, 1, 0] == 2.0  # 1.0 in FN convention, doubled for FNUZ
    assert int(wq.view(torch.uint8)[0, :128, 128:].count_nonzero()) == 0


@pytest.mark.parametrize(("shape", "scale_shape", "match"), [
    ((1, 200, 256), (1, 200, 8), "multiples of 128"),
    ((1, 256, 160), (1, 256, 5), "multiples of 128"),
    ((1, 256, 256), (1, 256, 4), "scale shape"),
])
def test_bad_layouts_raise(blk: ModuleType, shape: tuple[int, ...], scale_shape: tuple[int, ...],
                           match: str) -> None:
    w = torch.zeros(shape, dtype=torch.float8_e4m3fn)
    with pytest.raises(blk.BlockFp8ConversionError, match=match):
        blk.convert_mxfp8_to_block_fp8(w, torch.zeros(scale_shape, dtype=torch.uint8), fnuz=False)


def test_wrong_dtypes_raise(blk: ModuleType) -> None:
    w = torch.zeros((1, 128, 128), dtype=torch.bfloat16)
    with pytest.raises(blk.BlockFp8ConversionError, match=r"want float8_e4m3fn.*want uint8"):
        blk.convert_mxfp8_to_block_fp8(w, torch.zeros((1, 128, 4), dtype=torch.int32), fnuz=False)


def test_inplace_reuses_storage_and_matches(blk: ModuleType) -> None:
    w, s = mxfp8((2, 256, 256), 118, 130, seed=3)
    expect_q, expect_s = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=True)
    work = w.clone()
    got_q, got_s = blk.convert_mxfp8_to_block_fp8(work, s, fnuz=True, inplace=True)
    assert got_q.data_ptr() == work.data_ptr()
    assert torch.equal(got_q.view(torch.uint8), expect_q.view(torch.uint8))
    assert torch.equal(got_s, expect_s)


def test_self_check_rejects_a_bad_conversion(blk: ModuleType) -> None:
    w, s = mxfp8((1, 128, 128), 120, 128, seed=4)
    wq, sq = blk.convert_mxfp8_to_block_fp8(w, s, fnuz=False)
    with pytest.raises(blk.BlockFp8ConversionError, match="self-check relative error"):
        blk.self_check(blk.dequant_mxfp8(w[0], s[0]), wq[0], sq[0] * 1.2, "layer.x")


@pytest.mark.parametrize(("env", "rocm", "mx", "backend", "expect"), [
    (None, True, False, "auto", True), ("auto", True, False, "triton", True),
    ("auto", True, True, "auto", False), ("auto", False, False, "auto", False),
    ("block_fp8", False, False, "auto", True), ("off", True, False, "auto", False),
    ("auto", True, False, "emulation", False), (" Block_FP8 ", True, True, "triton", True),
])
def test_gate(blk: ModuleType, env: str | None, rocm: bool, mx: bool, backend: str,
              expect: bool) -> None:
    assert blk.conversion_requested(env, is_rocm=rocm, supports_mx=mx, moe_backend=backend) is expect


@pytest.mark.parametrize(("env", "backend", "match"), [
    ("yes", "auto", "not one of auto, block_fp8, off"),
    ("block_fp8", "marlin", "needs --moe-backend auto or triton"),
])
def test_gate_refuses(blk: ModuleType, env: str, backend: str, match: str) -> None:
    with pytest.raises(blk.BlockFp8ConversionError, match=match):
        blk.conversion_requested(env, is_rocm=True, supports_mx=False, moe_backend=backend)


INTERPRETER_CHECK = """
import importlib.util, sys, torch
sys.path[:0] = [sys.argv[2], sys.argv[2] + "/tests", sys.argv[2] + "/tests/payloads"]
from test_payload_block_fp8 import all_bytes_block, load, mxfp8, zero_group_under_huge_scale
mod = load(__import__("pathlib").Path(sys.argv[1]))
w, s = mxfp8((2, 256, 256), 100, 140, seed=5)
ab, ab_s = all_bytes_block(126)
zg, zg_s = zero_group_under_huge_scale()
def same(wt, st, fnuz, **kw):
    tq, ts = mod.convert_mxfp8_to_block_fp8(wt, st, fnuz=fnuz, impl="triton", **kw)
    rq, rs = mod.convert_mxfp8_to_block_fp8(wt, st, fnuz=fnuz, impl="torch")
    assert torch.equal(tq.view(torch.uint8), rq.view(torch.uint8)), (fnuz, kw)
    assert torch.equal(ts, rs), (fnuz, kw)
for fnuz in (False, True):
    for rows in (128, 32):  # one pass (block in registers) and tiles re-read from cache
        same(w, s, fnuz, codec="bits", tile_rows=rows)
        same(ab, ab_s, fnuz, codec="bits", tile_rows=rows)
    # fn (hardware converts): the interpreter's fp32->fp8 rounding is not IEEE, so only data
    # that needs no rounding (S = 2^-1, every e4m3 value exact) is compared here; the H200
    # run compares random data (docs/results/block-fp8-convert)
    same(ab, ab_s, fnuz, codec="fn")
    for codec in ("bits", "fn"):  # every value exact here too
        same(zg, zg_s, fnuz, codec=codec)
        same(zg, zg_s, fnuz, codec=codec, tile_rows=64)
bad = ab.view(torch.uint8).clone()
bad[0, 3, 3] = 0x7F
before = bad.clone()
try:
    mod.convert_mxfp8_to_block_fp8(bad.view(torch.float8_e4m3fn), ab_s, fnuz=True, impl="triton",
                                   codec="bits", inplace=True)
except mod.BlockFp8ConversionError as exc:
    assert "e4m3fn NaN values: 1" in str(exc), exc
else:
    raise AssertionError("NaN input was converted")
assert torch.equal(bad, before)  # the failing block was left unwritten
print("kernel == torch path")
"""


def test_triton_kernel_matches_torch_path_bitwise(module_path: Path) -> None:
    """The Triton kernel under TRITON_INTERPRET=1 (a subprocess: the interpreter mode is fixed
    when triton is first imported): every byte and scale equals the torch path."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", INTERPRETER_CHECK, str(module_path), str(REPO)],
                          capture_output=True, text=True, env=env, check=False, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "kernel == torch path" in proc.stdout


def fp32_near_every_e4m3_value_and_tie() -> Tensor:
    """Every finite e4m3fn value and rounding tie in [-448, 448], each nudged by -2..2 fp32 ulps,
    plus 2^20 random fp32 values in that range."""
    grid = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    grid = grid[torch.isfinite(grid)].unique()
    base = torch.cat([grid, (grid[1:] + grid[:-1]) / 2]).view(torch.int32)
    nudged = (base[:, None] + torch.arange(-2, 3, dtype=torch.int32)).flatten().view(torch.float32)
    rand = torch.empty(2**20).uniform_(-448, 448, generator=torch.Generator().manual_seed(7))
    y = torch.cat([nudged, rand, rand * 2.0**-12])
    finite: Tensor = y[torch.isfinite(y) & (y.abs() <= 448)]
    return finite


def test_fnuz_of_half_equals_fn_bytes_with_canonical_zero() -> None:
    """The gfx94x codec quantizes y/2 straight to E4M3FNUZ; the other paths write the E4M3FN
    bytes of y (FNUZ reads them as y/2). Same bytes, 0x80 (-0 in FN, NaN in FNUZ) aside, which
    the FN paths write as 0x00. (Also checked once over all 2.28e9 fp32 values in [-448, 448].)"""
    y = fp32_near_every_e4m3_value_and_tie()
    assert y.numel() > 2**20
    fn = y.to(torch.float8_e4m3fn).view(torch.uint8)
    fnuz = (y / 2).to(torch.float8_e4m3fnuz).view(torch.uint8)
    assert bool((fn == 0x80).any())  # the one difference is exercised
    assert torch.equal(torch.where(fn == 0x80, 0, fn), fnuz)


def test_native_codec_on_cpu_is_the_portable_one(blk: ModuleType) -> None:
    assert blk.native_codec(torch.device("cpu")) == "bits"
    assert set(blk.CODECS) == {"bits", "fn", "fnuz"}


def test_failing_block_is_left_unwritten_in_place(blk: ModuleType) -> None:
    w, s = mxfp8((1, 256, 256), 120, 128, seed=6)
    work = w.view(torch.uint8).clone()
    work[0, 7, 200] = 0x7F  # NaN in block (0, 1)
    before = work.clone()
    with pytest.raises(blk.BlockFp8ConversionError, match=r"rows 0-127, cols 128-255 .*NaN values: 1"):
        blk.convert_mxfp8_to_block_fp8(work.view(torch.float8_e4m3fn), s, fnuz=False, inplace=True)
    assert torch.equal(work[0, :128, 128:], before[0, :128, 128:])
    assert not torch.equal(work[0, :128, :128], before[0, :128, :128])  # the others converted
