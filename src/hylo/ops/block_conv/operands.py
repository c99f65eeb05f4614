"""The grouped block conv kernel's typed operand bundles (`kernels.grouped_block_conv`): rows of blocks,
and the per-row conv kernel, each with the strides that address it, so that a launch passes four named
operands instead of fourteen positional ones. Triton unpacks a NamedTuple argument into its fields with
the same specialisation as loose ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class BlockRows(NamedTuple):
    """Rows `data [R, B, H]`, B rows a block: element (r, i, h) at `data + r·block_stride + i·row_stride
    + h`."""

    data: torch.Tensor
    block_stride: int
    row_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> BlockRows:
        """`t [R, B, H]`, whose last stride must be 1, addressed by its own strides."""
        return cls(t, t.stride(0), t.stride(1))


class ConvKernel(NamedTuple):
    """Each row's conv kernel, `base [taps, H]` plus its group deltas `deltas [R, B, taps, G]`: tap t of
    row (r, i) at channel h is `base[t, h] + deltas[r, i, t, h // group_size]`, base's element (t, h) at
    `base + t·base_tap_stride + h`, deltas' (r, i, t, g) at `deltas + r·block_stride + i·row_stride +
    t·tap_stride + g`."""

    base: torch.Tensor
    deltas: torch.Tensor
    base_tap_stride: int
    block_stride: int
    row_stride: int
    tap_stride: int

    @classmethod
    def of(cls, base: torch.Tensor, deltas: torch.Tensor) -> ConvKernel:
        """`base` and `deltas`, whose last strides must be 1, addressed by their own strides."""
        return cls(base, deltas, base.stride(0), *deltas.stride()[:3])
