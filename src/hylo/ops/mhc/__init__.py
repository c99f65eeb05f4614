"""mHC ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to `kernels` (pre: two launches; post: one elementwise launch), everything else to
the reference. `mhc_post_pre` is post then pre on every device: on the H200 a fused launch was never
faster (10.50 / 14.68 / 990 us against 10.22 / 14.15 / 793 at M = 1 / 64 / 13312).
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.mhc import reference
from hylo.ops.mhc.reference import KERNEL_STREAMS

__all__ = ["KERNEL_STREAMS", "mhc_post", "mhc_post_pre", "mhc_pre", "refusal", "streams_refusal"]


def streams_refusal(hc_mult: int) -> str | None:
    """Why the kernels cannot take a model of `hc_mult` residual streams, or None."""
    if hc_mult != KERNEL_STREAMS:
        return f"hc_mult {hc_mult}: the kernels unroll {KERNEL_STREAMS} streams"
    return None


def refusal(streams: torch.Tensor) -> str | None:
    """Why the mHC kernels cannot take `streams [T, n, D]`, or None."""
    if streams.dim() != 3:
        return f"streams {tuple(streams.shape)}: the kernels take [tokens, streams, hidden]"
    if (reason := streams_refusal(streams.shape[1])) is not None:
        return reason
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported dtype {streams.dtype} (bf16, fp16 or fp32)"
    return None


def _use_kernels(op: str, streams: torch.Tensor) -> bool:
    return use_kernel(f"mhc.{op}", streams, lambda: refusal(streams))


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
    if _use_kernels("pre", streams):
        from hylo.ops.mhc import kernels

        return kernels.mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)
    return reference.mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters)


def mhc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams post ⊗ out + combᵀ @ streams; see `reference.mhc_post`."""
    if _use_kernels("post", streams):
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
    """`mhc_post` of one block then `mhc_pre` of the next: (new streams, post, comb, block input)."""
    streams = mhc_post(out, streams, post, comb)
    return (streams, *mhc_pre(streams, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters))
