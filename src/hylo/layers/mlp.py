"""Dense SwiGLU MLP with the clamp GLM-5.3-Flash applies to gate and up."""

from __future__ import annotations

import torch
from torch import nn

from hylo.layers.linear import FusedLinear, Linear
from hylo.ops.activation import swiglu_clamp
from hylo.parallel.layout import SINGLE, Parallel


class MLP(nn.Module):
    """Under tensor parallelism gate and up are column parallel, down row parallel: `forward` returns
    this rank's partial sum, which the caller completes (the decoder layer, or the MoE block with its
    routed experts' sum).

    gate and up read the same input: one GEMM (`gate_up_proj`, a `FusedLinear` whose parts keep the
    checkpoint names `gate_proj` and `up_proj`), and the activation reads its two column halves in
    place (`ops.activation.swiglu_clamp`, one launch on the GPU)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        swiglu_limit: float,
        parallel: Parallel = SINGLE,
    ):
        super().__init__()
        inter = parallel.part(intermediate_size, "the MLP's intermediate size")
        self.gate_up_proj = FusedLinear(hidden_size, [("gate_proj", inter), ("up_proj", inter)])
        self.down_proj = Linear(inter, hidden_size)
        self.swiglu_limit = swiglu_limit

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x)
        return self.down_proj(swiglu_clamp(gate, up, self.swiglu_limit))
