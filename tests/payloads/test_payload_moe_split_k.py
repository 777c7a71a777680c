"""Patch 0007 (split-K in vLLM's fused_moe_kernel): the launcher's split decision on CPU, the
kernel's numerics on the GPU.

CPU: the patched `_m3patch_split_k` is cut from the patched fused_moe.py with `ast` and run as
it is (torch on CPU; the logger it calls is replaced by a recorder, since vLLM's logger needs
vLLM's imports), and the kernel signature the launcher passes to is checked.

GPU (`-m gpu`, on the device: `M3PATCH_TUNE_VLLM_SOURCE` = the patched tree, and
`M3PATCH_PRISTINE_SOURCE` = the pristine one): the patched kernel, cut by the tuner's
kernel_source, on fresh random data (NaN-poisoned outputs: an element no program wrote fails)
against the float32 reference for every split the launcher allows at the TP8 decode shape; at
split_k 1 bitwise equal to the pristine kernel; the counters are back to zero after a pass.
On a ROCm GPU (gfx942/gfx950), where the split's handoff is not proven: a split entry runs
unsplit, bit for bit the split-1 output. CPU: the platform gate, the workspace reserved when a
table asking for SPLIT_K is read, and balanced K slices from the patched kernel's own text.
"""

from __future__ import annotations

import ast
import itertools
import os
from pathlib import Path
from typing import Any

import pytest

from m3patch.patching.api import apply_series
from m3patch.patching.locate import tree_at
from m3patch.patching.pristine import copy_tree
from m3patch.patching.series import load_series

REPO = Path(__file__).resolve().parents[2]
SERIES = REPO / "patches" / "vllm-0.33.0"
FUSED_MOE = "vllm/model_executor/layers/fused_moe/fused_moe.py"


@pytest.fixture(scope="module")
def patched_source(pristine_033: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    root = copy_tree(pristine_033, tmp_path_factory.mktemp("splitk") / "site-packages")
    assert "moe-split-k" in apply_series(tree_at(root), load_series(SERIES)).applied
    return (root / FUSED_MOE).read_text(encoding="utf-8")


class _Recorder:
    def __init__(self) -> None:
        self.lines: list[str] = []

    def info_once(self, msg: str, *args: object) -> None:
        self.lines.append(msg % args if args else msg)

    warning_once = info_once


class _Platform:
    """vLLM's `current_platform`, reduced to the one question the launcher asks."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def is_cuda(self) -> bool:
        return self.cuda


def _split_helper(source: str, cuda: bool = True) -> tuple[Any, dict[str, Any]]:
    """`_m3patch_split_k` and its module-level names, executed from the patched text."""
    torch = pytest.importorskip("torch")
    module = ast.parse(source)
    keep: list[ast.stmt] = []
    for node in module.body:
        targets = ([t.id for t in node.targets if isinstance(t, ast.Name)]
                   if isinstance(node, ast.Assign) else
                   [node.target.id] if isinstance(node, ast.AnnAssign)
                   and isinstance(node.target, ast.Name) else [])
        if any(name.startswith(("_M3PATCH_SPLITK", "_m3patch_splitk")) for name in targets):
            keep.append(node)
        if isinstance(node, ast.FunctionDef) and node.name.startswith("_m3patch_split"):
            keep.append(node)
        if isinstance(node, ast.FunctionDef) and node.name == "_m3patch_reserve_split_k":
            keep.append(node)
    namespace: dict[str, Any] = {"torch": torch, "Any": Any, "logger": _Recorder(),
                                 "current_platform": _Platform(cuda)}
    exec(compile(ast.Module(body=keep, type_ignores=[]), FUSED_MOE, "exec"), namespace)
    return namespace["_m3patch_split_k"], namespace


def test_launcher_splits_only_long_k_loops(patched_source: str) -> None:
    split_k, ns = _split_helper(patched_source)
    cpu = pytest.importorskip("torch").device("cpu")
    # GEMM1 of the TP8 shape at M=1: 48 K iterations, 4 pairs x 12 N tiles of 16x64
    split, args = split_k(8, 48, 16 * 64, 48, cpu)
    assert split == 8
    assert set(args) == {"splitk_ws_ptr", "splitk_lock_ptr"}
    assert int(args["splitk_lock_ptr"].abs().sum()) == 0  # counters start at zero
    assert split_k(24, 48, 16 * 64, 48, cpu)[0] == 12  # every slice keeps >= 4 iterations
    assert split_k(6, 48, 16 * 64, 25, cpu)[0] == 6  # 25 // 4: balanced slices of 4 or 5
    assert split_k(8, 4 * 96, 16 * 64, 3, cpu) == (1, {})  # GEMM2: K=384 never splits
    assert split_k(8, ns["_M3PATCH_SPLITK_TILES"] + 1, 16 * 64, 48, cpu) == (1, {})
    too_big = ns["_M3PATCH_SPLITK_WS_FLOATS"] // (8 * 16 * 64) + 1
    assert split_k(8, too_big, 16 * 64, 48, cpu) == (1, {})
    again = split_k(4, 48, 16 * 64, 48, cpu)[1]
    assert again["splitk_ws_ptr"] is args["splitk_ws_ptr"]  # one workspace per device+stream
    assert list(ns["_m3patch_splitk_buffers"]) == [(cpu, None)]
    assert ns["logger"].lines == ["m3patch[split-k]: fused_moe_kernel splits K per table "
                                  "entry (SPLIT_K); workspace 16.25 MiB on cpu stream None"]


def test_no_split_where_the_handoff_is_unproven(patched_source: str) -> None:
    """ROCm (any platform but CUDA): the same entry runs unsplit, no workspace is made, and
    reading a table that asks for SPLIT_K reserves nothing."""
    split_k, ns = _split_helper(patched_source, cuda=False)
    cpu = pytest.importorskip("torch").device("cpu")
    assert split_k(8, 48, 16 * 64, 48, cpu) == (1, {})
    ns["_m3patch_reserve_split_k"]({1: {"SPLIT_K": 8}})
    assert ns["_m3patch_splitk_buffers"] == {} and ns["logger"].lines == []


def test_reading_a_split_table_reserves_the_workspace(
        patched_source: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """get_moe_configs hands every table it reads to the reservation, which allocates only
    for a table with an entry above SPLIT_K 1 (on the current CUDA device and stream)."""
    assert "_m3patch_reserve_split_k(table)" in patched_source[
        patched_source.index("def get_moe_configs("):]
    _, ns = _split_helper(patched_source)
    torch = pytest.importorskip("torch")
    seen: list[Any] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    ns["_m3patch_splitk_workspace"] = seen.append
    ns["_m3patch_reserve_split_k"]({1: {"BLOCK_SIZE_M": 16}, 8: {"SPLIT_K": 1}})
    assert seen == []
    ns["_m3patch_reserve_split_k"]({1: {"SPLIT_K": 8}, 8: {"BLOCK_SIZE_M": 16}})
    assert seen == [torch.device("cuda", 0)]


def _slice_bounds(source: str) -> Any:
    """The kernel's two slice-bound assignments, as the patched text writes them."""
    kernel = next(n for n in ast.parse(source).body
                  if isinstance(n, ast.FunctionDef) and n.name == "fused_moe_kernel")
    def wanted(node: ast.AST) -> bool:
        if not (isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name)):
            return False
        name = node.targets[0].id
        return name == "k_tiles" or (name in ("k_first", "k_last")
                                     and "pid_k" in ast.unparse(node.value))

    bounds = [n for n in ast.walk(kernel) if wanted(n)]
    assert [ast.unparse(b.targets[0]) for b in bounds if isinstance(b, ast.Assign)] == \
        ["k_tiles", "k_first", "k_last"]
    code = compile(ast.Module(body=list(bounds), type_ignores=[]), FUSED_MOE, "exec")

    class _Tl:
        @staticmethod
        def cdiv(a: int, b: int) -> int:
            return -(-a // b)

    def run(k_iters: int, split: int, pid_k: int) -> tuple[int, int]:
        ns = {"tl": _Tl, "K": k_iters * 128, "BLOCK_SIZE_K": 128, "SPLIT_K": split,
              "pid_k": pid_k}
        exec(code, ns)
        return ns["k_first"], ns["k_last"]

    return run


def test_kernel_slices_are_balanced(patched_source: str) -> None:
    """Every split the launcher allows (>= 4 iterations a slice on average) covers the K loop
    exactly once in slices of floor or ceil of the average: none shorter than 4."""
    bounds = _slice_bounds(patched_source)
    for k_iters in range(8, 97):
        for split in range(2, k_iters // 4 + 1):
            slices = [bounds(k_iters, split, p) for p in range(split)]
            assert slices[0][0] == 0 and slices[-1][1] == k_iters
            assert all(a[1] == b[0] for a, b in itertools.pairwise(slices))
            sizes = {last - first for first, last in slices}
            assert sizes <= {k_iters // split, -(-k_iters // split)} and min(sizes) >= 4


def test_kernel_takes_the_buffers_the_launcher_passes(patched_source: str) -> None:
    module = ast.parse(patched_source)
    kernel = next(n for n in module.body
                  if isinstance(n, ast.FunctionDef) and n.name == "fused_moe_kernel")
    names = [a.arg for a in kernel.args.args]
    assert names[-3:] == ["USE_TD", "splitk_ws_ptr", "splitk_lock_ptr"]
    defaults = kernel.args.defaults[-2:]
    assert all(isinstance(d, ast.Constant) and d.value is None for d in defaults)
    body = ast.get_source_segment(patched_source, kernel) or ""
    assert "for k in range(k_first, k_last):" in body
    invoke = patched_source[patched_source.index("def invoke_fused_moe_triton_kernel("):]
    assert "**splitk_args," in invoke and '* META["SPLIT_K"]' in invoke


def test_fallback_marker_is_what_the_patch_logs() -> None:
    series = load_series(SERIES)
    entry = next(p for p in series.patches if p.id == "moe-split-k")
    added = "\n".join(line[1:] for line in series.patch_path(entry).read_text().splitlines()
                      if line.startswith("+") and not line.startswith("+++"))
    assert {m.id: m.kind for m in entry.markers} == {"split-k-fallback": "forbidden"}
    for marker in entry.markers:
        assert marker.text is not None and marker.text in added


# ---- GPU ----

def _gpu_sources() -> tuple[Path, Path]:
    patched = os.environ.get("M3PATCH_TUNE_VLLM_SOURCE")
    pristine = os.environ.get("M3PATCH_PRISTINE_SOURCE")
    if not (patched and pristine):
        pytest.skip("set M3PATCH_TUNE_VLLM_SOURCE (patched) and M3PATCH_PRISTINE_SOURCE")
    return Path(patched), Path(pristine)


@pytest.mark.gpu
@pytest.mark.parametrize("batch", [1, 2, 4, 8])
def test_split_k_matches_the_reference_on_fresh_data(batch: int) -> None:
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from m3patch.tune.kernel_source import load_from_source
    from m3patch.tune.kernel_timer import TOLERANCE, MoEBench
    from m3patch.tune.shapes import MoEShape
    from m3patch.tune.tile import TileConfig

    patched, pristine = _gpu_sources()
    tp8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
    new = MoEBench(load_from_source(patched).kernel, tp8, seed=100 + batch)
    setup = new.setup(batch, rotations=2)
    for split in (2, 3, 4, 5, 6, 7, 8, 12):  # 5 and 7: slices of unequal length
        for n, warps in ((32, 2), (64, 4), (128, 4)):
            cfg = TileConfig(16, n, 128, 1, warps, 3, split)
            err = new.check(setup, cfg)  # raises ConfigFailed on NaN or error > TOLERANCE
            assert err <= TOLERANCE
            for _ in range(3):  # repeated launches: the counters must have been re-zeroed
                assert new.check(setup, cfg) == err
            assert int(setup.splitk[cfg].counters.abs().sum()) == 0
    plain = TileConfig(16, 64, 128, 1, 4, 4)
    new.check(setup, plain)
    out1, out2 = setup.c1[0].clone(), setup.c2[0].clone()
    old = MoEBench(load_from_source(pristine).kernel, tp8, seed=100 + batch)
    old_setup = old.setup(batch, rotations=2)
    old.check(old_setup, plain)
    assert torch.equal(out1.view(torch.int16), old_setup.c1[0].view(torch.int16))
    assert torch.equal(out2.view(torch.int16), old_setup.c2[0].view(torch.int16))


@pytest.mark.gpu
def test_rocm_runs_split_entries_unsplit() -> None:
    """On a gfx942/gfx950 (a ROCm torch build with a GPU): a table entry with SPLIT_K runs the
    patched kernel unsplit, so its output equals the same tile's at split 1 bit for bit and is
    within the tolerance of the float32 reference; the split handoff is not proven there."""
    torch = pytest.importorskip("torch")
    if torch.version.hip is None or not torch.cuda.is_available():
        pytest.skip("needs a ROCm GPU")
    from m3patch.tune.kernel_source import load_from_source
    from m3patch.tune.kernel_timer import TOLERANCE, MoEBench
    from m3patch.tune.launch import effective_split
    from m3patch.tune.shapes import MoEShape
    from m3patch.tune.tile import TileConfig

    patched, _ = _gpu_sources()
    tp8 = MoEShape(128, 384, 6144, 4, "fp8_w8a8", (128, 128), False)
    bench = MoEBench(load_from_source(patched).kernel, tp8, seed=7)
    setup = bench.setup(1, rotations=1)
    assert bench.check(setup, TileConfig(16, 64, 128, 1, 4, 3)) <= TOLERANCE
    plain = setup.c1[0].clone()
    for split in (2, 4, 8):
        cfg = TileConfig(16, 64, 128, 1, 4, 3, split)
        assert effective_split(cfg, 6144, 128) == 1
        assert bench.check(setup, cfg) <= TOLERANCE
        assert torch.equal(setup.c1[0].view(torch.int16), plain.view(torch.int16))
