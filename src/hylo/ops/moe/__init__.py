"""MoE ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to the Triton routing kernel and grouped GEMMs (`routing`, `kernels`), everything
else to the reference. `experts_fp8` takes e4m3 weights with per-[128, 128]-block fp32 `scale_inv`.
"""

from __future__ import annotations

import torch

from hylo.ops.moe import reference
from hylo.ops.moe.reference import dequantize_fp8_blocks, quantize_fp8_blocks, swiglu_clamp

__all__ = ["dequantize_fp8_blocks", "experts", "experts_fp8", "quantize_fp8_blocks", "route", "swiglu_clamp"]


def route(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    normalize: bool,
    scaling: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids `[T, k]`, fp32 weights `[T, k]`) of sigmoid group-limited routing, as `reference.route`."""
    args = (x, weight, correction_bias, top_k, n_group, topk_group, normalize, scaling)
    if x.is_cuda:
        from hylo.ops.moe import routing

        return routing.route(*args)
    return reference.route(*args)


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x_t) with gate_up `[E, 2I, D]`, down `[E, D, I]`."""
    if x.is_cuda:
        from hylo.ops.moe import kernels

        return kernels.experts(x, gate_up, down, ids, weights, limit)
    return reference.experts(x, gate_up, down, ids, weights, limit)


def experts_fp8(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
) -> torch.Tensor:
    """`experts` with e4m3 weights and fp32 `scale_inv [E, ceil(N/128), ceil(K/128)]`."""
    args = (x, gate_up, gate_up_scale_inv, down, down_scale_inv, ids, weights, limit)
    if x.is_cuda:
        from hylo.ops.moe import kernels

        return kernels.experts_fp8(*args)
    return reference.experts_fp8(*args)
