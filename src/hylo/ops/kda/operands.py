"""The KDA step family's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with
the strides that address it), so that a launch passes a dozen named operands instead of thirty positional
ones. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenRows(NamedTuple):
    """A `[B, T, ...]` operand of the step and block-verify kernels: element (b, t, c) at `data +
    b·seq_stride + t·token_stride + c` (a `LowRank` factor a: its rows, token stride 0)."""

    data: torch.Tensor
    seq_stride: int
    token_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> TokenRows:
        """`t [B, T, ...]` addressed by its own strides."""
        return cls(t, t.stride(0), t.stride(1))


class StateSlots(NamedTuple):
    """The fp32 states `pool [S, H, d, d]` (`slot_stride` elements a slot) and each sequence's slot."""

    pool: torch.Tensor
    slot_stride: int
    slot_ids: torch.Tensor

    @classmethod
    def of(cls, pool: torch.Tensor, slot_ids: torch.Tensor) -> StateSlots:
        return cls(pool, pool.stride(0), slot_ids)


class ScaledWeight(NamedTuple):
    """A low-rank projection W `[H·d, r]` (e4m3 with fp32 `[128, 128]`-block scales `scale`, row stride
    `scale_stride`; or a's dtype, `scale` unread) that `low_rank.low_rank_rows` multiplies."""

    weight: torch.Tensor
    scale: torch.Tensor
    scale_stride: int


class RawQKV(NamedTuple):
    """The raw (pre-conv) q, k and v `[B, T, H·d]` of a step, one layout: element (b, t, c) of each at
    `+ b·seq_stride + t·token_stride + c`."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    seq_stride: int
    token_stride: int


class WindowPool(NamedTuple):
    """The conv windows `pool [S, W-1, 3·H·d]` (`slot_stride`, `row_stride` elements a slot, a row)."""

    pool: torch.Tensor
    slot_stride: int
    row_stride: int

    @classmethod
    def of(cls, pool: torch.Tensor) -> WindowPool:
        """`pool`, whose channels must be contiguous."""
        assert pool.stride(2) == 1
        return cls(pool, pool.stride(0), pool.stride(1))


class DecodeConv(NamedTuple):
    """A decode launch's conv operands: the raw k and v rows (q's strides), the slots' windows and the conv
    weight `[3·H·d, W]` fp32."""

    xk: torch.Tensor
    xv: torch.Tensor
    windows: WindowPool
    weight: torch.Tensor
