"""Sparse MLA's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with the
strides and sizes that address it), so that a launch passes a handful of named operands instead of eighteen
positional ones. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose
ones. Every row is unit-stride along its last dim (the latent rank R)."""

from __future__ import annotations

from typing import NamedTuple

import torch


class LatentRows(NamedTuple):
    """The latent cache `[S, R]`: slot s's row at `data + s·slot_stride`."""

    data: torch.Tensor
    slot_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> LatentRows:
        return cls(t, t.stride(0))


class RowLists(NamedTuple):
    """Each query token's row list `[T, width]` (latent slots, -1 = empty): entry (t, c) at
    `slots + t·token_stride + c`."""

    slots: torch.Tensor
    token_stride: int
    width: int

    @classmethod
    def of(cls, t: torch.Tensor) -> RowLists:
        return cls(t, t.stride(0), t.shape[1])


class SplitHeadRows(NamedTuple):
    """Per-split outputs `[T, splits, H, R]`: element (t, s, h, r) at `data + t·token_stride +
    s·split_stride + h·head_stride + r` (one split: a `[T, H, R]` output, `split_stride` 0)."""

    data: torch.Tensor
    token_stride: int
    split_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> SplitHeadRows:
        return cls(t, t.stride(0), t.stride(1), t.stride(2))


class SplitLse(NamedTuple):
    """Per-split log-sum-exps (base 2) `[T, splits, H]`: element (t, s, h) at `data + t·token_stride +
    s·split_stride + h`."""

    data: torch.Tensor
    token_stride: int
    split_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> SplitLse:
        return cls(t, t.stride(0), t.stride(1))
