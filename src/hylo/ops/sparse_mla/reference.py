"""Torch reference of absorbed sparse MLA: each query attends only to its selected latent rows."""

from __future__ import annotations

import torch


def sparse_mla(
    q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of `q_latent [T, H, R]` over the latent rows `rows [T, W]` of `latent [S, R]`.

    `rows` holds token-cache slots, -1 for an empty entry; every query has at least one row. The
    latent serves as both key and value (NoPE MLA with kv_b absorbed). Softmax in fp32.
    Returns `[T, H, R]` in q_latent's dtype.
    """
    valid = rows >= 0
    kv = latent[rows.clamp(min=0)]  # [T, W, R]
    scores = torch.einsum("thr,twr->thw", q_latent, kv).float() * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(q_latent.dtype)
    return torch.einsum("thw,twr->thr", probs, kv)
