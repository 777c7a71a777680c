"""vLLM 0.33.0's table file names and built-in default configs, reimplemented. Pure.

Mirrors `get_device_name_as_file_name` (utils/platform_utils.py), `get_config_file_name` and
`get_default_config` (fused_moe/fused_moe.py) so the tuner can name tables and measure the
fallback without importing vLLM. tests/tune/test_tune_cpu.py checks these against the 0.33.0 source.
"""

from __future__ import annotations

import re

from m3patch.tune.shapes import MoEShape
from m3patch.tune.tile import TileConfig


def device_name_as_file_name(device_name: str) -> str:
    return re.sub(r"[\s/]+", "_", device_name)


def normalized_device_name(device_name: str) -> str:
    """What vLLM puts after `device_name=`; every H200 variant shares one table."""
    name = device_name_as_file_name(device_name)
    if "H200" in name.split("_"):
        return "NVIDIA_H200"
    return name


def config_file_name(num_experts: int, width: int, dtype: str | None,
                     block_shape: tuple[int, int] | None, device_name: str) -> str:
    dtype_selector = f",dtype={dtype}" if dtype else ""
    block_selector = ""
    if block_shape and all(block_shape):
        block_selector = f",block_shape=[{block_shape[0]},{block_shape[1]}]"
    device = normalized_device_name(device_name)
    return f"E={num_experts},N={width},device_name={device}{dtype_selector}{block_selector}.json"


def table_file_name(shape: MoEShape, device_name: str) -> str:
    return config_file_name(shape.num_experts, shape.width, shape.vllm_dtype,
                            shape.block_shape, device_name)


def default_config(shape: MoEShape, batch: int, *, rocm: bool = False) -> TileConfig:
    """vLLM 0.33.0 `get_default_config` (VLLM_BATCH_INVARIANT unset) for this kernel's dtypes."""
    if shape.dtype == "fp8_w8a8" and shape.block_shape is not None:
        return _default_block_fp8(shape.block_shape, batch, rocm=rocm)
    return _default_unquantized(shape, batch, rocm=rocm)


def _default_block_fp8(block_shape: tuple[int, int], batch: int, *, rocm: bool) -> TileConfig:
    if rocm:
        block_n, stages = block_shape[0], 2
    elif batch <= 8 and block_shape[0] % 64 == 0:
        block_n, stages = 64, (4 if batch <= 4 else 3)
    else:
        block_n, stages = block_shape[0], 3
    return TileConfig(block_m=16 if batch <= 64 else 64, block_n=block_n,
                      block_k=block_shape[1], group_m=1 if batch <= 16 else 32,
                      num_warps=4, num_stages=stages)


def _default_unquantized(shape: MoEShape, batch: int, *, rocm: bool) -> TileConfig:
    if batch <= 32:
        block_m = 16
    elif batch <= 96:
        block_m = 32
    elif batch <= 512:
        block_m = 64
    else:
        block_m = 128
    block_k = 128 if shape.dtype == "fp8_w8a8" or batch <= 64 else 64
    group_m = 16 if batch // max(shape.num_experts, 1) > 128 else 1
    if rocm:
        stages = 2
    elif batch <= 32:
        stages = 4
    else:
        stages = 3
    return TileConfig(block_m=block_m, block_n=64 if batch <= 64 else 128, block_k=block_k,
                      group_m=group_m, num_warps=4 if batch <= 128 else 8, num_stages=stages)


def launch_block_k(cfg: TileConfig, block_shape: tuple[int, int] | None) -> int:
    """invoke_fused_moe_triton_kernel clamps BLOCK_SIZE_K to the quant block."""
    if block_shape is None:
        return cfg.block_k
    return min(cfg.block_k, min(block_shape))


def swap_ab(cfg: TileConfig, *, fp8: bool, capability: tuple[int, int]) -> bool:
    """fused_moe/utils.py enable_swap_ab: fp8 only, exactly sm90, short and wide tiles."""
    return fp8 and capability == (9, 0) and cfg.block_m < 64 and cfg.block_n >= 64
