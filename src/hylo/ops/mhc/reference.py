"""Torch reference of manifold-constrained hyper-connections (mHC) around one block, and the typed
operand bundles the dispatcher and the kernels share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from hylo.ops.norm.reference import rms_norm

# the Triton kernels unroll this many residual streams (GLM-5.3-Flash's hc_mult); kept here, where the
# dispatcher and the kernels both read it without importing each other
KERNEL_STREAMS = 4


@dataclass(frozen=True)
class HCParams:
    """One hyper-connection: `fn [(2+n)·n, n·D]` (projection to the pre | post | comb logits), `base
    [(2+n)·n]`, `scale [3]` (pre, post, comb), the eps of the streams' RMS (`rms_eps`) and of the
    weights (`hc_eps`), and the Sinkhorn iterations (≥ 1)."""

    fn: torch.Tensor
    base: torch.Tensor
    scale: torch.Tensor
    rms_eps: float
    hc_eps: float
    sinkhorn_iters: int


class PendingPost(NamedTuple):
    """A block's output `out [T, D]` and its weights `post [T, n]`, `comb [T, n, n]` (fp32), not yet
    mixed into the streams (`mhc_post`)."""

    out: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor


@dataclass(frozen=True)
class BlockNorm:
    """The RMSNorm a block applies to its input (`weight [D]`, `eps`), as `ops.norm.rms_norm` computes it."""

    weight: torch.Tensor
    eps: float


class BlockEntry(NamedTuple):
    """What entering a block gives (`mhc_enter`): the streams `[T, n, D]` (after the previous block's
    post), this block's `post [T, n]` and `comb [T, n, n]` (fp32), and the block input `[T, D]`
    (normalised when a `BlockNorm` was given)."""

    streams: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    block_input: torch.Tensor


def mhc_pre(streams: torch.Tensor, hc: HCParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Weights of one hyper-connection and the collapsed block input.

    streams `[T, n, D]`. Returns post `[T, n]` and comb `[T, n, n]` (fp32; comb doubly stochastic after
    Sinkhorn, columns first) and the block input Σ_i pre_i·stream_i `[T, D]` in the streams' dtype.
    """
    n = streams.shape[1]
    flat = streams.flatten(1).float()
    flat = flat * torch.rsqrt(flat.square().mean(-1, keepdim=True) + hc.rms_eps)
    logits = flat @ hc.fn.float().t()
    pre_w, post_w, comb_w = logits.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = hc.base.float().split([n, n, n * n])
    pre = torch.sigmoid(pre_w * hc.scale[0] + pre_b) + hc.hc_eps
    post = 2 * torch.sigmoid(post_w * hc.scale[1] + post_b)
    comb = torch.softmax(comb_w.view(-1, n, n) * hc.scale[2] + comb_b.view(n, n), dim=-1) + hc.hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc.hc_eps)
    for _ in range(hc.sinkhorn_iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc.hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc.hc_eps)
    collapsed = (pre[..., None] * streams).sum(1).to(streams.dtype)
    return post, comb, collapsed


def mhc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams `post ⊗ out + combᵀ @ streams` (`[T, n, D]`, in the streams' dtype)."""
    dtype = streams.dtype
    return post.to(dtype)[..., None] * out[:, None, :] + comb.to(dtype).transpose(-1, -2) @ streams


def mhc_post_mean(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean over the new streams of `mhc_post` (`[T, D]`): what a model reads after its last block;
    with `rows` (token indices `[R]`) only theirs, `[R, D]` in that order (the tokens whose logits a
    step wants)."""
    if rows is not None:
        out, streams, post, comb = out[rows], streams[rows], post[rows], comb[rows]
    return mhc_post(out, streams, post, comb).mean(dim=1)


def mhc_enter(
    streams: torch.Tensor, hc: HCParams, pending: PendingPost | None = None, norm: BlockNorm | None = None
) -> BlockEntry:
    """The previous block's `pending` post applied to `streams` (when given), then `hc`'s pre of the
    result, then the block's `norm` of the block input (when given)."""
    if pending is not None:
        streams = mhc_post(pending.out, streams, pending.post, pending.comb)
    post, comb, block_input = mhc_pre(streams, hc)
    if norm is not None:
        block_input = rms_norm(block_input, norm.weight, norm.eps)
    return BlockEntry(streams, post, comb, block_input)
