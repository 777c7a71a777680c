"""Tuning vLLM's fused-MoE Triton kernel (`m3patch tune`, `m3patch tune --check TABLE`).

Pure modules (shapes, tile, space, naming, cache, writer, recipe_shapes, routing, judge's
decision, table_check) need no torch; kernel_source, inputs, kernel_timer, launch, tuner and
job import torch/triton and are the only ones that touch a GPU (the command imports them only
once its arguments are valid). The device path (`python3 -m m3patch tune ...` on a machine
with torch+triton but no vLLM) needs nothing else.
"""

from __future__ import annotations
