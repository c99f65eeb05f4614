"""The DSA indexer's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with the
strides that address it), so that a launch passes a handful of named operands instead of twenty positional
ones. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """A `[N, C]` operand of unit column stride: element (n, c) at `data + n·row_stride + c` (the new
    tokens' keys, gate scores and head weights, the token caches, the compression's position bias, the
    request table, the scores and the selected rows)."""

    data: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Rows:
        return cls(t, t.stride(0))


class HeadRows(NamedTuple):
    """The index queries `[T, H, d]`: element (t, h, c) at `data + t·token_stride + h·head_stride + c`."""

    data: torch.Tensor
    token_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> HeadRows:
        return cls(t, t.stride(0), t.stride(1))


class PoolKeys(NamedTuple):
    """The compressed pool keys `[P, d]` (pool p's row at `keys + p·row_stride`, unit column stride) and,
    with e4m3 keys, each pool's power-of-two scale `scale [P]` (else unread: any pointer)."""

    keys: torch.Tensor
    scale: torch.Tensor
    row_stride: int

    @classmethod
    def of(cls, keys: torch.Tensor, scale: torch.Tensor | None) -> PoolKeys:
        """`keys` and their scales, which only e4m3 keys have (`keys` stands in for them otherwise)."""
        return cls(keys, scale if keys.dtype == torch.float8_e4m3fn else keys, keys.stride(0))


class PoolTable(NamedTuple):
    """Each sequence's pool ids `[B, P]`: sequence b's pool p at `ids + b·seq_stride + p`."""

    ids: torch.Tensor
    seq_stride: int

    @classmethod
    def of(cls, ids: torch.Tensor) -> PoolTable:
        return cls(ids, ids.stride(0))


class PaddedSteps(NamedTuple):
    """The packed tokens laid out per sequence: step s of sequence b is packed token `index[b, s]` if
    `valid[b, s]` is nonzero (uint8); both `[B, steps]` of one layout, (b, s) at `+ b·seq_stride + s`."""

    index: torch.Tensor
    valid: torch.Tensor
    seq_stride: int
    steps: int

    @classmethod
    def of(cls, index: torch.Tensor, valid: torch.Tensor) -> PaddedSteps:
        """`index` and `valid` (bool is read as uint8), addressed by index's strides."""
        valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
        return cls(index, valid, index.stride(0), index.shape[1])


class TokenPlaces(NamedTuple):
    """Where each packed token sits, `[T]` each: its position in its sequence, the sequence's batch index
    (its row of the pool table) and its request-table row."""

    positions: torch.Tensor
    seq: torch.Tensor
    table_rows: torch.Tensor


class LayerNorm(NamedTuple):
    """A LayerNorm's affine `weight` and `bias` (contiguous `[d]`) and its `eps`."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float
