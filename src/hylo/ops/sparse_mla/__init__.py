"""Sparse MLA attention: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to `kernels.sparse_mla_fwd` (split-KV decode or one-pass prefill, chosen by the
number of query tokens), everything else to the reference.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.sparse_mla import reference

__all__ = ["rank_refusal", "refusal", "sparse_mla"]


def rank_refusal(rank: int) -> str | None:
    """Why the kernels cannot take a latent of rank `rank` (the model's `kv_lora_rank`), or None."""
    if rank < 16 or rank & (rank - 1):
        return f"latent rank {rank}: the kernels tile a power-of-two rank >= 16"
    return None


def refusal(latent: torch.Tensor) -> str | None:
    """Why `kernels.sparse_mla_fwd` cannot take attention over `latent [S, R]`, or None."""
    return rank_refusal(latent.shape[-1])


def sparse_mla(
    q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of `q_latent [T, H, R]` over the latent rows `rows [T, W]` (cache slots, -1 = empty)
    of `latent [S, R]`; see `reference.sparse_mla`."""
    if use_kernel("sparse_mla", q_latent, lambda: refusal(latent)):
        from hylo.ops.sparse_mla import kernels

        return kernels.sparse_mla_fwd(q_latent, latent, rows, scale)
    return reference.sparse_mla(q_latent, latent, rows, scale)
