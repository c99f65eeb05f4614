"""DFlash draft attention: paged block attention over the committed context and the context K/V store.

The dispatchers send CUDA calls the kernels accept (`support.*_refusal` is None) to the Triton
kernels (`kernels.py`: CUDA-graph safe) and everything else to the torch references
(`reference.py`: host reads, not graph safe). Triton is imported on first CUDA use only.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.draft_attention.reference import (
    ContextTable,
    ContextTokens,
    DraftBlock,
    KeyTransform,
    KVCache,
    normed_rotated_reference,
    paged_draft_attention_reference,
    rotary_tables,
    store_context_kv_reference,
)
from hylo.ops.draft_attention.support import (
    normed_rotated_refusal,
    paged_draft_attention_refusal,
    store_context_kv_refusal,
)

__all__ = [
    "ContextTable",
    "ContextTokens",
    "DraftBlock",
    "KVCache",
    "KeyTransform",
    "normed_rotated",
    "normed_rotated_reference",
    "normed_rotated_refusal",
    "paged_draft_attention",
    "paged_draft_attention_reference",
    "paged_draft_attention_refusal",
    "rotary_tables",
    "store_context_kv",
    "store_context_kv_reference",
    "store_context_kv_refusal",
]


def paged_draft_attention(
    block: DraftBlock, cache: KVCache, table: ContextTable, scale: float, window: int | None = None
) -> torch.Tensor:
    """Block attention `[R, B, Hq, d]` of the draft `block` over its context, one layer's `cache` read at
    the slots `table` gives, and itself; see `reference.paged_draft_attention_reference` for the
    contract."""
    if use_kernel(
        "draft_attention.paged", block.q, lambda: paged_draft_attention_refusal(block, cache, table, window)
    ):
        from hylo.ops.draft_attention import kernels

        return kernels.paged_draft_attention(block, cache, table, scale, window)
    return paged_draft_attention_reference(block, cache, table, scale, window)


def store_context_kv(tokens: ContextTokens, keys: KeyTransform, cache: KVCache) -> None:
    """RMSNorm + RoPE the context keys of every draft layer and write keys and values into the caches
    (negative slots skipped); see `reference.store_context_kv_reference` for the contract."""
    if use_kernel(
        "draft_attention.store_context_kv",
        tokens.k_raw,
        lambda: store_context_kv_refusal(tokens, keys, cache),
    ):
        from hylo.ops.draft_attention import kernels

        kernels.store_context_kv(tokens, keys, cache)
        return
    store_context_kv_reference(tokens, keys, cache)


def normed_rotated(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """RMSNorm (`weight`, `eps`) then rotary embedding (`cos`/`sin` table rows at `positions [N]`) of a
    draft layer's queries or keys `x [N, H, d]`; see `reference.normed_rotated_reference` for the contract."""
    if use_kernel(
        "draft_attention.normed_rotated", x, lambda: normed_rotated_refusal(x, weight, cos, sin, positions)
    ):
        from hylo.ops.draft_attention import kernels

        return kernels.normed_rotated(x, weight, eps, cos, sin, positions)
    return normed_rotated_reference(x, weight, eps, cos, sin, positions)
