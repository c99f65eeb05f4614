"""A verify block's greedy acceptance (`accepted_prefix`): the torch reference and the Triton kernel
behind one dispatcher. CUDA calls the kernel takes (`refusal` is None) go to
`kernels.accepted_prefix`, one launch in place of the reference's ~11; everything else to
`reference.accepted_prefix`. Safe in a CUDA graph: no host value is read."""

from __future__ import annotations

import torch

from hylo.ops.acceptance import reference
from hylo.ops.dispatch import use_kernel

__all__ = ["MAX_BLOCK", "accepted_prefix", "refusal"]

# the widest block one program holds in registers (a verify block is an anchor and its drafts)
MAX_BLOCK = 64


def refusal(picks: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None) -> str | None:
    """Why `kernels.accepted_prefix` cannot take this call, or None."""
    if picks.dim() != 2 or drafts.dim() != 2 or drafts.shape != (picks.shape[0], picks.shape[1] - 1):
        return "picks must be [V, T] and drafts [V, T-1]"
    if picks.dtype != torch.long or drafts.dtype != torch.long:
        return "picks and drafts must be int64"
    if picks.shape[1] > MAX_BLOCK:
        return f"a block of more than {MAX_BLOCK} tokens"
    if picks.shape[1] > 1 and (picks.stride(1) != 1 or drafts.stride(1) != 1):
        return "picks and drafts must have a unit last stride"
    if num_drafts is not None:
        if num_drafts.shape != (picks.shape[0],) or num_drafts.dtype not in (torch.int32, torch.int64):
            return "num_drafts must be one int32 or int64 count per block"
        if num_drafts.shape[0] > 1 and num_drafts.stride(0) != 1:
            return "num_drafts must be contiguous"
    tensors = (drafts,) if num_drafts is None else (drafts, num_drafts)
    if any(t.device != picks.device for t in tensors):
        return "every tensor must be on the picks' device"
    return None


def accepted_prefix(
    picks: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`reference.accepted_prefix` (see it for the contract): (accepted [V] int64, committed [V] int32,
    anchors [V] int64) of blocks with target picks `picks [V, T]` and `drafts [V, T-1]`, the first
    `num_drafts [V]` of each row real (None: all)."""
    if use_kernel("acceptance.accepted_prefix", picks, lambda: refusal(picks, drafts, num_drafts)):
        from hylo.ops.acceptance import kernels

        return kernels.accepted_prefix(picks, drafts, num_drafts)
    return reference.accepted_prefix(picks, drafts, num_drafts)
