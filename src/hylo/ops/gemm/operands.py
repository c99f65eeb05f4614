"""The small-M GEMM's typed operand bundles (`kernels._gemm_kernel`): each tensor with the strides that
address it. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose
ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """A `[rows, K]` operand with unit column stride (x, or the weight `[N, K]`): row r at `data +
    r·row_stride`."""

    data: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Rows:
        return cls(t, t.stride(0))


class BlockScales(NamedTuple):
    """An e4m3 weight's fp32 scales `[ceil(N/128), ceil(K/128)]`: block (i, j)'s at `data + i·row_stride +
    j` (unread for a weight without them)."""

    data: torch.Tensor
    row_stride: int


class SplitTiles(NamedTuple):
    """The product's output: element (K split s, row r, column c) at `data + s·split_stride +
    r·row_stride + c` (`[M, N]` itself, or `[splits, M, N]` fp32 partials that a second launch sums)."""

    data: torch.Tensor
    split_stride: int
    row_stride: int
