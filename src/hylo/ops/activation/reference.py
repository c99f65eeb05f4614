"""The torch reference of GLM-5.3-Flash's clamped SwiGLU, as `transformers`' `Glm5NextTextMLP` computes
it: the gate clamped above, the up projection on both sides, in the input dtype."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) · clamp(up, ±limit): SiLU rounded to the input dtype, then the product
    rounded again (two torch ops, HF's order). The routed experts' activation
    (`hylo.ops.moe.reference.swiglu_clamp`) is the same function."""
    return F.silu(gate.clamp(max=limit)) * up.clamp(-limit, limit)
