"""mHC ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to `kernels` (one persistent launch per pre or fused post+pre, one elementwise launch
per post), everything else to the reference. The fused post+pre runs from 65 tokens up; below, post
then pre.
"""

from __future__ import annotations

import torch

from hylo.ops.mhc import reference

__all__ = ["mhc_post", "mhc_post_pre", "mhc_pre"]

# Up to this many tokens the H200 ran post then pre faster than the fused launch (19.2 vs 20.6 us at
# M = 1, 37.3 vs 42.4 us at M = 64; benchmarks/kernels/mhc_moe.py); at M = 13312 the fused launch
# was as fast (956 vs 972 us) and moves a third less data.
SEPARATE_POST_PRE_TOKENS = 64


def _use_kernels(streams: torch.Tensor) -> bool:
    return streams.is_cuda


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post [T, n], comb [T, n, n], block input [T, D]) of `streams [T, n, D]`; see `reference.mhc_pre`."""
    if _use_kernels(streams):
        from hylo.ops.mhc import kernels

        return kernels.mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)
    return reference.mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)


def mhc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams post ⊗ out + combᵀ @ streams; see `reference.mhc_post`."""
    if _use_kernels(streams):
        from hylo.ops.mhc import kernels

        return kernels.mhc_post(out, streams, post, comb)
    return reference.mhc_post(out, streams, post, comb)


def mhc_post_pre(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`mhc_post` of one block fused with `mhc_pre` of the next: (new streams, post, comb, block input)."""
    if _use_kernels(streams) and streams.shape[0] > SEPARATE_POST_PRE_TOKENS:
        from hylo.ops.mhc import kernels

        hc = (fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)
        return kernels.mhc_post_pre(out, streams, post, comb, *hc)
    streams = mhc_post(out, streams, post, comb)
    return (streams, *mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters))
