"""Random weights in the ranges a trained GLM-5.3-Flash's tensors live in: for the embedded demo model
and for `load_format="dummy"` (benchmarking a real-size model from its config.json alone)."""

from __future__ import annotations

import torch
from torch import nn

from hylo.ops.fp8 import FP8_BLOCK

_SLICE_ELEMENTS = 1 << 28


def randomize(model: nn.Module, gen: torch.Generator) -> None:
    """Fill every parameter and buffer of `model` in place, drawing from `gen` (on its device) in name
    order, so a seed gives the same weights on every run."""
    with torch.no_grad():
        for name, tensor in sorted([*model.named_parameters(), *model.named_buffers()]):
            # large tensors (expert stacks, the embedding) are filled in slices of the first dim:
            # no fp32 copy of a whole [288, 4096, 4096] stack
            big = tensor.numel() > _SLICE_ELEMENTS
            for p in tensor.split(max(1, _SLICE_ELEMENTS // tensor[0].numel())) if big else (tensor,):
                _fill(name, p, gen)


def _fill(name: str, p: torch.Tensor, gen: torch.Generator) -> None:
    """One fp32 temporary of `p`'s size: it is scaled in place, the same arithmetic as out of place, so the
    weights do not depend on it. Every tensor draws its normal noise first (A_log then draws again):
    the stream, hence the weights of every later tensor, stays what it always was."""
    noise = torch.randn(p.shape, generator=gen, device=gen.device)
    if name.endswith(("norm.weight", "layernorm.weight")) or name.endswith("_hc.scale"):
        noise.mul_(0.1).add_(1)
    elif name.endswith("A_log"):
        noise.uniform_(generator=gen).mul_(2).sub_(1)  # what `torch.rand` draws, in place
    elif name.endswith(("dt_bias", "e_score_correction_bias", "_hc.base", "k_norm.bias", "compress_ape")):
        noise.mul_(0.1)
    elif name.endswith("conv_weight"):
        noise.mul_(0.5)
    elif name.endswith("embed_tokens.weight") or p.dtype == torch.float8_e4m3fn:
        pass  # FP8 weights: unit scale here, their block scales shrink them
    elif name.endswith("scale_inv"):  # one scale per [128, 128] block of an FP8 weight
        noise.abs_().mul_(0.1).add_(1).mul_((p.shape[-1] * FP8_BLOCK) ** -0.5)
    else:
        noise.mul_(p.shape[-1] ** -0.5)
    p.copy_(noise)
