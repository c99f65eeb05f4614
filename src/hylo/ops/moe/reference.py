"""Torch reference of the MoE: sigmoid group-limited routing and SwiGLU-clamp experts, routed and shared."""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from hylo.ops.fp8 import dequantize_fp8_blocks


class Routing(NamedTuple):
    """A router's tensors and choice rule, as `route(x, routing)` takes them."""

    weight: torch.Tensor
    correction_bias: torch.Tensor
    top_k: int
    n_group: int
    topk_group: int
    normalize: bool
    scaling: float


class Choices(NamedTuple):
    """What routing chose for each token: expert `ids [T, k]` (global ids) and their fp32 `weights [T, k]`."""

    ids: torch.Tensor
    weights: torch.Tensor


class ExpertWeights(NamedTuple):
    """Every expert's weights, gate_up `[E, 2I, D]` and down `[E, D, I]`: in x's dtype with `scales`
    None, or e4m3 with `scales` = (gate_up_scale_inv, down_scale_inv), fp32 `[E, ceil(N/128), ceil(K/128)]`
    per [128, 128] block."""

    gate_up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None


class SharedExpert(NamedTuple):
    """The shared expert's weights, apart from the routed experts': gate_up `[2I, D]` (gate rows first)
    and down `[D, I]`, in x's dtype with `scales` None, or e4m3 with `scales` = (gate_up_scale_inv,
    down_scale_inv), fp32 `[ceil(N/128), ceil(K/128)]` per [128, 128] block: one routed expert's
    layout (`ExpertWeights` at one expert) without the expert dimension, its I its own (a tensor
    parallel rank's slice). It adds its output to every token, as a routed pair of weight 1 would."""

    gate_up: torch.Tensor
    down: torch.Tensor
    scales: tuple[torch.Tensor, torch.Tensor] | None = None


def route(x: torch.Tensor, routing: Routing) -> Choices:
    """Sigmoid scores; choice by score + correction bias within the best `topk_group` groups (a
    group's strength is the sum of its top two biased scores); weights are the unbiased scores of
    the chosen experts, normalised if asked, times `scaling`."""
    scores = torch.sigmoid(x.float() @ routing.weight.float().t())
    biased = scores + routing.correction_bias.float()
    groups = biased.view(x.shape[0], routing.n_group, -1)
    best_groups = groups.topk(2, dim=-1).values.sum(-1).topk(routing.topk_group, dim=-1).indices
    keep = torch.zeros_like(groups[..., 0], dtype=torch.bool).scatter_(1, best_groups, True)
    biased = groups.masked_fill(~keep[..., None], float("-inf")).flatten(1)
    ids = biased.topk(routing.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if routing.normalize:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return Choices(ids, weights * routing.scaling)


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) · clamp(up, ±limit)."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)


def _dequantized(gate_up: torch.Tensor, down: torch.Tensor, scales, dtype: torch.dtype):
    """(gate_up, down) in `dtype`: FP8 weights (`scales` given) dequantised per block, others as they are."""
    if scales is None:
        return gate_up, down
    return dequantize_fp8_blocks(gate_up, scales[0], dtype), dequantize_fp8_blocks(down, scales[1], dtype)


def shared_expert(x: torch.Tensor, shared: SharedExpert, limit: float) -> torch.Tensor:
    """The shared expert's output for every token of x, in x's dtype: SwiGLU-clamp of the gate and up
    rows, then down (FP8 weights dequantised to x's dtype, activations unquantised)."""
    gate_up, down = _dequantized(shared.gate_up, shared.down, shared.scales, x.dtype)
    gate, up = (x @ gate_up.t()).chunk(2, dim=-1)
    return swiglu_clamp(gate, up, limit) @ down.t()


def experts(
    x: torch.Tensor,
    w: ExpertWeights,
    choices: Choices,
    limit: float,
    first_expert: int | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """Σ_k weights[t,k] · expert_{ids[t,k]}(x_t) for `choices` (ids, weights), plus `shared`'s output
    (`shared_expert`) where given: the routed sum is rounded to x's dtype, then the shared output added
    (the order of the kernels' combine). FP8 weights (`w.scales`) are dequantised to x's dtype;
    activations stay unquantised here.

    `first_expert`: the global id of the weights' first expert (a rank holding experts
    `[first_expert, first_expert + E)` of the routing, split by expert); the pairs routed to any other
    expert add nothing and are never computed. None: the ids index the weights directly."""
    gate_up, down = _dequantized(w.gate_up, w.down, w.scales, x.dtype)
    ids, weights = choices
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
    out = routed.view(*ids.shape, -1).to(x.dtype).sum(1)
    return out if shared is None else out + shared_expert(x, shared, limit)
