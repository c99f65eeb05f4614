"""Torch reference of the DSA k-pool indexer: pool compression and row selection."""

from __future__ import annotations

import torch


def compress_pools(
    keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, pools: torch.Tensor, pooled: torch.Tensor
) -> None:
    """Write the compressed key of each completed pool: per channel, the softmax-over-the-pool of
    `gate + ape[position in pool]` weighting the pool's keys.

    keys, gates: `[S, d]` token caches; ape `[kpool, d]`; pools `[P]` pooled-key slots (pool p covers
    token slots `p*kpool ..`); pooled `[S/kpool, d]` is written in place.
    """
    kpool = ape.shape[0]
    if pools.numel() == 0:
        return
    members = pools[:, None] * kpool + torch.arange(kpool, device=pools.device)
    weights = torch.softmax(gates[members].float() + ape.float(), dim=1).to(keys.dtype)
    pooled[pools] = (weights * keys[members]).sum(1)


def select_rows(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    pool_table: torch.Tensor,
    positions: torch.Tensor,
    kpool: int,
    topk: int,
    tail: bool,
) -> torch.Tensor:
    """Positions each query attends to, `[B, T, topk + (kpool-1 if tail)]`, -1 for empty entries.

    q `[B, T, Hi, d]` (already scaled by d^-1/2); head_weights `[B, T, Hi]`; pooled `[S/kpool, d]`;
    pool_table `[B, P]` pooled-key slots of each sequence's complete pools (-1 beyond);
    positions `[B, T]`. A pool is a candidate for the query at position p when its last token is
    at or before p; the score is Σ_h w_h·ReLU(q_h·k_pool); the top `topk/kpool` candidates (ties
    to the earlier pool) are expanded to their tokens and the query's own incomplete pool (up to
    kpool-1 tokens) is appended.
    """
    keys = pooled[pool_table.clamp(min=0)].float()  # [B, P, d]
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
