"""The MTP block-inputs kernel's typed operand bundle (`kernels.block_inputs`): the row strides of its
2-D operands. With the reference's `VerifiedBlocks` (what it reads) and `BlockInputs` (what it writes) a
launch passes seven named operands instead of eighteen positional ones. Triton unpacks a NamedTuple
argument into its fields with the same specialisation as loose ones. The arguments keep the order of the
kernel's former flat ones (the 32-bit ones paired as before), so the compiled kernel is the same."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hylo.ops.mtp_inputs.reference import VerifiedBlocks


class RowStrides(NamedTuple):
    """Elements a row of `last_hidden [rows, H]`, of `VerifiedBlocks.features [B·W, H]` and of
    `VerifiedBlocks.pad_index [B, W]` (each with a unit last stride)."""

    last_hidden: int
    features: int
    pad_index: int

    @classmethod
    def of(cls, last_hidden: torch.Tensor, verified: VerifiedBlocks) -> RowStrides:
        return cls(last_hidden.stride(0), verified.features.stride(0), verified.pad_index.stride(0))
