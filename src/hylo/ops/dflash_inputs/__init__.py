"""A DFlash step's index arithmetic (`committed_slots`, `draft_blocks`): the torch reference and the Triton
kernels behind one dispatcher. CUDA calls a kernel takes (its refusal is None) go to `kernels`, one launch
each in place of the reference's 8 and 10 small ops; everything else to `reference`. Safe in a CUDA graph:
no host value is read, outputs are allocated by shape only."""

from __future__ import annotations

import torch

from hylo.ops.dflash_inputs import reference
from hylo.ops.dflash_inputs.reference import CommittedTokens, DraftBlocks
from hylo.ops.dispatch import use_kernel

__all__ = [
    "CommittedTokens",
    "DraftBlocks",
    "blocks_refusal",
    "committed_slots",
    "draft_blocks",
    "slots_refusal",
]

_INDEX_TYPES = (torch.int32, torch.int64)


def _vector_refusal(name: str, t: torch.Tensor, device: torch.device) -> str | None:
    if t.dim() != 1 or (t.shape[0] > 1 and t.stride(0) != 1):
        return f"{name} must be a contiguous vector"
    if t.device != device:
        return f"{name} is on {t.device}, token_seq on {device}"
    return None


def slots_refusal(committed: CommittedTokens) -> str | None:
    """Why `kernels.committed_slots` cannot take this call, or None."""
    device = committed.token_seq.device
    if committed.pad_index.dim() != 2 or committed.pad_index.stride(1) != 1:
        return "pad_index must be [S, ·] with a unit last stride"
    if committed.pad_index.device != device:
        return f"pad_index is on {committed.pad_index.device}, token_seq on {device}"
    for name, t in zip(CommittedTokens._fields, committed, strict=True):
        if t.dtype not in _INDEX_TYPES:
            return f"{name} must be int32 or int64, got {t.dtype}"
        if name != "pad_index" and (reason := _vector_refusal(name, t, device)) is not None:
            return reason
    if not committed.token_seq.shape[0] == committed.positions.shape[0] == committed.new_slots.shape[0]:
        return "token_seq, positions and new_slots must have one entry per packed token"
    return None


def blocks_refusal(
    committed: CommittedTokens, state_slots: torch.Tensor, sampling: torch.Tensor, anchors: torch.Tensor
) -> str | None:
    """Why `kernels.draft_blocks` cannot take this call, or None."""
    if (reason := slots_refusal(committed)) is not None:
        return reason
    device = committed.token_seq.device
    for name, t in (("state_slots", state_slots), ("sampling", sampling), ("anchors", anchors)):
        if (reason := _vector_refusal(name, t, device)) is not None:
            return reason
    if state_slots.dtype not in _INDEX_TYPES or sampling.dtype not in _INDEX_TYPES:
        return "state_slots and sampling must be int32 or int64"
    if anchors.dtype != torch.int64:
        return f"anchors must be int64, got {anchors.dtype}"
    return None


def committed_slots(committed: CommittedTokens) -> torch.Tensor:
    """See `reference.committed_slots`."""
    if use_kernel("dflash_inputs.committed_slots", committed.token_seq, lambda: slots_refusal(committed)):
        from hylo.ops.dflash_inputs import kernels

        return kernels.committed_slots(committed)
    return reference.committed_slots(committed)


def draft_blocks(
    committed: CommittedTokens, state_slots: torch.Tensor, sampling: torch.Tensor, anchors: torch.Tensor,
    width: int, mask_token_id: int,
) -> DraftBlocks:  # fmt: skip
    """See `reference.draft_blocks`."""
    verify = lambda: blocks_refusal(committed, state_slots, sampling, anchors)  # noqa: E731
    if use_kernel("dflash_inputs.draft_blocks", sampling, verify):
        from hylo.ops.dflash_inputs import kernels

        return kernels.draft_blocks(committed, state_slots, sampling, anchors, width, mask_token_id)
    return reference.draft_blocks(committed, state_slots, sampling, anchors, width, mask_token_id)
