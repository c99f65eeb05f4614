"""MoE ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to the Triton routing kernel and grouped GEMMs (`routing`, `kernels`), everything
else to the reference. `experts_fp8` takes e4m3 weights with per-[128, 128]-block fp32 `scale_inv`.
`routed_experts` is route then experts in one call, so that steps of a few tokens can take the
three-launch path of `decode`.

Expert parallelism (`first_expert`): the expert ops take global expert ids and the global id of the
first expert their weights hold; a pair routed to an expert outside `[first_expert, first_expert + E)`
adds nothing and is never computed (no GEMM row, in the reference or the kernels). None: the ids
index the weights directly (one rank, or experts split by tensor).
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.moe import reference
from hylo.ops.moe.reference import Routing, swiglu_clamp

__all__ = [
    "Routing",
    "experts",
    "experts_fp8",
    "route",
    "routed_experts",
    "swiglu_clamp",
]


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
    if use_kernel("moe.route", x):
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
    first_expert: int | None = None,
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x_t) with gate_up `[E, 2I, D]`, down `[E, D, I]`, over the
    pairs of the weights' experts (`first_expert`: module docstring)."""
    if use_kernel("moe.experts", x):
        from hylo.ops.moe import kernels

        return kernels.experts(x, gate_up, down, ids, weights, limit, first_expert=first_expert)
    return reference.experts(x, gate_up, down, ids, weights, limit, first_expert)


def experts_fp8(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    gate_up_scale_inv: torch.Tensor,
    down: torch.Tensor,
    down_scale_inv: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    first_expert: int | None = None,
) -> torch.Tensor:
    """`experts` with e4m3 weights and fp32 `scale_inv [E, ceil(N/128), ceil(K/128)]`."""
    args = (x, gate_up, gate_up_scale_inv, down, down_scale_inv, ids, weights, limit)
    if use_kernel("moe.experts_fp8", x):
        from hylo.ops.moe import kernels

        return kernels.experts_fp8(*args, first_expert=first_expert)
    return reference.experts_fp8(*args, first_expert)


def routed_experts(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    first_expert: int | None = None,
) -> torch.Tensor:
    """`experts(x, gate_up, down, *route(x, *routing), limit, first_expert)`, or `experts_fp8` with
    `scales` = (gate_up_scale_inv, down_scale_inv). Every token is routed over all of the router's
    experts; with `first_expert`, only the pairs of the weights' experts are computed. On CUDA, steps
    of at most `decode.MAX_PAIRS` (token, choice) pairs run as three launches (`decode.routed_experts`),
    with or without `first_expert`."""
    if use_kernel("moe.routed_experts", x):
        from hylo.ops.moe import decode

        if decode.fits(x.shape[0], routing.top_k):
            return decode.routed_experts(x, routing, gate_up, down, limit, scales, first_expert=first_expert)
    ids, weights = route(x, *routing)
    if scales is None:
        return experts(x, gate_up, down, ids, weights, limit, first_expert)
    return experts_fp8(x, gate_up, scales[0], down, scales[1], ids, weights, limit, first_expert)
