"""Activations: the torch reference and the Triton kernel behind one dispatcher.

CUDA tensors the kernel takes (`refusal` is None) go to `kernels.swiglu_clamp`, one launch in place of
the reference's four; everything else to `reference.swiglu_clamp`, and so does a call that autograd
records (training: the kernel has no backward).
"""

from __future__ import annotations

import torch

from hylo.ops.activation import reference
from hylo.ops.dispatch import use_kernel

__all__ = ["refusal", "swiglu_clamp"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refusal(gate: torch.Tensor, up: torch.Tensor) -> str | None:
    """Why `kernels.swiglu_clamp` cannot take this call, or None."""
    if gate.shape != up.shape or gate.dtype != up.dtype or gate.device != up.device:
        return "gate and up must have one shape, dtype and device"
    if gate.dtype not in KERNEL_DTYPES:
        return f"unsupported dtype {gate.dtype} (supported: {KERNEL_DTYPES})"
    if gate.dim() == 0:
        return "gate and up must have a last dimension"
    rows = []
    for t in (gate, up):
        if t.stride(-1) != 1:
            return "gate and up must have a unit last stride"
        try:
            rows.append(t.view(-1, t.shape[-1]).stride(0))
        except RuntimeError:
            return "gate's and up's leading dimensions must flatten to rows of one stride"
    if gate.numel() and rows[0] != rows[1]:
        return f"gate and up must share their row stride, got {rows[0]} and {rows[1]}"
    return None


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """SiLU(min(gate, limit)) · clamp(up, ±limit); see `reference.swiglu_clamp`."""
    recorded = torch.is_grad_enabled() and (gate.requires_grad or up.requires_grad)
    if not recorded and use_kernel("activation.swiglu_clamp", gate, lambda: refusal(gate, up)):
        from hylo.ops.activation import kernels

        return kernels.swiglu_clamp(gate, up, limit)
    return reference.swiglu_clamp(gate, up, limit)
