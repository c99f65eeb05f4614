"""DSA k-pool indexer ops: torch references and Triton kernels behind one dispatcher per op.

CUDA tensors go to the Triton kernels (`kernels.py`), everything else to the reference. The two
paths select the same rows (ties to the earlier pool) but lay them out differently: the reference
keeps `select_rows`' order and width (topk + kpool - 1), the kernels write the selected slots
compactly and pad the width to a multiple of 64. Attention treats a row list as a set.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.indexer import reference
from hylo.ops.indexer.reference import (
    KeyNorm,
    PooledKeys,
    Selection,
    SlotLayout,
    TokenKeys,
    fp8_row_scale,
    quantize_fp8_rows,
    select_rows,
)

__all__ = [
    "KeyNorm",
    "PooledKeys",
    "Selection",
    "SlotLayout",
    "TokenKeys",
    "compress_pools",
    "fp8_row_scale",
    "quantize_fp8_rows",
    "select_rows",
    "select_slots",
    "store_refusal",
    "store_tokens",
]


def store_refusal(
    key: torch.Tensor, gate_scores: torch.Tensor, norm: KeyNorm, cache: TokenKeys, slots: torch.Tensor
) -> str | None:
    """Why `kernels.store_tokens` cannot take this call, or None."""
    if key.dim() != 2 or gate_scores.shape != key.shape:
        return "key and gate_scores must be [T, d] alike"
    tokens, dim = key.shape
    if dim & (dim - 1):
        return f"key width {dim}: the kernel holds one power-of-two row"
    for name, t in (("keys", cache.keys), ("gates", cache.gates)):
        if t.dim() != 2 or t.shape[1] != dim:
            return f"the {name} cache must be [S, {dim}]"
    if any(t.stride(-1) != 1 for t in (key, gate_scores, cache.keys, cache.gates)):
        return "key, gate_scores and the caches must have a unit last stride"
    if any(p.shape != (dim,) or not p.is_contiguous() for p in (norm.weight, norm.bias)):
        return f"the norm's weight and bias must be contiguous [{dim}] vectors"
    if slots.shape != (tokens,) or slots.dtype not in (torch.int32, torch.int64):
        return "slots must be [T] int32 or int64"
    return None


def store_tokens(
    key: torch.Tensor, gate_scores: torch.Tensor, norm: KeyNorm, cache: TokenKeys, slots: torch.Tensor
) -> None:
    """The new tokens' LayerNorm'd keys and gate scores into the per-token caches (see
    `reference.store_tokens`): one launch on the GPU for the reference's three kernels. A call that
    autograd records (training: the kernel has no backward) takes the reference."""
    args = (key, gate_scores, norm, cache, slots)
    recorded = torch.is_grad_enabled() and key.requires_grad
    if not recorded and use_kernel("indexer.store_tokens", key, lambda: store_refusal(*args)):
        from hylo.ops.indexer import kernels

        kernels.store_tokens(*args)
    else:
        reference.store_tokens(*args)


def compress_pools(
    keys: torch.Tensor, gates: torch.Tensor, ape: torch.Tensor, pools: torch.Tensor, pooled: PooledKeys
) -> None:
    """Pool compression of the completed `pools` into `pooled` (see `reference.compress_pools`); FP8
    when its keys are float8_e4m3fn."""
    if use_kernel("indexer.compress_pools", keys):
        from hylo.ops.indexer import kernels

        kernels.compress_pools(keys, gates, ape, pools, pooled.keys, pooled.scale)
    else:
        reference.compress_pools(keys, gates, ape, pools, pooled.keys, pooled.scale)


def select_slots(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: PooledKeys,
    layout: SlotLayout,
    selection: Selection,
    tokens: range | None = None,
) -> torch.Tensor:
    """Token-cache slots each packed query (`q [T, Hi, d]`, `head_weights [T, Hi]`) attends to, `[T, W]`,
    -1 = empty (see `reference.select_slots`); with `tokens` (a rank's share of a step split by token),
    those packed tokens' rows alone, `[len(tokens), W]`, the kernels scoring and ranking no other.
    Scoring is FP8 when the pooled keys are float8_e4m3fn. q and head_weights may be column views of
    wider products in any float dtype (read as fp32), and need no constant factor: a positive factor
    of every score does not change which pools are best."""
    if use_kernel("indexer.select_slots", q):
        from hylo.ops.indexer import kernels

        return kernels.select_slots(q, head_weights, pooled, layout, selection, tokens)
    rows = reference.select_slots(q, head_weights, pooled, layout, selection)
    return rows if tokens is None else rows[tokens.start : tokens.stop]
