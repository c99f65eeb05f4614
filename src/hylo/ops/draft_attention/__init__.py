"""DFlash draft attention: paged block attention over the committed context and the context K/V store.

The dispatchers send CUDA calls the kernels accept (`support.*_refusal` is None) to the Triton
kernels (`kernels.py`: CUDA-graph safe) and everything else to the torch references
(`reference.py`: host reads, not graph safe). Triton is imported on first CUDA use only.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.draft_attention.reference import (
    paged_draft_attention_reference,
    rotary_tables,
    store_context_kv_reference,
)
from hylo.ops.draft_attention.support import paged_draft_attention_refusal, store_context_kv_refusal

__all__ = [
    "paged_draft_attention",
    "paged_draft_attention_reference",
    "paged_draft_attention_refusal",
    "rotary_tables",
    "store_context_kv",
    "store_context_kv_reference",
    "store_context_kv_refusal",
]


def paged_draft_attention(
    q: torch.Tensor,
    k_block: torch.Tensor,
    v_block: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    req_to_token: torch.Tensor,
    rows: torch.Tensor,
    ctx_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
) -> torch.Tensor:
    """Block attention `[R, B, Hq, d]` of the draft block over its paged context and itself; see
    `reference.paged_draft_attention_reference` for the contract."""
    args = (q, k_block, v_block, k_cache, v_cache, req_to_token, rows, ctx_lens)
    if use_kernel("draft_attention.paged", q, lambda: paged_draft_attention_refusal(*args, window)):
        from hylo.ops.draft_attention import kernels

        return kernels.paged_draft_attention(*args, scale, window)
    return paged_draft_attention_reference(*args, scale, window)


def store_context_kv(
    k_raw: torch.Tensor,
    v: torch.Tensor,
    k_norm_weight: torch.Tensor,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    slots: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
) -> None:
    """RMSNorm + RoPE the context keys of every draft layer and write keys and values into the caches
    (negative slots skipped); see `reference.store_context_kv_reference` for the contract."""
    tensors = (k_raw, v, k_norm_weight, cos, sin, positions, slots, k_cache, v_cache)
    if use_kernel("draft_attention.store_context_kv", k_raw, lambda: store_context_kv_refusal(*tensors)):
        from hylo.ops.draft_attention import kernels

        kernels.store_context_kv(k_raw, v, k_norm_weight, eps, cos, sin, positions, slots, k_cache, v_cache)
        return
    store_context_kv_reference(k_raw, v, k_norm_weight, eps, cos, sin, positions, slots, k_cache, v_cache)
