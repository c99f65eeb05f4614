"""The draft attention family's typed operand bundles: what its Triton kernels take, grouped by role (a
tensor with the strides that address it), so that a launch passes a handful of named operands instead of
twenty-odd positional ones. Triton unpacks a NamedTuple argument into its fields, in place, with the same
specialisation as loose ones. The kernels step the last dimension of every operand, and the `[R]` and
`[N]` index vectors, by one element (the `support` refusals check the last dimensions), so no bundle
carries a unit stride."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hylo.ops.draft_attention.reference import ContextTable, KeyTransform


class BlockRows(NamedTuple):
    """A draft block's `[R, B, H, d]` operand (q, the block's keys and values, the output): element
    (r, b, h, c) at `data + r·request_stride + b·row_stride + h·head_stride + c`."""

    data: torch.Tensor
    request_stride: int
    row_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> BlockRows:
        """`t [R, B, H, d]` addressed by its own strides."""
        return cls(t, t.stride(0), t.stride(1), t.stride(2))


class SlotHeads(NamedTuple):
    """One layer's cache `[num_slots, Hkv, d]` that attention reads: element (s, h, c) at `data +
    s·slot_stride + h·head_stride + c`."""

    data: torch.Tensor
    slot_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> SlotHeads:
        return cls(t, t.stride(0), t.stride(1))


class ContextSlots(NamedTuple):
    """Where each request's context lies: request r's position p < `ctx_lens[r]` at token slot
    `req_to_token[rows[r]·row_stride + p]` (`rows` and `ctx_lens` `[R]`, one element each a request)."""

    req_to_token: torch.Tensor
    row_stride: int
    rows: torch.Tensor
    ctx_lens: torch.Tensor

    @classmethod
    def of(cls, table: ContextTable) -> ContextSlots:
        return cls(table.req_to_token, table.req_to_token.stride(0), table.rows, table.ctx_lens)


class SplitPartials(NamedTuple):
    """The context splits' fp32 results, which the merge folds in: split s's normalised output of
    (request r, kv head k) row m, element c at `out + r·request_stride + k·head_stride + s·split_stride +
    m·row_stride + c` (`[R, Hkv, num_splits, BLOCK_M, d]`), its base-2 log-sum-exp at `lse +
    r·lse_request_stride + k·lse_head_stride + s·lse_split_stride + m` (`[R, Hkv, num_splits, BLOCK_M]`)."""

    out: torch.Tensor
    request_stride: int
    head_stride: int
    split_stride: int
    row_stride: int
    lse: torch.Tensor
    lse_request_stride: int
    lse_head_stride: int
    lse_split_stride: int
    num_splits: int

    @classmethod
    def of(cls, out: torch.Tensor, lse: torch.Tensor) -> SplitPartials:
        """`out [R, Hkv, S, BLOCK_M, d]` and `lse [R, Hkv, S, BLOCK_M]`, S splits."""
        return cls(out, *out.stride()[:4], lse, *lse.stride()[:3], out.shape[2])


class LayerHeads(NamedTuple):
    """Every draft layer's head vectors `[Lyr, N, Hkv, d]` by token or by cache slot n (the raw keys and
    values to store, the caches they go to): element (l, n, h, c) at `data + l·layer_stride +
    n·row_stride + h·head_stride + c`."""

    data: torch.Tensor
    layer_stride: int
    row_stride: int
    head_stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> LayerHeads:
        return cls(t, t.stride(0), t.stride(1), t.stride(2))


class RotaryTables(NamedTuple):
    """The fp32 rotary tables `[max_pos, d // 2]`: position p's cos and sin rows at `cos + p·cos_stride`
    and `sin + p·sin_stride`."""

    cos: torch.Tensor
    cos_stride: int
    sin: torch.Tensor
    sin_stride: int

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> RotaryTables:
        return cls(cos, cos.stride(0), sin, sin.stride(0))


class LayerKeyNorm(NamedTuple):
    """What makes a stored key of a raw one: layer l's RMSNorm weight `[d]` at `weight + l·layer_stride`,
    `eps`, then the rotary embedding."""

    weight: torch.Tensor
    layer_stride: int
    eps: float
    rotary: RotaryTables

    @classmethod
    def of(cls, keys: KeyTransform) -> LayerKeyNorm:
        """`keys`: weights `[Lyr, d]`, the tables `[max_pos, d // 2]`."""
        weight = keys.k_norm_weight
        return cls(weight, weight.stride(0), keys.eps, RotaryTables.of(keys.cos, keys.sin))


class StoredTokens(NamedTuple):
    """Token n of a store sits at position `positions[n]` and goes to cache slot `slots[n]` (negative:
    not stored), both `[N]`."""

    positions: torch.Tensor
    slots: torch.Tensor
