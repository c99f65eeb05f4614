"""mHC ops: the torch reference and the Triton kernels behind one dispatcher.

CUDA tensors go to `kernels`, everything else to the reference. `mhc_enter` is what a decoder layer
runs between two blocks (the previous block's post, this block's pre, the block's RMSNorm): two launches
at decode sizes (see `kernels`); `mhc_post` alone (one elementwise launch) ends the last block, or
`mhc_post_mean` (the same launch, storing the streams' mean) where only the mean is read after it.
"""

from __future__ import annotations

import torch

from hylo.ops.dispatch import use_kernel
from hylo.ops.mhc import reference
from hylo.ops.mhc.reference import KERNEL_STREAMS, BlockEntry, BlockNorm, HCParams, PendingPost
from hylo.ops.norm import refusal as norm_refusal

__all__ = [
    "KERNEL_STREAMS",
    "BlockEntry",
    "BlockNorm",
    "HCParams",
    "PendingPost",
    "mhc_enter",
    "mhc_post",
    "mhc_post_mean",
    "mhc_pre",
    "refusal",
    "rows_refusal",
    "streams_refusal",
]


def streams_refusal(hc_mult: int) -> str | None:
    """Why the kernels cannot take a model of `hc_mult` residual streams, or None."""
    if hc_mult != KERNEL_STREAMS:
        return f"hc_mult {hc_mult}: the kernels unroll {KERNEL_STREAMS} streams"
    return None


def refusal(
    streams: torch.Tensor, norm: BlockNorm | None = None, rows: torch.Tensor | None = None
) -> str | None:
    """Why the mHC kernels cannot take `streams [T, n, D]` (and normalise the block input with `norm`,
    or read the tokens `rows` alone), or None."""
    if streams.dim() != 3:
        return f"streams {tuple(streams.shape)}: the kernels take [tokens, streams, hidden]"
    if (reason := streams_refusal(streams.shape[1])) is not None:
        return reason
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return f"unsupported dtype {streams.dtype} (bf16, fp16 or fp32)"
    if norm is not None:
        return norm_refusal(streams[:, 0], norm.weight)
    return rows_refusal(rows, streams)


def _use_kernels(
    op: str, streams: torch.Tensor, norm: BlockNorm | None = None, rows: torch.Tensor | None = None
) -> bool:
    return use_kernel(f"mhc.{op}", streams, lambda: refusal(streams, norm, rows))


def mhc_pre(streams: torch.Tensor, hc: HCParams) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(post [T, n], comb [T, n, n], block input [T, D]) of `streams [T, n, D]`; see `reference.mhc_pre`."""
    if _use_kernels("pre", streams):
        from hylo.ops.mhc import kernels

        return kernels.mhc_pre(streams, hc)
    return reference.mhc_pre(streams, hc)


def mhc_post(
    out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """New streams post ⊗ out + combᵀ @ streams; see `reference.mhc_post`."""
    if _use_kernels("post", streams):
        from hylo.ops.mhc import kernels

        return kernels.mhc_post(out, streams, post, comb)
    return reference.mhc_post(out, streams, post, comb)


def mhc_post_mean(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    rows: torch.Tensor | None = None,
) -> torch.Tensor:
    """The new streams' mean `[T, D]`, or of the tokens `rows` alone `[R, D]` (read through the index
    inside the launch: no gather before or after it); see `reference.mhc_post_mean`."""
    if _use_kernels("post_mean", streams, rows=rows):
        from hylo.ops.mhc import kernels

        return kernels.mhc_post_mean(out, streams, post, comb, rows)
    return reference.mhc_post_mean(out, streams, post, comb, rows)


def rows_refusal(rows: torch.Tensor | None, streams: torch.Tensor) -> str | None:
    """Why the post-mean kernel cannot read the tokens `rows` of `streams`, or None."""
    if rows is None:
        return None
    if rows.dim() != 1 or rows.dtype not in (torch.int32, torch.int64) or rows.device != streams.device:
        return "rows must be a 1-D int32 or int64 index on the streams' device"
    return None


def mhc_enter(
    streams: torch.Tensor, hc: HCParams, pending: PendingPost | None = None, norm: BlockNorm | None = None
) -> BlockEntry:
    """`pending`'s post (when given), `hc`'s pre and the block's `norm` (when given): (new streams, post,
    comb, block input); see `reference.mhc_enter`. Safe under CUDA-graph capture: fixed shapes, no host
    reads, allocations by shape only."""
    if _use_kernels("enter", streams, norm):
        from hylo.ops.mhc import kernels

        return kernels.mhc_enter(streams, hc, pending, norm)
    return reference.mhc_enter(streams, hc, pending, norm)
