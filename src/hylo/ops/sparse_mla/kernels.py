"""Triton kernels of absorbed sparse MLA (NoPE, latent = key = value) over selected cache rows.

One program owns one query token, a block of heads and a contiguous chunk of that token's row list;
it gathers the chunk's latent rows (slot -1 = empty, never read), runs an online softmax in fp32 and
either writes the normalised output (one chunk per token: prefill) or a partial output plus its
log-sum-exp (several chunks per token: decode/verify), which `_merge_kernel` combines. A prefill
program first finds its token's last valid row and walks the list only that far: the GPU indexer
writes the valid rows first, so a token with fewer rows than the list holds (each token of a prompt
shorter than the selection) walks only the blocks its rows fill. A chunk with
no valid row leaves lse = -inf and weighs nothing in the merge. Scores are kept in base 2.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.operands import HeadRows
from hylo.ops.sparse_mla import cuda_prefill
from hylo.ops.sparse_mla.operands import LatentRows, RowLists, SplitHeadRows, SplitLse

LOG2E = 1.4426950408889634
# row-list entries a prefill program scans per load for its last valid row: one size for every width, so
# that a new width compiles no new kernel (a compile inside a CUDA-graph capture fails it)
ROW_SCAN_BLOCK = 256


@triton.jit
def _sparse_mla_kernel(
    queries, latent, rows, out, lse, num_heads, rows_per_split, scale_log2,
    BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, R: tl.constexpr, PARTIAL: tl.constexpr,
    SKIP_EMPTY: tl.constexpr, TRIM: tl.constexpr, BLOCK_W: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (token, split, head block) (module docstring): `queries [T, num_heads, R]` (`HeadRows`) over
    the `latent` rows (`LatentRows`) of entries [split·rows_per_split, + rows_per_split) of the token's
    row list (`RowLists`), scores scaled by `scale_log2` (base 2). PARTIAL: the split's output (fp32,
    normalised over its own rows) into `out` (`SplitHeadRows`) and its log-sum-exp into `lse` (`SplitLse`);
    else the output, in out's dtype, into `out` (one split; `lse` unread)."""
    enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    heads = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    dims = tl.arange(0, R)
    head_ok = heads < num_heads
    q = tl.load(
        queries.data + tok * queries.token_stride + heads[:, None] * queries.head_stride + dims[None, :],
        mask=head_ok[:, None],
        other=0.0,
    )
    # A finite start keeps exp2(-inf - m) = 0 (not NaN) for blocks whose rows are all empty.
    m_i = tl.full([BLOCK_H], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, R], tl.float32)
    # The last chunk may run past `width`: its extra blocks are all empty (skipped or masked).
    lo = split * rows_per_split
    hi = lo + rows_per_split
    if TRIM:  # stop after the token's last valid row: a short context leaves the rest of its list empty
        last = tl.full([], 0, tl.int32)
        for w0 in range(0, rows.width, BLOCK_W):
            c = w0 + tl.arange(0, BLOCK_W)
            r = tl.load(rows.slots + tok * rows.token_stride + c, mask=c < rows.width, other=-1)
            last = tl.maximum(last, tl.max(tl.where(r >= 0, c + 1, 0), axis=0))
        hi = tl.minimum(hi, last)
    for start in range(lo, hi, BLOCK_N):
        cols = start + tl.arange(0, BLOCK_N)
        idx = tl.load(rows.slots + tok * rows.token_stride + cols, mask=cols < rows.width, other=-1)
        valid = idx >= 0
        run = True
        if SKIP_EMPTY:  # decode: skip the loads and dots of a block with no valid row
            run = tl.max(valid.to(tl.int32), axis=0) > 0
        if run:
            kv = tl.load(
                latent.data + idx.to(tl.int64)[:, None] * latent.slot_stride + dims[None, :],
                mask=valid[:, None],
                other=0.0,
            )
            s = tl.dot(q, tl.trans(kv)) * scale_log2
            s = tl.where(valid[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(kv.dtype), kv)
            m_i = m_new
    has_rows = l_i > 0
    inv_l = tl.where(has_rows, 1.0 / tl.where(has_rows, l_i, 1.0), 0.0)
    o = acc * inv_l[:, None]
    o_ptrs = (
        out.data
        + tok * out.token_stride
        + split * out.split_stride
        + heads[:, None] * out.head_stride
        + dims[None, :]
    )
    o_mask = head_ok[:, None]
    if PARTIAL:
        log_sum = tl.where(has_rows, m_i + tl.log2(tl.where(has_rows, l_i, 1.0)), float("-inf"))
        tl.store(lse.data + tok * lse.token_stride + split * lse.split_stride + heads, log_sum, mask=head_ok)
        tl.store(o_ptrs, o, mask=o_mask)
    else:
        tl.store(o_ptrs, o.to(out.data.dtype.element_ty), mask=o_mask)


@triton.jit
def _merge_kernel(
    parts, lse, out, num_splits, rank, BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, PDL: tl.constexpr
):
    """One (token, head, block of BLOCK_R dims): the `num_splits` partial outputs `parts`
    (`SplitHeadRows`) weighed by their log-sum-exps `lse` (`SplitLse`) into `out [T, H, rank]`
    (`HeadRows`)."""
    enter(PDL)
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dims = tl.program_id(2) * BLOCK_R + tl.arange(0, BLOCK_R)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < num_splits
    log_sum = tl.load(
        lse.data + tok * lse.token_stride + splits * lse.split_stride + head,
        mask=split_ok,
        other=float("-inf"),
    )
    top = tl.max(log_sum, axis=0)
    live = log_sum > float("-inf")
    weight = tl.where(live, tl.exp2(log_sum - tl.where(live, top, 0.0)), 0.0)
    total = tl.sum(weight, axis=0)
    weight = weight / tl.where(total > 0, total, 1.0)
    part = tl.load(
        parts.data
        + tok * parts.token_stride
        + splits[:, None] * parts.split_stride
        + head * parts.head_stride
        + dims[None, :],
        mask=live[:, None] & (dims < rank)[None, :],
        other=0.0,
    )
    o = tl.sum(part * weight[:, None], axis=0)
    tl.store(
        out.data + tok * out.token_stride + head * out.head_stride + dims,
        o.to(out.data.dtype.element_ty),
        mask=dims < rank,
    )


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_config(num_tokens: int, num_heads: int) -> dict[str, Any]:
    """Tile choice for `sparse_mla_fwd` (measured on H200, 64 heads, 2112-wide rows; RESULTS.md):
    for 1-2 query tokens narrow head blocks put more programs in flight; from 3 tokens on, whole
    64-head blocks with wgmma read each row once, and half a wave of longer programs (about four
    row blocks each) beats a full wave of two-block ones: fewer partials to write and merge, and
    the row gathers reach their pipelined steady state."""
    if num_tokens <= 2:
        return {"block_h": 16, "block_n": 64, "num_warps": 4, "num_stages": 2, "waves": 1.0}
    return {"block_h": 64, "block_n": 64, "num_warps": 8, "num_stages": 2, "waves": 0.5}


def sparse_mla_fwd(
    q_latent: torch.Tensor,
    latent: torch.Tensor,
    rows: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    block_h: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    waves: float | None = None,
    skip_empty: bool = False,
    cuda: bool = True,
) -> torch.Tensor:
    """Absorbed sparse MLA: `q_latent [T, H, R]` attends to `latent[rows[t]]` (`latent [S, R]`,
    `rows [T, W]` int32/int64 cache slots, -1 = empty; any W). Same contract as the reference.

    `num_splits` chunks each token's row list across programs (merged by log-sum-exp); by default it
    is picked so that about `waves` (default: `default_config`) x the SM count of programs run, and 1
    (no merge) when the tokens alone fill the GPU. `skip_empty` branches around blocks with no valid
    row (saves their dots, but the branch stops the row loads from being software-pipelined); masked
    rows are never read anyway. With one split and `cuda`, the CUDA prefill kernel runs where it can
    (`cuda_prefill.refusal`; the tile arguments then do not apply).
    """
    num_tokens, num_heads, rank = q_latent.shape
    width = rows.shape[1]
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    rows = rows if rows.stride(-1) == 1 else rows.contiguous()
    out = torch.empty_like(q_latent)
    if num_tokens == 0:
        return out
    cfg = default_config(num_tokens, num_heads)
    block_h = block_h or min(cfg["block_h"], max(16, triton.next_power_of_2(num_heads)))
    block_n = block_n or cfg["block_n"]
    num_warps = num_warps or cfg["num_warps"]
    num_stages = num_stages or cfg["num_stages"]
    waves = waves or cfg["waves"]
    if rank & (rank - 1) or rank < 16:
        raise ValueError(f"sparse_mla_fwd needs a power-of-two latent rank >= 16, got {rank}")
    head_blocks = triton.cdiv(num_heads, block_h)
    row_blocks = max(1, triton.cdiv(width, block_n))
    if num_splits is None:
        target = math.ceil(waves * _num_sms(q_latent.device))
        num_splits = min(row_blocks, max(1, triton.cdiv(target, num_tokens * head_blocks)))
    blocks_per_split = triton.cdiv(row_blocks, max(1, num_splits))
    num_splits = triton.cdiv(row_blocks, blocks_per_split)
    if num_splits == 1 and cuda and cuda_prefill.refusal(q_latent, latent, rows) is None:
        return cuda_prefill.prefill(q_latent, latent, rows, scale, out)
    rows_per_split = blocks_per_split * block_n
    grid = (num_tokens, num_splits, head_blocks)
    dependent = dependent_launches(q_latent.device)
    common = dict(
        BLOCK_H=block_h, BLOCK_N=block_n, R=rank, BLOCK_W=ROW_SCAN_BLOCK,
        num_warps=num_warps, num_stages=num_stages, PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    if num_splits == 1:
        _sparse_mla_kernel[grid](
            HeadRows.of(q_latent), LatentRows.of(latent), RowLists.of(rows),
            SplitHeadRows(out, out.stride(0), 0, out.stride(1)), SplitLse(out, 0, 0),  # lse: unread
            num_heads, rows_per_split, scale * LOG2E,
            PARTIAL=False, SKIP_EMPTY=False, TRIM=True, **common,
        )  # fmt: skip
        return out
    part = torch.empty(num_tokens, num_splits, num_heads, rank, dtype=torch.float32, device=q_latent.device)
    lse = torch.empty(num_tokens, num_splits, num_heads, dtype=torch.float32, device=q_latent.device)
    dependent = dependent_launches(q_latent.device)
    _sparse_mla_kernel[grid](
        HeadRows.of(q_latent), LatentRows.of(latent), RowLists.of(rows), SplitHeadRows.of(part),
        SplitLse.of(lse), num_heads, rows_per_split, scale * LOG2E,
        PARTIAL=True, SKIP_EMPTY=skip_empty, TRIM=False, **common,
    )  # fmt: skip
    block_r = min(rank, 128)
    _merge_kernel[(num_tokens, num_heads, rank // block_r)](
        SplitHeadRows.of(part), SplitLse.of(lse), HeadRows.of(out), num_splits, rank,
        BLOCK_S=max(2, triton.next_power_of_2(num_splits)), BLOCK_R=block_r, num_warps=4,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return out


def sparse_mla_decode(q_latent, latent, rows, scale, **kwargs) -> torch.Tensor:
    """Decode/verify (a few query tokens per request): rows split across programs, merged by lse."""
    return sparse_mla_fwd(q_latent, latent, rows, scale, **kwargs)


def sparse_mla_prefill(q_latent, latent, rows, scale, **kwargs) -> torch.Tensor:
    """Prefill: one program per token and head block walks all of that token's rows (no merge)."""
    kwargs.setdefault("num_splits", 1)
    kwargs.setdefault("block_h", 64)
    kwargs.setdefault("num_warps", 8)
    kwargs.setdefault("num_stages", 2)
    return sparse_mla_fwd(q_latent, latent, rows, scale, **kwargs)
