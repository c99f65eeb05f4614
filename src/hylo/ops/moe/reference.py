"""Torch reference of the MoE: sigmoid group-limited routing and SwiGLU-clamp experts."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hylo.ops.fp8 import dequantize_fp8_blocks


class Routing(NamedTuple):
    """A router's tensors and choice rule, in `route`'s argument order (`route(x, *routing)`)."""

    weight: torch.Tensor
    correction_bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    normalize: bool
    scaling: float


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
    """Sigmoid scores; choice by score + correction bias within the best `topk_group` groups (a
    group's strength is the sum of its top two biased scores); weights are the unbiased scores of
    the chosen experts, normalised if asked, times `scaling`. Returns (ids `[T, k]`, weights fp32)."""
    scores = torch.sigmoid(x.float() @ weight.float().t())
    biased = scores + correction_bias.float()
    groups = biased.view(x.shape[0], n_group, -1)
    best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(topk_group, dim=-1).indices
    keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ids = biased.topk(top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return ids, weights * scaling


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) · clamp(up, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def experts(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    limit: float,
    first_expert: int | None = None,
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x_t); gate_up `[E, 2I, D]`, down `[E, D, I]`.

    `first_expert`: the global id of the weights' first expert (a rank holding experts
    `[first_expert, first_expert + E)` of the routing, split by expert); the pairs routed to any other
    expert add nothing and are never computed. None: the ids index the weights directly."""
    local = ids - (first_expert or 0)
    mine = ((local >= 0) & (local < gate_up.shape[0])).flatten()
    flat_ids = local.flatten()
    # the pairs of this rank's experts, sorted by expert (the others are left out)
    order = mine.nonzero().squeeze(1)
    order = order[flat_ids[order].argsort(stable=True)]
    counts = torch.bincount(flat_ids[order], minlength=gate_up.shape[0]).tolist()
    token_of = order // ids.shape[1]
    weight_of = weights.flatten()[order]
    # each (token, choice) pair gets its own row, so results are placed, not accumulated; the rows of
    # the pairs left out stay zero
    routed = torch.zeros(
        flat_ids.numel(), x.shape[1], dtype=torch.promote_types(x.dtype, weights.dtype), device=x.device
    )
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        tokens = token_of[start : start + count]
        gate, up = (x[tokens] @ gate_up[expert].t()).chunk(2, dim=-1)
        y = (swiglu_clamp(gate, up, limit) @ down[expert].t()) * weight_of[start : start + count, None]
        routed[order[start : start + count]] = y
        start += count
    return routed.view(*ids.shape, -1).to(x.dtype).sum(1)


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
    """`experts` with block-scaled e4m3 weights (`scale_inv [E, ceil(N/128), ceil(K/128)]`), dequantised
    to x's dtype; activations stay unquantised here."""
    return experts(
        x,
        dequantize_fp8_blocks(gate_up, gate_up_scale_inv, x.dtype),
        dequantize_fp8_blocks(down, down_scale_inv, x.dtype),
        ids,
        weights,
        limit,
        first_expert,
    )
