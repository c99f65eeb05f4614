"""Sparse MLA attention: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to `kernels.sparse_mla_fwd` (split-KV decode or one-pass prefill, chosen by the
number of query tokens), everything else to the reference.
"""

from __future__ import annotations

import torch

from hylo.ops.sparse_mla import reference

__all__ = ["sparse_mla"]


def sparse_mla(
    q_latent: torch.Tensor, latent: torch.Tensor, rows: torch.Tensor, scale: float
) -> torch.Tensor:
    """Attention of `q_latent [T, H, R]` over the latent rows `rows [T, W]` (cache slots, -1 = empty)
    of `latent [S, R]`; see `reference.sparse_mla`."""
    if q_latent.is_cuda:
        from hylo.ops.sparse_mla import kernels

        return kernels.sparse_mla_fwd(q_latent, latent, rows, scale)
    return reference.sparse_mla(q_latent, latent, rows, scale)
