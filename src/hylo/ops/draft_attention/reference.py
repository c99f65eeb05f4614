"""Torch references of the DFlash draft's attention ops: plain gathers through the table.

The math is `DraftAttention.forward` / `DraftAttention.key_value` in `hylo.models.dflash`: the
block of B query rows of request r sits at positions L_r .. L_r + B - 1 after its L_r committed
context tokens, attends every context key and (non-causally) all B block keys, subject to the
sliding-window rule `key_pos > q_pos - window`, with fp32 scores and softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftBlock:
    """The draft block of R requests: queries `q [R, B, Hq, d]` and the block's own keys and values
    `k, v [R, B, Hkv, d]`, at positions L_r .. L_r + B - 1 after each request's context."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class KVCache:
    """Draft keys and values by token slot: one layer's `k, v [num_slots, Hkv, d]` where attention reads
    them, every layer's `[Lyr, num_slots, Hkv, d]` where the store writes them."""

    k: torch.Tensor
    v: torch.Tensor


@dataclass(frozen=True)
class ContextTable:
    """Where each request's committed context lies: request r's positions 0 .. L_r - 1
    (`L_r = ctx_lens[r]`) at token slots `req_to_token[rows[r], :L_r]`."""

    req_to_token: torch.Tensor
    rows: torch.Tensor
    ctx_lens: torch.Tensor


@dataclass(frozen=True)
class ContextTokens:
    """Context tokens to store: every draft layer's raw keys and values `k_raw, v [Lyr, N, Hkv, d]`
    (k_proj / v_proj outputs) of tokens at `positions [N]`, going to token `slots [N]` (a negative slot
    skips its token: the cache rows of rejected tokens are left as they were)."""

    k_raw: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class KeyTransform:
    """What makes a stored key of a raw one: RMSNorm with every layer's `k_norm_weight [Lyr, d]` and
    `eps`, then the rotary embedding from the fp32 tables `cos, sin [max_pos, d // 2]`."""

    k_norm_weight: torch.Tensor
    eps: float
    cos: torch.Tensor
    sin: torch.Tensor


def paged_draft_attention_reference(
    block: DraftBlock, cache: KVCache, table: ContextTable, scale: float, window: int | None = None
) -> torch.Tensor:
    """Block attention of `block.q [R, B, Hq, d]` over each request's context and its own block.

    Request r's context K/V live in one layer's `cache [num_slots, Hkv, d]` at the slots `table` gives;
    its block keys and values at positions L_r + b are the block's. Query head h reads kv head
    `h // (Hq // Hkv)`. Returns `[R, B, Hq, d]` in q's dtype. Reads `ctx_lens` on the host.
    """
    q, k_block, v_block = block.q, block.k, block.v
    k_cache, v_cache = cache.k, cache.v
    req_to_token, rows, ctx_lens = table.req_to_token, table.rows, table.ctx_lens
    num_requests, block_size, num_heads, _ = q.shape
    group = num_heads // k_cache.shape[1]
    longest = int(ctx_lens.max()) if num_requests else 0  # the one host read
    ctx_pos = torch.arange(longest, device=q.device).expand(num_requests, -1)
    ctx_valid = ctx_pos < ctx_lens[:, None]
    slots = torch.where(ctx_valid, req_to_token[rows[:, None], ctx_pos].long(), 0)
    keys = torch.cat([k_cache[slots], k_block], 1).repeat_interleave(group, 2)  # [R, L + B, Hq, d]
    values = torch.cat([v_cache[slots], v_block], 1).repeat_interleave(group, 2)
    q_pos = ctx_lens[:, None] + torch.arange(block_size, device=q.device)  # [R, B]
    key_pos = torch.cat([ctx_pos, q_pos], 1)  # [R, L + B]
    allowed = torch.cat([ctx_valid, torch.ones_like(q_pos, dtype=torch.bool)], 1)[:, None, :]
    if window is not None:
        allowed = allowed & (key_pos[:, None, :] > q_pos[:, :, None] - window)
    scores = torch.einsum("rbhd,rkhd->rhbk", q.float(), keys.float()) * scale
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    return torch.einsum("rhbk,rkhd->rbhd", scores.softmax(-1), values.float()).to(q.dtype)


def inverse_frequencies(
    head_dim: int, theta: float, device: torch.device | str | None = None
) -> torch.Tensor:
    """fp32 rotary frequencies `theta^(-2i/d)` of the rotate-half layout, `[head_dim // 2]`."""
    return 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)


def rotary_tables(
    max_pos: int, head_dim: int, theta: float, device: torch.device | str | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 `cos, sin [max_pos, head_dim // 2]` of the rotate-half rotary embedding, computed as
    `hylo.models.dflash.rope` computes them, so that a table lookup equals its angles bit for bit."""
    angles = torch.arange(max_pos, device=device).float()[:, None] * inverse_frequencies(
        head_dim, theta, device
    )
    return angles.cos(), angles.sin()


def normed_rotated_reference(
    k_raw: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:
    """`rope(RMSNorm(k_raw))` of `k_raw [N, H, d]` (a draft layer's keys or queries) at `positions [N]`,
    as `DraftAttention.key_value` and `project`: normalise in fp32, round to k_raw's dtype, scale by the
    weight, rotate in fp32 with the `cos`/`sin [max_pos, d/2]` table, round again."""
    xf = k_raw.float()
    normed = k_norm_weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(k_raw.dtype)
    cos_full = torch.cat([cos[positions], cos[positions]], -1)[:, None, :]
    sin_full = torch.cat([sin[positions], sin[positions]], -1)[:, None, :]
    half = normed.shape[-1] // 2
    rotated = torch.cat([-normed[..., half:], normed[..., :half]], -1)
    return (normed.float() * cos_full + rotated.float() * sin_full).to(normed.dtype)


def store_context_kv_reference(tokens: ContextTokens, keys: KeyTransform, cache: KVCache) -> None:
    """Write every draft layer's context keys (transformed by `keys`) and values of `tokens` into its
    `cache [Lyr, num_slots, Hkv, d]`, in place. Every position is below `keys.cos.shape[0]`; the kept
    slots are distinct."""
    kept = tokens.slots >= 0
    positions, slots = tokens.positions[kept], tokens.slots[kept]
    for layer in range(tokens.k_raw.shape[0]):
        rotated = normed_rotated_reference(
            tokens.k_raw[layer, kept], keys.k_norm_weight[layer], keys.eps, keys.cos, keys.sin, positions
        )
        cache.k[layer, slots] = rotated.to(cache.k.dtype)
        cache.v[layer, slots] = tokens.v[layer, kept].to(cache.v.dtype)
