"""Triton greedy acceptance: `reference.accepted_prefix` in one launch (the reference's ~11 small
kernels ran in every verify step). One program per block: its picks and drafts are a row of at most
`MAX_BLOCK` tokens. Integer comparisons only: the results are the reference's exactly."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _accepted_prefix_kernel(
    picks, picks_stride, drafts, drafts_stride, num_drafts, accepted, committed, anchors,
    width, HAS_NUM_DRAFTS: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    v = tl.program_id(0).to(tl.int64)
    j = tl.arange(0, BLOCK)
    drafted = width - 1
    if HAS_NUM_DRAFTS:
        drafted = tl.minimum(tl.load(num_drafts + v).to(tl.int32), width - 1)
    pick = tl.load(picks + v * picks_stride + j, mask=j < width, other=0)
    draft = tl.load(drafts + v * drafts_stride + j, mask=j < width - 1, other=0)
    # the first draft that is not kept (past the row's drafts: at its draft count) ends the prefix
    refused = (pick != draft) | (j >= drafted)
    count = tl.min(tl.where(refused, j, BLOCK), axis=0)
    tl.store(accepted + v, count.to(tl.int64))
    tl.store(committed + v, (count + 1).to(tl.int32))
    tl.store(anchors + v, tl.sum(tl.where(j == count, pick, 0), axis=0).to(tl.int64))


def accepted_prefix(
    picks: torch.Tensor, drafts: torch.Tensor, num_drafts: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.accepted_prefix` for the calls `refusal` takes."""
    blocks, width = picks.shape
    device = picks.device
    accepted = torch.empty(blocks, dtype=torch.long, device=device)
    committed = torch.empty(blocks, dtype=torch.int32, device=device)
    anchors = torch.empty(blocks, dtype=torch.long, device=device)
    _accepted_prefix_kernel[(blocks,)](
        picks, picks.stride(0), drafts, drafts.stride(0), num_drafts if num_drafts is not None else picks,
        accepted, committed, anchors, width, HAS_NUM_DRAFTS=num_drafts is not None,
        BLOCK=triton.next_power_of_2(width), num_warps=1,
    )  # fmt: skip
    return accepted, committed, anchors
