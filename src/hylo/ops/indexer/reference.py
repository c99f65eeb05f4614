"""Torch reference of the DSA k-pool indexer: pool compression and row selection."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


def fp8_row_scale(amax: torch.Tensor) -> torch.Tensor:
    """Smallest power of two `s` with `amax / s <= 448` (1 where amax is 0), in fp32. A power of two
    makes dequantisation exact and lets the kernels fold the scale into other factors."""
    bits = (amax.float() / FP8_MAX).view(torch.int32)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).int()
    return torch.where(amax > 0, (exponent << 23).view(torch.float32), 1.0)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (last dim) FP8 e4m3: `(x_q, scale)` with `x ~= x_q.float() * scale[..., None]`."""
    scale = fp8_row_scale(x.float().abs().amax(-1))
    return (x.float() / scale[..., None]).to(FP8), scale


@dataclass(frozen=True)
class KeyNorm:
    """The indexer's key LayerNorm (`k_norm`): `weight`, `bias` `[d]` and `eps`."""

    weight: torch.Tensor
    bias: torch.Tensor
    eps: float


@dataclass(frozen=True)
class TokenKeys:
    """A layer's per-token indexer caches: LayerNorm'd keys and gate scores, `[S, d]` each, by slot."""

    keys: torch.Tensor
    gates: torch.Tensor


@dataclass(frozen=True)
class PooledKeys:
    """A layer's compressed k-pool keys `[pools, d]` (float8_e4m3fn: FP8 scoring, with its per-pool
    `scale`; else in their dtype, `scale` None)."""

    keys: torch.Tensor
    scale: torch.Tensor | None = None


@dataclass(frozen=True)
class SlotLayout:
    """Where a batch's packed tokens sit: `pool_table [B, pools]` (each sequence's pool ids),
    `req_to_token [rows, max_len]` (positions to token-cache slots), per token its `token_seq` (batch
    index), `token_rows` (request-table row) and `positions` `[T]`, and `pad_index` / `pad_valid`
    `[B, max_new]` laying the packed tokens out per sequence (`ForwardBatch` holds them all)."""

    pool_table: torch.Tensor
    req_to_token: torch.Tensor
    token_seq: torch.Tensor
    token_rows: torch.Tensor
    positions: torch.Tensor
    pad_index: torch.Tensor
    pad_valid: torch.Tensor


@dataclass(frozen=True)
class Selection:
    """What a layer selects: the `topk` best of its `kpool`-token pools, and with `tail` the current
    sequence's incomplete last pool's tokens too."""

    kpool: int
    topk: int
    tail: bool


def store_tokens(
    key: torch.Tensor, gate_scores: torch.Tensor, norm: KeyNorm, cache: TokenKeys, slots: torch.Tensor
) -> None:
    """Write each new token's LayerNorm'd key (`key [T, d]`, the `wk` projection) and its gate scores
    (`[T, d]`) into the caches at `slots [T]` (HF's `k_norm`: torch's LayerNorm, statistics in fp32,
    the output in the key's dtype, stored in the cache's). Tokens sharing a slot (the padding of a
    fixed-shape step) leave one of their rows there."""
    cache.keys[slots] = F.layer_norm(key, (key.shape[-1],), norm.weight, norm.bias, norm.eps)
    cache.gates[slots] = gate_scores


def compress_pools(
    keys: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pools: torch.Tensor,
    pooled: torch.Tensor,
    pooled_scale: torch.Tensor | None = None,
) -> None:
    """Write the compressed key of each completed pool: per channel, the softmax-over-the-pool of
    `gate + ape[position in pool]` weighting the pool's keys.

    keys, gates: `[S, d]` token caches; ape `[kpool, d]`; pools `[P]` pooled-key slots (pool p covers
    token slots `p*kpool ..`); pooled `[S/kpool, d]` is written in place. An FP8 e4m3 `pooled` stores
    the key-dtype value quantised per pool, its power-of-two scale in `pooled_scale [S/kpool]`.
    """
    kpool = ape.shape[0]
    if pools.numel() == 0:
        return
    members = pools[:, None] * kpool + torch.arange(kpool, device=pools.device)
    weights = torch.softmax(gates[members].float() + ape.float(), dim=1).to(keys.dtype)
    value = (weights * keys[members]).sum(1)
    if pooled.dtype == FP8:
        if pooled_scale is None:
            raise ValueError("an FP8 pooled-key cache needs its per-pool scale tensor")
        pooled[pools], pooled_scale[pools] = quantize_fp8_rows(value)
    else:
        pooled[pools] = value


def select_rows(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    pool_table: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    topk: int,
    tail: bool,
    pooled_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Positions each query attends to, `[B, T, topk + (kpool-1 if tail)]`, -1 for empty entries.

    q `[B, T, Hi, d]`; head_weights `[B, T, Hi]`; pooled `[S/kpool, d]`;
    pool_table `[B, P]` pooled-key slots of each sequence's complete pools (-1 beyond);
    positions `[B, T]`. A pool is a candidate for the query at position p when its last token is
    at or before p; the score is Σ_h w_h·ReLU(q_h·k_pool); the top `topk/kpool` candidates (ties
    to the earlier pool) are expanded to their tokens and the query's own incomplete pool (up to
    kpool-1 tokens) is appended. With FP8 pooled keys (`pooled_scale` given) the queries are quantised
    per (token, head) too, as the FP8 kernel does.
    """
    keys = pooled[pool_table.clamp(min=0)].float()  # [B, P, d]
    if pooled.dtype == FP8:
        keys = keys * pooled_scale[pool_table.clamp(min=0)][..., None]
        q_fp8, q_scale = quantize_fp8_rows(q)
        q = q_fp8.float() * q_scale[..., None]
    scores = torch.relu(torch.einsum("bthd,bpd->bthp", q.float(), keys))
    scores = torch.einsum("bth,bthp->btp", head_weights.float(), scores)
    visible_pools = (positions + 1) // kpool  # [B, T]
    pool_ids = torch.arange(pool_table.shape[1], device=q.device)
    scores = scores.masked_fill(pool_ids >= visible_pools[..., None], float("-inf"))
    # Equal scores (all heads ReLU'd to zero is common) go to the earlier pool, so the choice does not
    # depend on how many pools other sequences in the batch have.
    order = scores.sort(dim=-1, descending=True, stable=True).indices
    chosen = order[..., : min(topk // kpool, pool_table.shape[1])]  # [B, T, k]
    offsets = torch.arange(kpool, device=q.device)
    rows = chosen[..., None] * kpool + offsets
    rows = rows.masked_fill((chosen >= visible_pools[..., None])[..., None], -1).flatten(-2)
    parts = [rows]
    if tail and kpool > 1:
        tail_rows = visible_pools[..., None] * kpool + offsets[:-1]
        parts.append(tail_rows.masked_fill(tail_rows > positions[..., None], -1))
    rows = torch.cat(parts, dim=-1)
    width = topk + (kpool - 1 if tail else 0)
    return torch.nn.functional.pad(rows, (0, width - rows.shape[-1]), value=-1)


def select_slots(
    q: torch.Tensor, head_weights: torch.Tensor, pooled: PooledKeys, layout: SlotLayout, selection: Selection
) -> torch.Tensor:
    """`select_rows` on packed tokens (`q [T, Hi, d]`, `head_weights [T, Hi]`), laid out per sequence by
    `layout`, mapped to token-cache slots: `[T, W]` (-1 = empty)."""
    pad_index, pad_valid = layout.pad_index, layout.pad_valid

    def pad(packed: torch.Tensor) -> torch.Tensor:
        mask = pad_valid.view(*pad_valid.shape, *([1] * (packed.dim() - 1)))
        return packed[pad_index] * mask

    padded = select_rows(
        pad(q), pad(head_weights), pooled.keys, layout.pool_table, pad(layout.positions),
        selection.kpool, selection.topk, selection.tail, pooled.scale,
    )  # fmt: skip
    rows = padded[pad_valid]
    slots = layout.req_to_token[layout.token_rows[:, None], rows.clamp(min=0)].long()
    return slots.masked_fill(rows < 0, -1)
