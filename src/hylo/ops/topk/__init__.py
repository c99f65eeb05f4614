"""Top-k of short k over rows (`top_k`): the torch reference and the Triton kernel behind one dispatcher.
CUDA calls the kernel takes (`refusal` is None) go to `kernels.top_k`, one launch; everything else to
`reference.top_k`. Both give the same answer: the k largest of each row, largest first, equal values in
ascending index order. Safe in a CUDA graph: no host value is read."""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.topk import reference
from hylo.ops.topk.reference import TopK

__all__ = ["MAX_K", "TopK", "refusal", "top_k"]

MAX_K = 64  # the most kept keys one program holds in registers
MAX_ROW = 2**31 - 1  # indices fit the keys' low 32 bits


def refusal(x: torch.Tensor, k: int) -> str | None:
    """Why `kernels.top_k` cannot take this call, or None."""
    if x.dim() == 0:
        return "x must have a last dimension"
    if x.requires_grad and torch.is_grad_enabled():
        return "x requires grad (training: the kernel's values carry no gradient, the reference's do)"
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"x is {x.dtype} (bf16, fp16 or fp32)"
    if not 0 < k <= min(MAX_K, x.shape[-1]):
        return f"k = {k} is not within [1, min({MAX_K}, {x.shape[-1]})]"
    if x.shape[-1] > MAX_ROW:
        return f"rows of more than {MAX_ROW} entries"
    if x.stride(-1) != 1 or (x.dim() > 1 and x.numel() and not x.reshape(-1, x.shape[-1]).is_contiguous()):
        return "x's rows must be contiguous"
    return None


def top_k(x: torch.Tensor, k: int) -> TopK:
    """(values `[..., k]` in x's dtype, indices `[..., k]` int64): the k largest entries of each row of x,
    largest first, equal values in ascending index order (`reference.top_k`)."""
    if use_kernel("topk.top_k", x, lambda: refusal(x, k)):
        from hylo.ops.topk import kernels

        return kernels.top_k(x, k)
    return reference.top_k(x, k)
