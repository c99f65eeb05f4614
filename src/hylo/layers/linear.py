"""A bias-free projection whose matmul goes through the small-M GEMM dispatch (`ops.gemm`)."""

from __future__ import annotations

import torch
from torch import nn

from hylo.ops.gemm import linear


class Linear(nn.Linear):
    """`nn.Linear` without bias (same parameters and state-dict keys), routed through `ops.gemm.linear`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__(in_features, out_features, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight)
