"""RMSNorm with a weight, applied as `transformers` does (normalise in fp32, scale in the input dtype)."""

from __future__ import annotations

import torch
from torch import nn

from hylo.ops.norm import add_rms_norm, rms_norm


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def after_add(self, x: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(`x + delta`, this norm of it): a residual add and the norm reading it, one launch on the GPU."""
        return add_rms_norm(x, delta, self.weight, self.eps)
