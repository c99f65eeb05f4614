"""Typed operand bundles that several kernel families take alike (each family's own are in its
`operands.py`): a tensor with the strides that address it. Triton unpacks a NamedTuple argument into its
fields with the same specialisation as loose ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """A `[N, C]` operand of unit column stride: element (n, c) at `data + n·row_stride + c`."""

    data: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Rows:
        return cls(t, t.stride(0))


class HeadRows(NamedTuple):
    """Tokens' head vectors `[T, H, d]` of unit stride along d: element (t, h, c) at `data + t·token_stride +
    h·head_stride + c`."""

    data: torch.Tensor
    token_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> HeadRows:
        return cls(t, t.stride(0), t.stride(1))
