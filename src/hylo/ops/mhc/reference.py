"""Torch reference of manifold-constrained hyper-connections (mHC) around one block."""

from __future__ import annotations

import torch

# the Triton kernels unroll this many residual streams (GLM-5.3-Flash's hc_mult); kept here, where the
# dispatcher and the kernels both read it without importing each other
KERNEL_STREAMS = 4


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of one hyper-connection and the collapsed block input.

    streams `[T, n, D]`; fn `[(2+n)·n, n·D]`; base `[(2+n)·n]`; scale `[3]` (pre, post, comb).
    Returns post `[T, n]` and comb `[T, n, n]` (fp32; comb doubly stochastic after Sinkhorn,
    columns first) and the block input Σ_i pre_i·stream_i `[T, D]` in the streams' dtype.
    """
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + rms_eps)
    logits = flat @ fn.float().t()
    pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * scale[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * scale[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    collapsed = (pre[..., None] * streams).sum(1).to(streams.dtype)
    return post, comb, collapsed


def mhc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams `post ⊗ out + combᵀ @ streams` (`[T, n, D]`, in the streams' dtype)."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


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
    """`mhc_post` of one block then `mhc_pre` of the next: (new streams, post, comb, block input)."""
    streams = mhc_post(out, streams, post, comb)
    return (streams, *mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters))
