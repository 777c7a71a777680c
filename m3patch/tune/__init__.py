"""Tuning vLLM's fused-MoE Triton kernel (`m3patch tune`).

Pure modules (shapes, tile, space, naming, cache, writer, recipe_shapes) need no torch;
kernel_source and runner import torch/triton lazily and are the only ones that touch a GPU. The device path
(`python3 -m m3patch tune ...` on a machine with torch+triton but no vLLM) needs nothing else.
"""

from __future__ import annotations
