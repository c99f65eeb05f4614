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
from hylo.ops.indexer.reference import fp8_row_scale, quantize_fp8_rows, select_rows

__all__ = ["compress_pools", "fp8_row_scale", "quantize_fp8_rows", "select_rows", "select_slots"]


def compress_pools(
    keys: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pools: torch.Tensor,
    pooled: torch.Tensor,
    pooled_scale: torch.Tensor | None = None,
) -> None:
    """Pool compression (see `reference.compress_pools`); FP8 when `pooled` is float8_e4m3fn."""
    if use_kernel("indexer.compress_pools", keys):
        from hylo.ops.indexer import kernels

        kernels.compress_pools(keys, gates, ape, pools, pooled, pooled_scale)
    else:
        reference.compress_pools(keys, gates, ape, pools, pooled, pooled_scale)


def select_slots(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    pooled_scale: torch.Tensor | None,
    pool_table: torch.Tensor,
    req_to_token: torch.Tensor,
    token_seq: torch.Tensor,
    token_rows: torch.Tensor,
    positions: torch.Tensor,
    pad_index: torch.Tensor,
    pad_valid: torch.Tensor,
    kpool: int,
    topk: int,
    tail: bool,
) -> torch.Tensor:
    """Token-cache slots each packed query attends to, `[T, W]`, -1 = empty (see
    `reference.select_slots`). Scoring is FP8 when `pooled` is float8_e4m3fn, else in its dtype."""
    args = (q, head_weights, pooled, pooled_scale, pool_table, req_to_token, token_seq, token_rows, positions)
    if use_kernel("indexer.select_slots", q):
        from hylo.ops.indexer import kernels

        return kernels.select_slots(*args, pad_index, pad_valid, kpool, topk, tail)
    return reference.select_slots(*args, pad_index, pad_valid, kpool, topk, tail)
