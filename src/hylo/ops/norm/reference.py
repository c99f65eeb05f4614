"""The torch reference of RMSNorm, as `transformers`' GLM-5.3-Flash (`glm5_next`) computes it."""

from __future__ import annotations

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight · x / rms(x)` over the last dimension: normalised in fp32, rounded to `x`'s dtype, then
    scaled by `weight` in the promoted dtype (HF's order of operations)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
