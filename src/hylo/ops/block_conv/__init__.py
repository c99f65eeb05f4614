"""DFlash2's grouped dynamic causal conv over block rows (`grouped_block_conv`): the torch reference and
the Triton kernel behind one dispatcher. CUDA calls the kernel takes (`refusal` is None) and that
record no gradient go to `kernels.grouped_block_conv`, one launch in place of the reference's five;
everything else (the CPU, training) to `reference.grouped_block_conv`. Safe in a CUDA graph."""

from __future__ import annotations

import torch

from hylo.ops.block_conv import reference
from hylo.ops.dispatch import use_kernel

__all__ = ["grouped_block_conv", "refusal"]

KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def refusal(x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, group_size: int) -> str | None:
    """Why `kernels.grouped_block_conv` cannot take this call, or None."""
    if x.dim() != 3 or base_kernel.dim() != 2 or deltas.dim() != 4:
        return "x must be [R, B, H], base_kernel [taps, H], deltas [R, B, taps, H / group_size]"
    blocks, rows, hidden = x.shape
    taps = base_kernel.shape[0]
    if group_size < 1 or hidden % group_size or base_kernel.shape[1] != hidden:
        return "group_size must divide H, and base_kernel must be [taps, H]"
    if deltas.shape != (blocks, rows, taps, hidden // group_size):
        return "deltas must be [R, B, taps, H / group_size]"
    if x.dtype not in KERNEL_DTYPES or base_kernel.dtype != x.dtype or deltas.dtype != x.dtype:
        return f"x, base_kernel and deltas must share one of {KERNEL_DTYPES}"
    if any(t.stride(-1) != 1 for t in (x, base_kernel, deltas)):
        return "every tensor needs a unit last stride"
    if any(t.device != x.device for t in (base_kernel, deltas)):
        return "every tensor must be on x's device"
    return None


def grouped_block_conv(
    x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, group_size: int
) -> torch.Tensor:
    """`reference.grouped_block_conv` (see it for the contract)."""
    tensors = (x, base_kernel, deltas)
    recorded = torch.is_grad_enabled() and any(t.requires_grad for t in tensors)
    if not recorded and use_kernel(
        "block_conv.grouped_block_conv", x, lambda: refusal(x, base_kernel, deltas, group_size)
    ):
        from hylo.ops.block_conv import kernels

        return kernels.grouped_block_conv(x, base_kernel, deltas, group_size)
    return reference.grouped_block_conv(x, base_kernel, deltas, group_size)
