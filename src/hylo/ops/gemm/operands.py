"""The small-M GEMM's typed operand bundles (`kernels._gemm_kernel`): each tensor with the strides that
address it. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose
ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class SplitTiles(NamedTuple):
    """The product's output: element (K split s, row r, column c) at `data + s·split_stride +
    r·row_stride + c` (`[M, N]` itself, or `[splits, M, N]` fp32 partials that a second launch sums)."""

    data: torch.Tensor
    split_stride: int
    row_stride: int
