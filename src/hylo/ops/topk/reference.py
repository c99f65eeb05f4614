"""The torch reference of `top_k`: each row's k largest entries, largest first, ties to the lower index."""

from __future__ import annotations

from typing import NamedTuple

import torch


class TopK(NamedTuple):
    """`values [..., k]` in x's dtype and their `indices [..., k]` (int64), largest first."""

    values: torch.Tensor
    indices: torch.Tensor


def top_k(x: torch.Tensor, k: int) -> TopK:
    """(values `[..., k]` in x's dtype, indices `[..., k]` int64) of the k largest entries of each row of x
    (its last dim), in descending order; equal values in ascending index order (a stable sort), so the
    result is one fixed valid `torch.topk` answer on every device."""
    if not 0 < k <= x.shape[-1]:
        raise ValueError(f"top_k: k = {k} must be within [1, {x.shape[-1]}] (the rows' length)")
    values, indices = torch.sort(x, dim=-1, descending=True, stable=True)
    return TopK(values[..., :k].contiguous(), indices[..., :k].contiguous())
