"""Triton kernels of mHC hyper-connections with four streams (hc_mult = 4).

`mhc_post` is one elementwise pass. New streams are the mix post·out + Σ_k comb_k·stream_k in fp32,
with post and comb cast to the streams' dtype as the reference casts them, rounded once (torch
rounds the product, the matmul and the sum separately, so the two differ by one last-place step
in about a third of bf16 elements; these kernels give the correctly rounded mix).

`mhc_pre` and `mhc_post_pre` run one persistent launch whose programs walk a fixed list of work
items, split by row blocks of `block_m` tokens:

- a *projection* item owns one row block and one chunk of hidden dims of all four streams. With
  `post` fused it first writes the new streams of its tile. It projects the tile on the 24 rows of
  `fn` with `tl.dot` as fnᵀ-chunk @ tileᵀ (the tile is the shared-memory operand, so the elementwise
  work keeps a row-contiguous layout), with fp32 accumulation; an fp32 `fn` is split into two
  halves of the streams' dtype, so the products stay exact. It stores the partial logits and sum
  of squares. The last projection item of a row block sums all partials in a fixed order (results
  do not depend on timing), publishes the `pre` weights, then computes `post` and `comb` (softmax,
  Sinkhorn) while the collapse proceeds.
- a *collapse* item owns one row block and one chunk of hidden dims of the block input. It waits for
  the row block's `pre` weights and sums pre_i·stream_i; the streams it reads were read or written a
  few microseconds earlier, so they come from L2.

Items are listed so that a row block's collapse items come `lag` steps after its projection items,
about one wave of programs later. Program p takes items p, p + G, p + 2G, ... in order; every program
is resident at once (G ≤ SMs, one program per SM), so the smallest unfinished item can always
proceed and a wait cannot deadlock. A bounded spin budget per program turns a broken residency
assumption into wrong numbers rather than a hung GPU. A row block's counters go back to zero with
its last collapse item, so the counter buffer is ready for the next launch (and for CUDA-graph
replays).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

HC_MULT = 4
# One partial row: pre logits (4) | sum of squares | pad | post logits (4) | pad | comb logits (16).
# post and comb start on 16-byte boundaries, so the finishing item reads them as vectors.
PART_WIDTH = tl.constexpr(32)
SUMSQ_COL = tl.constexpr(4)
POST_COL = tl.constexpr(8)
COMB_COL = tl.constexpr(16)
# Elements per thread of the largest tile the finishing item loads at once while summing partials.
FINISH_PER_THREAD = 64
SPIN_LIMIT = 1 << 20  # ~1 s of polling; a legitimate wait is a few microseconds
COUNTER_SLOTS = 1 << 16


@dataclass(frozen=True)
class Plan:
    """Work split of one hyper-connection launch (see the module docstring)."""

    block_m: int  # tokens per row block (≥ 16: the tl.dot minimum)
    project_chunk: int  # hidden dims per projection item
    collapse_chunk: int  # hidden dims per collapse item
    block_k: int  # hidden dims per inner step of a projection item
    num_warps: int
    collapse_k: int = 128  # hidden dims per inner step of a collapse item (its loads are not pipelined)
    num_stages: int = 3
    lag: int | None = None  # steps between a row block's projection and collapse items (None: one wave)


def default_plan(tokens: int) -> Plan:
    """The fastest of the plans timed by `benchmarks/kernels/mhc_moe.py --sweep` on the H200
    (pre plus fused post+pre at M = 1 and 64 for decode, at M = 13312 for prefill)."""
    if tokens <= 64:
        return Plan(block_m=16, project_chunk=128, collapse_chunk=128, block_k=32, num_warps=4)
    return Plan(block_m=64, project_chunk=512, collapse_chunk=512, block_k=64, num_warps=8)


@triton.jit
def _weights(ptr, stride: tl.constexpr, rmask, DTYPE: tl.constexpr):
    """Four fp32 weights per row, at ptr + {0, 1, 2, 3}·stride, rounded through the streams' dtype
    (the reference mixes with weights cast to it)."""
    w0 = tl.load(ptr, mask=rmask, other=0.0).to(DTYPE).to(tl.float32)
    w1 = tl.load(ptr + stride, mask=rmask, other=0.0).to(DTYPE).to(tl.float32)
    w2 = tl.load(ptr + 2 * stride, mask=rmask, other=0.0).to(DTYPE).to(tl.float32)
    w3 = tl.load(ptr + 3 * stride, mask=rmask, other=0.0).to(DTYPE).to(tl.float32)
    return w0, w1, w2, w3


@triton.jit
def _mix_weights(post_rows, comb_rows, rmask, DTYPE: tl.constexpr):
    """Per new stream j, (post_j, comb_0j, comb_1j, comb_2j, comb_3j): [BM] vectors read from
    post_rows + j and comb_rows + 4k + j."""
    p0, p1, p2, p3 = _weights(post_rows, 1, rmask, DTYPE)
    c00, c10, c20, c30 = _weights(comb_rows, 4, rmask, DTYPE)
    c01, c11, c21, c31 = _weights(comb_rows + 1, 4, rmask, DTYPE)
    c02, c12, c22, c32 = _weights(comb_rows + 2, 4, rmask, DTYPE)
    c03, c13, c23, c33 = _weights(comb_rows + 3, 4, rmask, DTYPE)
    return (
        (p0, c00, c10, c20, c30),
        (p1, c01, c11, c21, c31),
        (p2, c02, c12, c22, c32),
        (p3, c03, c13, c23, c33),
    )


@triton.jit
def _expand(o, s0, s1, s2, s3, w, DTYPE: tl.constexpr):
    """One new stream from out and the old streams (fp32 [BM, BK] each) and its weights `w`
    (see `_mix_weights`): post·out + Σ_k comb_k·stream_k, rounded once to DTYPE."""
    p, c0, c1, c2, c3 = w
    return (p[:, None] * o + c0[:, None] * s0 + c1[:, None] * s1 + c2[:, None] * s2 + c3[:, None] * s3).to(
        DTYPE
    )


@triton.jit
def _project_stream(
    acc, x, fn, stream, d, dmask, rows_of_fn, D: tl.constexpr, SPLIT_FN: tl.constexpr, PRECISION
):
    """acc [PART_WIDTH, BM] += fn's rows (in the partial layout) at stream's dims d @ xᵀ [BK, BM]."""
    # partial column -> row of fn: pre 0-3 -> 0-3, post 8-11 -> 4-7, comb 16-31 -> 8-23
    fn_row = tl.where(
        rows_of_fn < POST_COL, rows_of_fn, tl.where(rows_of_fn < COMB_COL, rows_of_fn - 4, rows_of_fn - 8)
    )
    valid = (
        (rows_of_fn < SUMSQ_COL)
        | ((rows_of_fn >= POST_COL) & (rows_of_fn < POST_COL + 4))
        | (rows_of_fn >= COMB_COL)
    )
    ptr = fn + fn_row[:, None].to(tl.int64) * (4 * D) + stream * D + d[None, :]
    f = tl.load(ptr, mask=valid[:, None] & dmask[None, :], other=0.0).to(tl.float32)
    high = f.to(x.dtype)
    xt = tl.trans(x)
    acc = tl.dot(high, xt, acc, input_precision=PRECISION)
    if SPLIT_FN:
        acc = tl.dot((f - high.to(tl.float32)).to(x.dtype), xt, acc, input_precision=PRECISION)
    return acc


@triton.jit
def _project_item(
    rb,
    chunk,
    streams,
    out,
    post_in,
    comb_in,
    new_streams,
    fn,
    partials,
    M,
    D: tl.constexpr,
    BM: tl.constexpr,
    PROJECT_CHUNK: tl.constexpr,
    BK: tl.constexpr,
    FUSE_POST: tl.constexpr,
    SPLIT_FN: tl.constexpr,
    PRECISION: tl.constexpr,
):
    rows = rb * BM + tl.arange(0, BM)
    rmask = rows < M
    row_off = rows.to(tl.int64) * (4 * D)
    cols = tl.arange(0, PART_WIDTH)
    dtype = streams.dtype.element_ty
    acc = tl.zeros((PART_WIDTH, BM), tl.float32)  # transposed: the streams are the dot's B operand
    squares = tl.zeros((BM,), tl.float32)
    if FUSE_POST:
        w0, w1, w2, w3 = _mix_weights(post_in + rows * 4, comb_in + rows * 16, rmask, dtype)
    for step in range(PROJECT_CHUNK // BK):
        d = chunk * PROJECT_CHUNK + step * BK + tl.arange(0, BK)
        dmask = d < D
        mask = rmask[:, None] & dmask[None, :]
        ptr = row_off[:, None] + d[None, :]
        x0 = tl.load(streams + ptr, mask=mask, other=0.0)
        x1 = tl.load(streams + ptr + D, mask=mask, other=0.0)
        x2 = tl.load(streams + ptr + 2 * D, mask=mask, other=0.0)
        x3 = tl.load(streams + ptr + 3 * D, mask=mask, other=0.0)
        if FUSE_POST:
            o = tl.load(out + rows[:, None].to(tl.int64) * D + d[None, :], mask=mask, other=0.0).to(
                tl.float32
            )
            s0, s1, s2, s3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
            x0 = _expand(o, s0, s1, s2, s3, w0, dtype)
            x1 = _expand(o, s0, s1, s2, s3, w1, dtype)
            x2 = _expand(o, s0, s1, s2, s3, w2, dtype)
            x3 = _expand(o, s0, s1, s2, s3, w3, dtype)
            tl.store(new_streams + ptr, x0, mask=mask)
            tl.store(new_streams + ptr + D, x1, mask=mask)
            tl.store(new_streams + ptr + 2 * D, x2, mask=mask)
            tl.store(new_streams + ptr + 3 * D, x3, mask=mask)
        acc = _project_stream(acc, x0, fn, 0, d, dmask, cols, D, SPLIT_FN, PRECISION)
        acc = _project_stream(acc, x1, fn, 1, d, dmask, cols, D, SPLIT_FN, PRECISION)
        acc = _project_stream(acc, x2, fn, 2, d, dmask, cols, D, SPLIT_FN, PRECISION)
        acc = _project_stream(acc, x3, fn, 3, d, dmask, cols, D, SPLIT_FN, PRECISION)
        f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        squares += tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
    acc += tl.where(cols[:, None] == SUMSQ_COL, squares[None, :], 0.0)
    part = partials + (chunk * M + rows[None, :]).to(tl.int64) * PART_WIDTH + cols[:, None]
    tl.store(part, acc, mask=rmask[None, :])


@triton.jit
def _column(table, cols, j: tl.constexpr):
    """Column j of table [BM, PART_WIDTH] as a [BM] vector."""
    return tl.sum(tl.where(cols[None, :] == j, table, 0.0), axis=1)


@triton.jit
def _finish_row_block(
    rb,
    partials,
    pre_ws,
    counters,
    post_out,
    comb_out,
    base,
    scale,
    M,
    rms_eps,
    hc_eps,
    D: tl.constexpr,
    BM: tl.constexpr,
    NP: tl.constexpr,
    SPLIT_STEP: tl.constexpr,
    ITERS: tl.constexpr,
):
    """Sums a row block's partials (fixed order), publishes pre, then computes post and comb."""
    rows = rb * BM + tl.arange(0, BM)
    rmask = rows < M
    cols = tl.arange(0, PART_WIDTH)
    table = tl.zeros((BM, PART_WIDTH), tl.float32)
    for first in range(0, NP, SPLIT_STEP):
        splits = first + tl.arange(0, SPLIT_STEP)
        row_ptr = partials + (splits[:, None] * M + rows[None, :]).to(tl.int64) * PART_WIDTH
        mask = ((splits[:, None] < NP) & rmask[None, :])[:, :, None]
        tile = tl.load(row_ptr[:, :, None] + cols[None, None, :], mask=mask, other=0.0, cache_modifier=".cg")
        table += tl.sum(tile, axis=0)
    rstd = tl.rsqrt(_column(table, cols, SUMSQ_COL) / (4 * D) + rms_eps)
    s_pre = tl.load(scale) * rstd
    for i in tl.static_range(4):
        pre = tl.sigmoid(_column(table, cols, i) * s_pre + tl.load(base + i)) + hc_eps
        tl.store(pre_ws + rows * 4 + i, pre, mask=rmask)
    # The sums go back over split 0 of these rows (no longer read by anyone else) and return as
    # fresh [BM, 4] and [BM, 4, 4] tiles, in layouts that keep each row of four in one thread.
    sums = partials + rows.to(tl.int64) * PART_WIDTH
    tl.store(sums[:, None] + cols[None, :], table, mask=rmask[:, None])
    tl.debug_barrier()  # every thread's pre and sums stores precede the release and the reloads
    tl.atomic_add(counters + 2 * rb, 1, sem="release")

    c4 = tl.arange(0, 4)
    # plain loads: this block's own stores, ordered by the barrier (CTA scope, through this SM's L1)
    rstd = tl.rsqrt(tl.load(sums + SUMSQ_COL, mask=rmask, other=0.0) / (4 * D) + rms_eps)
    post_l = tl.load(sums[:, None] + POST_COL + c4[None, :], mask=rmask[:, None], other=0.0)
    post = 2 * tl.sigmoid(post_l * rstd[:, None] * tl.load(scale + 1) + tl.load(base + 4 + c4)[None, :])
    tl.store(post_out + rows[:, None] * 4 + c4[None, :], post, mask=rmask[:, None])

    kj = c4[:, None] * 4 + c4[None, :]
    comb_l = tl.load(sums[:, None, None] + COMB_COL + kj[None, :, :], mask=rmask[:, None, None], other=0.0)
    z = comb_l * rstd[:, None, None] * tl.load(scale + 2) + tl.load(base + 8 + kj)[None, :, :]
    e = tl.exp(z - tl.max(z, axis=2)[:, :, None])
    comb = e / tl.sum(e, axis=2)[:, :, None] + hc_eps
    comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    for _ in range(ITERS - 1):
        comb = comb / (tl.sum(comb, axis=2)[:, :, None] + hc_eps)
        comb = comb / (tl.sum(comb, axis=1)[:, None, :] + hc_eps)
    tl.store(comb_out + rows[:, None, None] * 16 + kj[None, :, :], comb, mask=rmask[:, None, None])


@triton.jit
def _collapse_item(
    rb,
    chunk,
    source,
    pre_ws,
    counters,
    collapsed,
    M,
    spins,
    D: tl.constexpr,
    BM: tl.constexpr,
    NP: tl.constexpr,
    NC: tl.constexpr,
    COLLAPSE_CHUNK: tl.constexpr,
    CK: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    # NP projection arrivals + 1 from the finishing item once pre is stored.
    arrived = tl.atomic_add(counters + 2 * rb, 0, sem="acquire")
    while (arrived <= NP) & (spins < SPIN_LIMIT):
        spins += 1
        arrived = tl.atomic_add(counters + 2 * rb, 0, sem="acquire")
    rows = rb * BM + tl.arange(0, BM)
    rmask = rows < M
    # .cg: these lines were written by other SMs during this launch; skip this SM's L1.
    w = pre_ws + rows * 4
    p0 = tl.load(w, mask=rmask, other=0.0, cache_modifier=".cg")[:, None]
    p1 = tl.load(w + 1, mask=rmask, other=0.0, cache_modifier=".cg")[:, None]
    p2 = tl.load(w + 2, mask=rmask, other=0.0, cache_modifier=".cg")[:, None]
    p3 = tl.load(w + 3, mask=rmask, other=0.0, cache_modifier=".cg")[:, None]
    row_off = rows.to(tl.int64) * (4 * D)
    for step in range(COLLAPSE_CHUNK // CK):
        d = chunk * COLLAPSE_CHUNK + step * CK + tl.arange(0, CK)
        mask = rmask[:, None] & (d < D)[None, :]
        ptr = source + row_off[:, None] + d[None, :]
        x = p0 * tl.load(ptr, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x += p1 * tl.load(ptr + D, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x += p2 * tl.load(ptr + 2 * D, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        x += p3 * tl.load(ptr + 3 * D, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32)
        out_ptr = collapsed + rows[:, None].to(tl.int64) * D + d[None, :]
        tl.store(out_ptr, x.to(collapsed.dtype.element_ty), mask=mask)
    # The last collapse item of the row block resets its counters for the next launch.
    if tl.atomic_add(counters + 2 * rb + 1, 1, sem="relaxed") == NC - 1:
        tl.atomic_xchg(counters + 2 * rb, 0, sem="relaxed")
        tl.atomic_xchg(counters + 2 * rb + 1, 0, sem="relaxed")
    return spins


@triton.jit(do_not_specialize=["M", "lag"])  # one compile serves every token count
def _hyper_connection_kernel(
    streams,
    out,
    post_in,
    comb_in,
    new_streams,
    fn,
    base,
    scale,
    partials,
    pre_ws,
    counters,
    post_out,
    comb_out,
    collapsed,
    M,
    lag,
    rms_eps,
    hc_eps,
    D: tl.constexpr,
    ITERS: tl.constexpr,
    BM: tl.constexpr,
    PROJECT_CHUNK: tl.constexpr,
    COLLAPSE_CHUNK: tl.constexpr,
    BK: tl.constexpr,
    CK: tl.constexpr,
    SPLIT_STEP: tl.constexpr,
    FUSE_POST: tl.constexpr,
    SPLIT_FN: tl.constexpr,
    PRECISION: tl.constexpr,
    SPIN_LIMIT: tl.constexpr,
):
    NP: tl.constexpr = (D + PROJECT_CHUNK - 1) // PROJECT_CHUNK
    NC: tl.constexpr = (D + COLLAPSE_CHUNK - 1) // COLLAPSE_CHUNK
    n_blocks = tl.cdiv(M, BM)
    total = (n_blocks + lag) * (NP + NC)
    spins = 0
    item = tl.program_id(0)
    while item < total:
        step = item // (NP + NC)
        slot = item % (NP + NC)
        if slot < NP:
            if step < n_blocks:
                _project_item(
                    step,
                    slot,
                    streams,
                    out,
                    post_in,
                    comb_in,
                    new_streams,
                    fn,
                    partials,
                    M,
                    D,
                    BM,
                    PROJECT_CHUNK,
                    BK,
                    FUSE_POST,
                    SPLIT_FN,
                    PRECISION,
                )
                tl.debug_barrier()  # every thread's partial store precedes the release below
                if tl.atomic_add(counters + 2 * step, 1, sem="acq_rel") == NP - 1:
                    _finish_row_block(
                        step,
                        partials,
                        pre_ws,
                        counters,
                        post_out,
                        comb_out,
                        base,
                        scale,
                        M,
                        rms_eps,
                        hc_eps,
                        D,
                        BM,
                        NP,
                        SPLIT_STEP,
                        ITERS,
                    )
        elif step >= lag:
            spins = _collapse_item(
                step - lag,
                slot - NP,
                new_streams,  # the streams themselves when post is not fused
                pre_ws,
                counters,
                collapsed,
                M,
                spins,
                D,
                BM,
                NP,
                NC,
                COLLAPSE_CHUNK,
                CK,
                SPIN_LIMIT,
            )
        item += tl.num_programs(0)


@triton.jit(do_not_specialize=["M"])
def _post_kernel(
    out,
    streams,
    post,
    comb,
    new_streams,
    M,
    D: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
):
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = rows < M
    mask = rmask[:, None] & (d < D)[None, :]
    ptr = rows[:, None].to(tl.int64) * (4 * D) + d[None, :]
    o = tl.load(out + rows[:, None].to(tl.int64) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    s0 = tl.load(streams + ptr, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(streams + ptr + D, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(streams + ptr + 2 * D, mask=mask, other=0.0).to(tl.float32)
    s3 = tl.load(streams + ptr + 3 * D, mask=mask, other=0.0).to(tl.float32)
    dtype = streams.dtype.element_ty
    w0, w1, w2, w3 = _mix_weights(post + rows * 4, comb + rows * 16, rmask, dtype)
    tl.store(new_streams + ptr, _expand(o, s0, s1, s2, s3, w0, dtype), mask=mask)
    tl.store(new_streams + ptr + D, _expand(o, s0, s1, s2, s3, w1, dtype), mask=mask)
    tl.store(new_streams + ptr + 2 * D, _expand(o, s0, s1, s2, s3, w2, dtype), mask=mask)
    tl.store(new_streams + ptr + 3 * D, _expand(o, s0, s1, s2, s3, w3, dtype), mask=mask)


# ---------------------------------------------------------------- launchers

_COUNTERS: dict[torch.device, list[torch.Tensor]] = {}
_SMS: dict[torch.device, int] = {}


def _counters(device: torch.device, row_blocks: int) -> torch.Tensor:
    """Per row block (arrivals, collapses done), zero between launches. Launches on one device share
    it, so they must not overlap (one CUDA stream). Buffers are never freed: a captured CUDA graph
    keeps using the one it saw."""
    held = _COUNTERS.setdefault(device, [])
    if not held or held[-1].numel() < 2 * row_blocks:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            # zeros made during a capture are only written when the graph replays
            raise RuntimeError(f"run the mHC kernels once for {row_blocks} row blocks before graph capture")
        held.append(torch.zeros(max(COUNTER_SLOTS, 2 * row_blocks), dtype=torch.int32, device=device))
    return held[-1]


def _programs(device: torch.device, items: int) -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        return 1  # the interpreter runs programs one after another: one program takes items in order
    if device not in _SMS:
        _SMS[device] = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(items, _SMS[device]))


def _check_streams(streams: torch.Tensor) -> tuple[int, int]:
    if streams.dim() != 3 or streams.shape[1] != HC_MULT:
        raise ValueError(f"streams must be [tokens, {HC_MULT}, hidden], got {tuple(streams.shape)}")
    if streams.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"streams must be bf16, fp16 or fp32, got {streams.dtype}")
    return streams.shape[0], streams.shape[2]


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, the streams on {like.device}")


def _check_plan(plan: Plan) -> None:
    for field in ("block_m", "project_chunk", "collapse_chunk", "block_k", "collapse_k"):
        value = getattr(plan, field)
        if value < 16 or value & (value - 1):
            raise ValueError(f"plan.{field} must be a power of two ≥ 16, got {value}")
    if plan.block_k > plan.project_chunk:
        raise ValueError(f"plan.block_k ({plan.block_k}) exceeds plan.project_chunk ({plan.project_chunk})")


def _hyper_connection(
    streams: torch.Tensor,
    expand: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    plan: Plan | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(streams the pre reads, post, comb, block input); with `expand` = (out, post, comb) the
    streams are first replaced by post ⊗ out + combᵀ·streams."""
    tokens, hidden = _check_streams(streams)
    n_proj = (2 + HC_MULT) * HC_MULT
    _check("fn", fn, (n_proj, HC_MULT * hidden), streams)
    _check("base", base, (n_proj,), streams)
    _check("scale", scale, (3,), streams)
    if sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be ≥ 1, got {sinkhorn_iters}")
    plan = plan or default_plan(tokens)
    _check_plan(plan)
    streams, fn = streams.contiguous(), fn.contiguous()
    device, dtype = streams.device, streams.dtype
    post = torch.empty(tokens, HC_MULT, dtype=torch.float32, device=device)
    comb = torch.empty(tokens, HC_MULT, HC_MULT, dtype=torch.float32, device=device)
    collapsed = torch.empty(tokens, hidden, dtype=dtype, device=device)
    if expand is None:
        new_streams, out, post_in, comb_in = streams, streams, post, comb
    else:
        out, post_in, comb_in = expand
        _check("out", out, (tokens, hidden), streams)
        _check("post", post_in, (tokens, HC_MULT), streams)
        _check("comb", comb_in, (tokens, HC_MULT, HC_MULT), streams)
        if out.dtype != dtype:
            raise ValueError(f"out is {out.dtype}, the streams {dtype}")
        out, post_in, comb_in = out.contiguous(), post_in.float().contiguous(), comb_in.float().contiguous()
        new_streams = torch.empty_like(streams)
    if tokens == 0:
        return new_streams, post, comb, collapsed

    n_project = triton.cdiv(hidden, plan.project_chunk)
    n_collapse = triton.cdiv(hidden, plan.collapse_chunk)
    row_blocks = triton.cdiv(tokens, plan.block_m)
    partials = torch.empty(n_project, tokens, PART_WIDTH.value, dtype=torch.float32, device=device)
    pre_ws = torch.empty(tokens, HC_MULT, dtype=torch.float32, device=device)
    per_step = n_project + n_collapse
    programs = _programs(device, row_blocks * per_step)
    lag = plan.lag if plan.lag is not None else triton.cdiv(programs, per_step)
    lag = max(1, min(lag, row_blocks))
    programs = min(programs, (row_blocks + lag) * per_step)
    finish_tile = FINISH_PER_THREAD * 32 * plan.num_warps
    split_step = triton.next_power_of_2(
        max(1, min(n_project, finish_tile // (plan.block_m * PART_WIDTH.value)))
    )
    _hyper_connection_kernel[(programs,)](
        streams,
        out,
        post_in,
        comb_in,
        new_streams,
        fn,
        base.float().contiguous(),
        scale.float().contiguous(),
        partials,
        pre_ws,
        _counters(device, row_blocks),
        post,
        comb,
        collapsed,
        tokens,
        lag,
        rms_eps,
        hc_eps,
        D=hidden,
        ITERS=sinkhorn_iters,
        BM=plan.block_m,
        PROJECT_CHUNK=plan.project_chunk,
        COLLAPSE_CHUNK=plan.collapse_chunk,
        BK=plan.block_k,
        CK=min(plan.collapse_k, plan.collapse_chunk),
        SPLIT_STEP=split_step,
        FUSE_POST=expand is not None,
        SPLIT_FN=fn.element_size() > streams.element_size(),
        PRECISION="ieee" if dtype == torch.float32 else "tf32",
        SPIN_LIMIT=SPIN_LIMIT,
        num_warps=plan.num_warps,
        num_stages=plan.num_stages,
    )
    return new_streams, post, comb, collapsed


def mhc_pre(
    streams: torch.Tensor,
    fn: torch.Tensor,
    base: torch.Tensor,
    scale: torch.Tensor,
    rms_eps: float,
    hc_eps: float,
    sinkhorn_iters: int,
    plan: Plan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.mhc_pre`: (post [T, 4], comb [T, 4, 4], block input [T, D])."""
    _, post, comb, collapsed = _hyper_connection(
        streams, None, fn, base, scale, rms_eps, hc_eps, sinkhorn_iters, plan
    )
    return post, comb, collapsed


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
    plan: Plan | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.mhc_post_pre`: (new streams, post, comb, block input), one pass over the streams."""
    return _hyper_connection(
        streams, (out, post, comb), fn, base, scale, rms_eps, hc_eps, sinkhorn_iters, plan
    )


def mhc_post(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    block_m: int = 16,
    block_k: int = 128,
    num_warps: int = 4,
) -> torch.Tensor:
    """See `reference.mhc_post`: new streams post ⊗ out + combᵀ @ streams `[T, 4, D]`."""
    tokens, hidden = _check_streams(streams)
    _check("out", out, (tokens, hidden), streams)
    _check("post", post, (tokens, HC_MULT), streams)
    _check("comb", comb, (tokens, HC_MULT, HC_MULT), streams)
    if out.dtype != streams.dtype:
        raise ValueError(f"out is {out.dtype}, the streams {streams.dtype}")
    streams = streams.contiguous()
    new_streams = torch.empty_like(streams)
    if tokens == 0:
        return new_streams
    grid = (triton.cdiv(tokens, block_m), triton.cdiv(hidden, block_k))
    _post_kernel[grid](
        out.contiguous(),
        streams,
        post.float().contiguous(),
        comb.float().contiguous(),
        new_streams,
        tokens,
        D=hidden,
        BM=block_m,
        BK=block_k,
        num_warps=num_warps,
    )
    return new_streams
