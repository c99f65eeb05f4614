"""The torch reference of RMSNorm, as `transformers`' GLM-5.3-Flash (`glm5_next`) computes it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`weight · x / rms(x)` over the last dimension: normalised in fp32, rounded to `x`'s dtype, then
    scaled by `weight` in the promoted dtype (HF's order of operations)."""
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`x + delta` in their dtype, `rms_norm` of that sum): a residual add and the next block's norm."""
    total = x + delta
    return total, rms_norm(total, weight, eps)


@dataclass(frozen=True)
class NormRows:
    """Rows `x [T, w]` to normalise with an RMSNorm's `weight [w]` and `eps`."""

    x: torch.Tensor
    weight: torch.Tensor
    eps: float


@dataclass(frozen=True)
class RowStore:
    """Where rows go: row t into `out[index[t]]` (a cache written by slot, `out [S, w]`, `index [T]`)."""

    out: torch.Tensor
    index: torch.Tensor


def rms_norm_pair(first: NormRows, second: NormRows, store: RowStore) -> torch.Tensor:
    """Two RMSNorms of the same tokens' rows: returns `first`'s (`rms_norm`), and writes `second`'s into
    `store` (in its dtype). Tokens sharing a slot (the padding of a fixed-shape step) leave one of
    their rows there."""
    store.out[store.index] = rms_norm(second.x, second.weight, second.eps)
    return rms_norm(first.x, first.weight, first.eps)


def rms_norm_cat(first: NormRows, second: NormRows) -> torch.Tensor:
    """`[T, w1 + w2]`: the RMSNorms of two row sets of the same tokens side by side (`rms_norm` of each,
    concatenated along the last dimension), as an MTP layer feeds its projection."""
    return torch.cat(
        [rms_norm(first.x, first.weight, first.eps), rms_norm(second.x, second.weight, second.eps)], dim=-1
    )
