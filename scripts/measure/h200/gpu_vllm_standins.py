"""Torch stand-ins for the compiled vLLM ops that vLLM's own MoE layer calls, for a machine
without vLLM's `_C` / `_moe_C` extensions (a vLLM tree of `.py` files on PYTHONPATH).

Only these five ops are stood in; vLLM's Python, the m3patch series and the Triton kernels
(fused_moe_kernel, the block-FP8 conversion) run as they are. Each stand-in is registered under
the op name vLLM calls (`torch.ops._C.*`, `torch.ops._moe_C.*`) with the schema's mutated
arguments, does no host synchronisation (it runs inside CUDA-graph capture), and is checked by
`check_all` against its definition, written out element by element, on small random inputs:

  _C::per_token_group_fp8_quant   per (row, group): s = max(amax, eps) / fp8_max (a power of two
                                  rounded up under ue8m0), q = clamp(x / s) in fp8, row-major s
  _C::silu_and_mul_with_clamp     gate = min(x[:d], limit), up = clamp(x[d:], -limit, limit),
                                  out = gate * sigmoid(alpha * gate) * (up + beta)
  _moe_C::topk_sigmoid            s = sigmoid(logits); experts = top-k of s + bias; weights = s of
                                  those, / their sum when renormalize, * routed_scaling_factor
  _moe_C::moe_align_block_size    each expert's (token, slot) rows in token order, padded to a
                                  multiple of block_size with the pad id topk_ids.numel(); one
                                  expert id per block; the padded total
  _moe_C::moe_sum                 out[t] = sum over the top-k slots of input[t, k]

`vllm._C_stable_libtorch` (imported unguarded by vllm/platforms/cuda.py to register compiled
ops) becomes an empty module: every op the measured path calls is one of the five above.
"""

from __future__ import annotations

import sys
import types
from typing import Any

import numpy as np
import torch

STANDIN_OPS = ("_C::per_token_group_fp8_quant", "_C::silu_and_mul_with_clamp",
               "_moe_C::topk_sigmoid", "_moe_C::moe_align_block_size", "_moe_C::moe_sum")
STANDIN_MODULES = ("vllm._C_stable_libtorch",)
# compiled extensions that modules on the import chain import at module level for paths the
# MoE layer never takes (attention): every name in them is a function that raises when called,
# so a call on the measured path would fail the run instead of passing silently
RAISING_MODULES = ("vllm.vllm_flash_attn",)
# capability queries vLLM asks its compiled extension at import: without the extension there
# are no CUTLASS kernels, so each answers False and vLLM keeps to its Triton paths
QUERY_OPS = ("_C::cutlass_scaled_mm_supports_block_fp8", "_C::cutlass_scaled_mm_supports_fp8",
             "_C::cutlass_group_gemm_supported", "_C::cutlass_scaled_mm_supports_fp4")


def _no(cuda_device_capability: int) -> bool:
    return False


def _group_quant(x: torch.Tensor, x_q: torch.Tensor, x_s: torch.Tensor, group_size: int,
                 eps: float, fp8_min: float, fp8_max: float, use_ue8m0: bool,
                 column_major_scales: bool, tma_aligned_scales: bool) -> None:
    if column_major_scales or tma_aligned_scales:
        raise NotImplementedError("stand-in per_token_group_fp8_quant: row-major scales only")
    groups = x.float().reshape(-1, group_size)
    amax = groups.abs().amax(dim=1).clamp_min(eps)
    # tensor by tensor: IEEE division (a CUDA tensor divided by a Python scalar is computed
    # as a multiplication by its reciprocal, one ulp off the definition)
    scale = amax / torch.full_like(amax, fp8_max)
    if use_ue8m0:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (groups / scale[:, None]).clamp(fp8_min, fp8_max)
    x_q.copy_(q.reshape(x_q.shape).to(x_q.dtype))
    x_s.copy_(scale.reshape(x_s.shape))


def _silu_clamp(out: torch.Tensor, x: torch.Tensor, limit: float, alpha: float,
                beta: float) -> None:
    d = x.shape[-1] // 2
    gate = x[..., :d].float().clamp(max=limit)
    up = x[..., d:].float().clamp(-limit, limit)
    out.copy_((gate * torch.sigmoid(alpha * gate) * (up + beta)).to(out.dtype))


def _topk_sigmoid(topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                  token_expert_indices: torch.Tensor, gating_output: torch.Tensor,
                  renormalize: bool, e_score_correction_bias: torch.Tensor | None,
                  routed_scaling_factor: float, is_padding: torch.Tensor | None) -> None:
    if is_padding is not None:
        raise NotImplementedError("stand-in topk_sigmoid: no padding mask")
    scores = torch.sigmoid(gating_output.float())
    choose = scores if e_score_correction_bias is None else scores + e_score_correction_bias
    ids = choose.topk(topk_ids.shape[1], dim=1).indices
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / weights.sum(dim=1, keepdim=True)
    topk_weights.copy_(weights * routed_scaling_factor)
    topk_ids.copy_(ids.to(topk_ids.dtype))
    rows, k = topk_ids.shape
    slot = torch.arange(k, device=ids.device, dtype=torch.int32)[None, :] * rows
    token_expert_indices.copy_(slot + torch.arange(rows, device=ids.device,
                                                   dtype=torch.int32)[:, None])


def _align(topk_ids: torch.Tensor, num_experts: int, block_size: int,
           sorted_token_ids: torch.Tensor, experts_ids: torch.Tensor,
           num_tokens_post_pad: torch.Tensor, expert_map: torch.Tensor | None,
           scatter_idx: torch.Tensor | None) -> None:
    if expert_map is not None or scatter_idx is not None:
        raise NotImplementedError("stand-in moe_align_block_size: no expert_map/scatter_idx")
    flat = topk_ids.flatten().long()
    total = flat.numel()
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.long, device=dev).scatter_add_(
        0, flat, torch.ones_like(flat))
    padded = (counts + block_size - 1) // block_size * block_size
    ends = torch.cumsum(padded, 0)
    order = torch.argsort(flat, stable=True)  # by expert, token order within one
    experts = flat[order]
    rank = torch.arange(total, device=dev) - (torch.cumsum(counts, 0) - counts)[experts]
    sorted_token_ids.fill_(total)
    sorted_token_ids.scatter_(0, (ends - padded)[experts] + rank, order.to(torch.int32))
    block_start = torch.arange(experts_ids.numel(), device=dev) * block_size
    owner = torch.searchsorted(ends, block_start, right=True)
    experts_ids.copy_(torch.where(owner < num_experts, owner, -1).to(experts_ids.dtype))
    num_tokens_post_pad.copy_(ends[-1:].to(num_tokens_post_pad.dtype))


def _moe_sum(x: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor | None,
             expert_map: torch.Tensor | None) -> None:
    if expert_map is not None:
        raise NotImplementedError("stand-in moe_sum: no expert_map")
    out.copy_(x.float().sum(dim=1).to(out.dtype))


def _register() -> None:
    lib = torch.library
    lib.custom_op(STANDIN_OPS[0], mutates_args=("x_q", "x_s"))(_group_quant)
    lib.custom_op(STANDIN_OPS[1], mutates_args=("out",))(_silu_clamp)
    lib.custom_op(STANDIN_OPS[2], mutates_args=("topk_weights", "topk_ids",
                                               "token_expert_indices"))(_topk_sigmoid)
    lib.custom_op(STANDIN_OPS[3], mutates_args=("sorted_token_ids", "experts_ids",
                                               "num_tokens_post_pad"))(_align)
    lib.custom_op(STANDIN_OPS[4], mutates_args=("out",))(_moe_sum)
    for name in QUERY_OPS:
        lib.custom_op(name, mutates_args=())(_no)


class _RaisingModule(types.ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        module = self.__name__

        def not_here(*args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError(f"stand-in {module}.{attr}: not on the MoE layer's path")
        return not_here


_installed: list[str] = []


def install() -> list[str]:
    """Register the op stand-ins and the stand-in extension modules (once); returns what was
    stood in."""
    if _installed:
        return list(_installed)
    _register()
    for name in STANDIN_MODULES:
        sys.modules.setdefault(name, types.ModuleType(name))
    for name in RAISING_MODULES:
        module = _RaisingModule(name)
        module.FA2_AVAILABLE = module.FA3_AVAILABLE = False  # type: ignore[attr-defined]
        sys.modules.setdefault(name, module)
    _installed.extend([*STANDIN_OPS, *QUERY_OPS, *STANDIN_MODULES, *RAISING_MODULES])
    return list(_installed)


# ---- definitions, element by element, and the checks against them ----

def _check_group_quant(dev: torch.device, gen: torch.Generator) -> float:
    x = (torch.randn(5, 256, generator=gen) * 3).to(torch.bfloat16).to(dev)
    x[1, 128:] = 0  # an all-zero group: eps
    fp8 = torch.float8_e4m3fn
    fmax = torch.finfo(fp8).max
    worst = 0.0
    for ue8m0 in (False, True):
        q = torch.empty(x.shape, dtype=fp8, device=dev)
        s = torch.empty(5, 2, dtype=torch.float32, device=dev)
        torch.ops._C.per_token_group_fp8_quant(x, q, s, 128, 1e-10, -fmax, fmax, ue8m0,
                                               False, False)
        for r in range(5):
            for g in range(2):  # IEEE fp32 arithmetic (numpy), as the CUDA kernel computes
                group = x[r, g * 128:(g + 1) * 128].cpu().float().numpy()
                scale = np.float32(max(np.abs(group).max(), np.float32(1e-10))) / np.float32(fmax)
                if ue8m0:
                    scale = np.float32(2.0 ** np.ceil(np.log2(np.float64(scale))))
                assert float(s[r, g]) == float(scale), (r, g, float(s[r, g]), float(scale))
                want = torch.from_numpy(np.clip(group / scale, -fmax, fmax)).to(fp8)
                got = q[r, g * 128:(g + 1) * 128].cpu()
                mism = (got.view(torch.uint8) != want.view(torch.uint8)).sum()
                worst = max(worst, float(mism))
    assert worst == 0, f"per_token_group_fp8_quant: {worst} bytes differ"
    return worst


def _check_silu_clamp(dev: torch.device, gen: torch.Generator) -> float:
    import math
    x = (torch.randn(3, 64, generator=gen) * 6).to(torch.bfloat16).to(dev)
    out = torch.empty(3, 32, dtype=torch.bfloat16, device=dev)
    limit, alpha, beta = 7.0, 1.702, 1.0
    torch.ops._C.silu_and_mul_with_clamp(out, x, limit, alpha, beta)
    worst = 0.0
    for r in range(3):
        for j in range(32):
            g = min(float(x[r, j]), limit)
            u = min(max(float(x[r, 32 + j]), -limit), limit)
            want = g / (1 + math.exp(-alpha * g)) * (u + beta)
            err = abs(float(out[r, j]) - want) / max(abs(want), 1e-3)
            worst = max(worst, err)
    assert worst <= 2.0**-8, f"silu_and_mul_with_clamp: rel err {worst}"  # bf16 output
    return worst


def _check_topk_sigmoid(dev: torch.device, gen: torch.Generator) -> float:
    import math
    rows, experts, k = 6, 16, 4
    logits = torch.randn(rows, experts, generator=gen).to(dev)
    bias = (torch.randn(experts, generator=gen) * 0.1).to(dev)
    w = torch.empty(rows, k, dtype=torch.float32, device=dev)
    ids = torch.empty(rows, k, dtype=torch.int32, device=dev)
    tei = torch.empty(rows, k, dtype=torch.int32, device=dev)
    torch.ops._moe_C.topk_sigmoid(w, ids, tei, logits, True, bias, 2.0, None)
    worst = 0.0
    for r in range(rows):
        s = [1 / (1 + math.exp(-float(v))) for v in logits[r].cpu()]
        pick = sorted(range(experts), key=lambda e: -(s[e] + float(bias[e])))[:k]
        total = sum(s[e] for e in pick)
        assert [int(i) for i in ids[r].cpu()] == pick, (r, ids[r], pick)
        for j, e in enumerate(pick):
            worst = max(worst, abs(float(w[r, j]) - 2.0 * s[e] / total))
            assert int(tei[r, j]) == j * rows + r
    assert worst <= 1e-6, f"topk_sigmoid: weight err {worst}"
    return worst


def _check_align(dev: torch.device, gen: torch.Generator) -> float:
    tokens, k, experts, bs = 9, 3, 8, 4
    topk_ids = torch.stack([torch.randperm(experts, generator=gen)[:k]
                            for _ in range(tokens)]).to(torch.int32).to(dev)
    size = topk_ids.numel() + experts * (bs - 1)
    sorted_ids = torch.empty(size, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(-(-size // bs), dtype=torch.int32, device=dev)
    post = torch.empty(1, dtype=torch.int32, device=dev)
    torch.ops._moe_C.moe_align_block_size(topk_ids, experts, bs, sorted_ids, expert_ids, post,
                                          None, None)
    flat = [int(v) for v in topk_ids.flatten().cpu()]
    want_ids: list[int] = []
    want_experts: list[int] = []
    for e in range(experts):
        rows = [i for i, v in enumerate(flat) if v == e]
        pad = -len(rows) % bs
        want_ids += rows + [len(flat)] * pad
        want_experts += [e] * ((len(rows) + pad) // bs)
    assert int(post) == len(want_ids), (int(post), len(want_ids))
    assert [int(v) for v in sorted_ids[:len(want_ids)].cpu()] == want_ids
    assert [int(v) for v in expert_ids[:len(want_experts)].cpu()] == want_experts
    return 0.0


def _check_moe_sum(dev: torch.device, gen: torch.Generator) -> float:
    x = torch.randn(4, 3, 8, generator=gen).to(torch.bfloat16).to(dev)
    out = torch.empty(4, 8, dtype=torch.bfloat16, device=dev)
    torch.ops._moe_C.moe_sum(x, out, None, None)
    worst = 0.0
    for t in range(4):
        for j in range(8):
            want = sum(float(x[t, s, j]) for s in range(3))
            worst = max(worst, abs(float(out[t, j]) - want) / max(abs(want), 1e-3))
    assert worst <= 2.0**-8, f"moe_sum: rel err {worst}"
    return worst


def check_all(device: torch.device) -> dict[str, Any]:
    """Each stand-in against its definition: {op: {ok, worst | error}}."""
    gen = torch.Generator().manual_seed(7)
    checks = {"_C::per_token_group_fp8_quant": _check_group_quant,
              "_C::silu_and_mul_with_clamp": _check_silu_clamp,
              "_moe_C::topk_sigmoid": _check_topk_sigmoid,
              "_moe_C::moe_align_block_size": _check_align,
              "_moe_C::moe_sum": _check_moe_sum}
    results: dict[str, Any] = {}
    for name, check in checks.items():
        try:
            results[name] = {"worst": check(device, gen), "ok": True}
        except AssertionError as exc:
            results[name] = {"ok": False, "error": str(exc)}
    return results


if __name__ == "__main__":
    install()
    verdicts = check_all(torch.device(sys.argv[1] if len(sys.argv) > 1 else "cpu"))
    print(verdicts)
    sys.exit(0 if all(v["ok"] for v in verdicts.values()) else 1)
