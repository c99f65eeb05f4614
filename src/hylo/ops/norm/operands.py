"""The two-norm kernels' typed operand bundles (`kernels.rms_norm_pair`, `kernels.rms_norm_cat`): one
norm's rows with their RMSNorm and, for the pair, where its program writes them, so that a launch passes
two or three named operands instead of eleven to fourteen positional ones. Triton unpacks a NamedTuple
argument into its fields with the same specialisation as loose ones. The fields keep the order of the
kernels' former flat arguments (the 32-bit ones paired as before), so the compiled kernels are the same."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hylo.ops.norm.reference import NormRows, RowStore


class NormedRows(NamedTuple):
    """Rows `x [T, width]` to normalise, row t at `x + t·row_stride` (a unit column stride: a column
    view of a fused projection is read in place), with the RMSNorm's `weight [width]` and `eps`."""

    x: torch.Tensor
    weight: torch.Tensor
    row_stride: int
    width: int
    eps: float

    @classmethod
    def of(cls, rows: NormRows) -> NormedRows:
        """`rows.x [T, width]` addressed by its own row stride."""
        return cls(rows.x, rows.weight, rows.x.stride(0), rows.x.shape[1], rows.eps)


class NormedIntoRows(NamedTuple):
    """`NormedRows` (x, weight, row_stride, width, eps) whose normalised row t goes to `y + t·width`
    (`y [T, width]`, contiguous)."""

    x: torch.Tensor
    weight: torch.Tensor
    y: torch.Tensor
    row_stride: int
    width: int
    eps: float

    @classmethod
    def of(cls, rows: NormRows, y: torch.Tensor) -> NormedIntoRows:
        return cls(rows.x, rows.weight, y, rows.x.stride(0), rows.x.shape[1], rows.eps)


class NormedIntoSlots(NamedTuple):
    """`NormedRows` (x, weight, row_stride, width, eps) whose normalised row t goes to a cache by slot:
    to `out + index[t]·out_row_stride` (`out [S, width]`, unit column stride; `index [T]`)."""

    x: torch.Tensor
    weight: torch.Tensor
    out: torch.Tensor
    index: torch.Tensor
    row_stride: int
    out_row_stride: int
    width: int
    eps: float

    @classmethod
    def of(cls, rows: NormRows, store: RowStore) -> NormedIntoSlots:
        x, out = rows.x, store.out
        return cls(x, rows.weight, out, store.index, x.stride(0), out.stride(0), x.shape[1], rows.eps)
