"""The KDA kernels' typed operand bundles: what its Triton kernels take, grouped by role (a tensor with
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


class SlotPool(NamedTuple):
    """A pool of per-sequence slots `pool [S, ...]` (`slot_stride` elements a slot; the fp32 states `[S, H, d,
    d]` or the conv windows `[S, W-1, 3·H·d]`) and each sequence's slot `slot_ids [B]`."""

    pool: torch.Tensor
    slot_stride: int
    slot_ids: torch.Tensor

    @classmethod
    def of(cls, pool: torch.Tensor, slot_ids: torch.Tensor) -> SlotPool:
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


class PackedQKV(NamedTuple):
    """The pre-conv q, k and v `[N, H·d]` of a prefill's packed tokens, one row stride (the launches'
    X_STRIDE constexpr) and unit channel stride."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


class GateInputs(NamedTuple):
    """A prefill's gate and β inputs: f `[N, H·d]` and b's logits `[N, H]` of the packed tokens (row strides
    the launch's F_STRIDE and B_STRIDE constexprs) and the layer's `dt_bias [H·d]` and `a_log [H]`."""

    f: torch.Tensor
    b: torch.Tensor
    dt_bias: torch.Tensor
    a_log: torch.Tensor


class PackedSeqs(NamedTuple):
    """The prefill's sequences: int32 offsets `cu [count + 1]` of their packed tokens, and their count."""

    cu: torch.Tensor
    count: int


class ChunkRows(NamedTuple):
    """What the prefill's first launch leaves for the in-chunk launch, each chunk padded to BT rows: the
    conv outputs `y [chunks, 3, H, BT, d]` (q, k, v), the scaled inverse L2 norms of q and k `rnorm [chunks,
    2, H, BT]`, the in-chunk cumulative gate `gcum [chunks, H, BT, d]` (fp32, log2 units) and
    `beta [chunks, H, BT]`."""

    y: torch.Tensor
    rnorm: torch.Tensor
    gcum: torch.Tensor
    beta: torch.Tensor


class ChunkTerms(NamedTuple):
    """A prefill's per-chunk terms, which the sequential launch reads: w, q̄, k̄, u `[chunks, H, BT, d]`, A
    `[chunks, H, BT, BT]` (the activations' dtype; the in-chunk launch's) and e^{G_C} `[chunks, H, d]` (fp32;
    the first launch's)."""

    w: torch.Tensor
    qg: torch.Tensor
    kg: torch.Tensor
    u: torch.Tensor
    att: torch.Tensor
    decay_c: torch.Tensor


class SnapshotTargets(NamedTuple):
    """Where a prefill leaves snapshots (`reference.ChunkSnapshots`): each packed chunk's snapshot id
    `chunk_ids` (-1: none), the states `state [S, H, d, d]` (`state_stride` elements one) and the windows
    `conv [S, W-1, 3·H·d]` (`conv_stride` elements one; row stride the launch's WIN_STRIDE constexpr)."""

    chunk_ids: torch.Tensor
    state: torch.Tensor
    state_stride: int
    conv: torch.Tensor
    conv_stride: int
