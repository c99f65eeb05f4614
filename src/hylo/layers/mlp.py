"""Dense SwiGLU MLP with the clamp GLM-5.3-Flash applies to gate and up."""

from __future__ import annotations

import torch
from torch import nn

from hylo.layers.linear import Linear
from hylo.ops.moe import swiglu_clamp


class MLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float):
        super().__init__()
        self.gate_proj = Linear(hidden_size, intermediate_size)
        self.up_proj = Linear(hidden_size, intermediate_size)
        self.down_proj = Linear(intermediate_size, hidden_size)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(swiglu_clamp(self.gate_proj(x), self.up_proj(x), self.swiglu_limit))
