"""The DSA indexer's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with the
strides that address it), so that a launch passes a handful of named operands instead of twenty positional
ones. Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose ones."""

from __future__ import annotations

from typing import NamedTuple

import torch


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
        """`index` and `valid` (bool is read as uint8), addressed by index's strides, which `valid` must
        share (the kernel steps both by them)."""
        if valid.shape != index.shape:
            raise ValueError(f"valid {tuple(valid.shape)} must have index's shape {tuple(index.shape)}")
        batch, steps = index.shape
        for name, t in (("index", index), ("valid", valid)):
            if steps > 1 and t.stride(1) != 1:
                raise ValueError(f"{name} needs a unit stride along the steps, got {t.stride(1)}")
        if batch > 1 and valid.stride(0) != index.stride(0):
            raise ValueError(f"valid's row stride {valid.stride(0)} must be index's {index.stride(0)}")
        valid = valid.view(torch.uint8) if valid.dtype == torch.bool else valid
        return cls(index, valid, index.stride(0), steps)


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
