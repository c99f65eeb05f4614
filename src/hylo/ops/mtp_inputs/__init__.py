"""An MTP verify block's inputs (`block_inputs`): the torch reference and the Triton kernel behind one
dispatcher. CUDA calls the kernel takes (`refusal` is None) go to `kernels.block_inputs`, one launch
in place of the reference's ~20; everything else to `reference.block_inputs`. Safe in a CUDA graph:
no host value is read, outputs are allocated by shape only."""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.mtp_inputs import reference
from hylo.ops.mtp_inputs.reference import BlockInputs, VerifiedBlocks

__all__ = ["BlockInputs", "VerifiedBlocks", "block_inputs", "refusal"]

_INDEX_TYPES = (torch.int32, torch.int64)


def refusal(verified: VerifiedBlocks, last_hidden: torch.Tensor, rows: torch.Tensor) -> str | None:
    """Why `kernels.block_inputs` cannot take this call, or None."""
    features, input_ids, positions, pad_index, counts, anchors = verified
    blocks, width = rows.shape[0], verified.width
    if blocks == 0 or width < 1:
        return "an empty batch"
    if pad_index.dim() != 2 or pad_index.shape[0] != blocks:
        return "pad_index must be [B, width]"
    if features.dim() != 2 or features.shape[0] != blocks * width or features.stride(1) != 1:
        return "features must be [B·width, H] with a unit last stride"
    if last_hidden.dim() != 2 or last_hidden.shape[1] != features.shape[1] or last_hidden.stride(1) != 1:
        return "last_hidden must be [rows, H] with a unit last stride"
    if last_hidden.dtype != features.dtype:
        return "last_hidden and features must share a dtype"
    if input_ids.shape != (blocks * width,) or positions.shape != (blocks * width,):
        return "input_ids and positions must be [B·width]"
    if (blocks * width > 1 and (input_ids.stride(0) != 1 or positions.stride(0) != 1)) or (
        blocks > 1 and any(t.stride(0) != 1 for t in (rows, counts, anchors))
    ):
        return "input_ids, positions, rows, counts and anchors must be contiguous"
    if counts.shape != (blocks,) or anchors.shape != (blocks,):
        return "counts and anchors must be one per sequence"
    if any(t.dtype not in _INDEX_TYPES for t in (rows, positions, pad_index, counts)):
        return "rows, positions, pad_index and counts must be int32 or int64"
    if input_ids.dtype != torch.int64 or anchors.dtype != torch.int64:
        return "input_ids and anchors must be int64"
    if any(t.device != features.device for t in (last_hidden, rows, *verified)):
        return "every tensor must be on the features' device"
    return None


def block_inputs(
    verified: VerifiedBlocks, last_hidden: torch.Tensor, rows: torch.Tensor, chain_steps: int, last: int
) -> BlockInputs:
    """`reference.block_inputs` (see it for the contract)."""
    if use_kernel("mtp_inputs.block_inputs", verified.features, lambda: refusal(verified, last_hidden, rows)):
        from hylo.ops.mtp_inputs import kernels

        return kernels.block_inputs(verified, last_hidden, rows, chain_steps, last)
    return reference.block_inputs(verified, last_hidden, rows, chain_steps, last)
