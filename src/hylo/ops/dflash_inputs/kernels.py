"""Triton kernels of a DFlash step's index arithmetic: one launch each for what the reference does in 8
(`committed_slots`) and 10 (`draft_blocks`) small ops. Programs own disjoint outputs and read only inputs."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.dflash_inputs.reference import CommittedTokens, DraftBlocks

TOKENS_PER_PROGRAM = 1024
BLOCKS_PER_PROGRAM = 16


@triton.jit
def _committed_slots_kernel(committed, pad_stride, slots, T, BT: tl.constexpr, PDL: tl.constexpr):
    """Tokens `BT·pid + [0, BT)` of `committed` (`CommittedTokens`; pad_index rows `pad_stride` apart)."""
    enter(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    ok = t < T
    seq = tl.load(committed.token_seq + t, mask=ok, other=0).to(tl.int64)
    first = tl.load(committed.pad_index + seq * pad_stride, mask=ok, other=0).to(tl.int64)
    count = tl.load(committed.counts + seq, mask=ok, other=0).to(tl.int64)
    slot = tl.load(committed.new_slots + t, mask=ok, other=0)
    tl.store(slots + t, tl.where(t - first < count, slot, -1), mask=ok)


@triton.jit
def _draft_blocks_kernel(
    committed, pad_stride, state_slots, sampling, anchors, out, S, mask_token_id,
    W: tl.constexpr, BS: tl.constexpr, BW: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Blocks `BS·pid + [0, BS)` (of `sampling`'s S) into `out` (`DraftBlocks`, contiguous)."""
    enter(PDL)
    b = tl.program_id(0) * BS + tl.arange(0, BS)
    ok = b < S
    seq = tl.load(sampling + b, mask=ok, other=0).to(tl.int64)
    tl.store(out.rows + b, tl.load(state_slots + seq, mask=ok, other=0), mask=ok)
    first = tl.load(committed.pad_index + seq * pad_stride, mask=ok, other=0).to(tl.int64)
    start = tl.load(committed.positions + first, mask=ok, other=0)
    length = start + tl.load(committed.counts + seq, mask=ok, other=0)
    tl.store(out.lengths + b, length, mask=ok)
    w = tl.arange(0, BW)
    cell = ok[:, None] & (w < W)[None, :]
    anchor = tl.load(anchors + seq, mask=ok, other=0)
    tokens = tl.where(w[None, :] == 0, anchor[:, None], mask_token_id)
    tl.store(out.tokens + b[:, None] * W + w[None, :], tokens, mask=cell)
    tl.store(
        out.positions + b[:, None] * W + w[None, :], length.to(tl.int64)[:, None] + w[None, :], mask=cell
    )


def committed_slots(committed: CommittedTokens) -> torch.Tensor:
    """`reference.committed_slots` in one launch (calls the package's `slots_refusal` lets through)."""
    count = committed.token_seq.shape[0]
    slots = torch.empty_like(committed.new_slots)
    if count:
        dependent = dependent_launches(slots.device)
        _committed_slots_kernel[(triton.cdiv(count, TOKENS_PER_PROGRAM),)](
            committed, committed.pad_index.stride(0), slots, count,
            BT=TOKENS_PER_PROGRAM, PDL=dependent, launch_pdl=dependent, num_warps=4,
        )  # fmt: skip
    return slots


def draft_blocks(
    committed: CommittedTokens, state_slots: torch.Tensor, sampling: torch.Tensor, anchors: torch.Tensor,
    width: int, mask_token_id: int,
) -> DraftBlocks:  # fmt: skip
    """`reference.draft_blocks` in one launch (calls the package's `blocks_refusal` lets through)."""
    count, device = sampling.shape[0], sampling.device
    length_dtype = torch.promote_types(committed.positions.dtype, committed.counts.dtype)
    out = DraftBlocks(
        torch.empty(count, dtype=state_slots.dtype, device=device),
        torch.empty(count, dtype=length_dtype, device=device),
        torch.empty(count, width, dtype=torch.int64, device=device),
        torch.empty(count, width, dtype=torch.int64, device=device),
    )
    if count:
        dependent = dependent_launches(device)
        _draft_blocks_kernel[(triton.cdiv(count, BLOCKS_PER_PROGRAM),)](
            committed, committed.pad_index.stride(0), state_slots, sampling, anchors, out, count,
            mask_token_id,
            W=width, BS=BLOCKS_PER_PROGRAM, BW=triton.next_power_of_2(width), PDL=dependent,
            launch_pdl=dependent, num_warps=1,
        )  # fmt: skip
    return out
