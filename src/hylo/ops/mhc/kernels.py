"""Triton kernels of mHC hyper-connections with four streams (hc_mult = 4).

`mhc_post` is one elementwise pass. New streams are the mix post·out + Σ_k comb_k·stream_k in fp32,
with post and comb cast to the streams' dtype as the reference casts them, rounded once (torch
rounds the product, the matmul and the sum separately, so the two differ by one last-place step
in about a third of bf16 elements; these kernels give the correctly rounded mix).

`mhc_pre` is two launches with no communication between programs, so results never depend on
timing and CUDA graphs need no state. The 24 × 4·D projection is mostly a read of `fn`, so the
first launch spreads the hidden dims over many programs, each storing its partial logits and sum of
squares; the second gives each program a few tokens and a chunk of hidden dims: it sums the
partials in a fixed order, derives `pre` and collapses its chunk; one more program per token block
computes `post` and `comb` (softmax, Sinkhorn) alongside. At decode sizes both start as programmatic
dependents of the launch before them (`ops.dependent_launch`), which hides most of the gap between
launches; `mhc_post` and `mhc_post_mean` launch as dependents at every size.

The projection multiplies in the streams' dtype with fp32 accumulation; an fp32 `fn` is split into
two halves of the streams' dtype, so the products stay exact.

`mhc_enter` is what a decoder layer needs between two blocks: the previous block's post, this block's
pre and the block's RMSNorm. Under the decode plan it is the same two launches: the projection programs
mix the pending post into the dims they project (and store the new streams, which no other program of
that launch reads), the finishing programs hold whole rows and normalise the block input before storing
it. Both compute what post, pre and `ops.norm`'s kernel compute one after another, with the same
roundings: the new streams and pre's results bit for bit, the normalised input up to the order in which
its fp32 sum of squares is reduced (one last-place step at most). A decode layer's mHC and norms take 4
launches for the 8 of post, pre (2) and RMSNorm per block. A prefill entry with rows of at most
WHOLE_ROWS_MAX dims fuses both too (`entry_plan`: whole-row finishing programs, 32-dim projection steps),
for the bytes rather than the launches: the streams are read once fewer; wider rows launch post and the
RMSNorm apart.

H200, GLM-5.3-Flash shapes (hidden 4096, bf16; benchmarks/kernels/mhc_moe.py, CUDA-graph replay up to
M = 64): pre 5.36 / 5.66 / 6.48 / 278 us and post 1.18 / 1.61 / 2.08 / 245 us at M = 1 / 16 / 64 /
13312 with the default plans; post then pre 6.98 / 7.46 / 8.79 / 527 us (before the fused decode plan).
The projection puts the tokens on the rows of its products, so from 64 tokens they run as wgmma (at
M = 13312 the projection launch took 226 us with fn's rows there, 136 us now). Three alternatives measured
slower and were removed: post fused into the pre's first launch (10.50 / 11.57 / 14.68 / 990 us against
post then pre at 10.22 / 11.57 / 14.15 / 793 at the time, before the projection's token rows and
split-major partials; it is back under the decode plan for the launch count and awaits a new
measurement), one launch whose programs own whole tokens (pre 888-1665 us at M = 13312), and post then
pre in one launch with grid barriers at M ≤ 64 (12.1 / 13.9 / 16.3 us against 10.3 / 11.8 / 14.3 at the
time). At M = 13312 three more (session 7, against 521-528 us): one persistent launch handing
post+projection and finishing items out by ticket so the finish reads the new streams from L2 (1201 us at
best), post then pre in L2-sized token chunks (563 us), and post with the projection in one pass before
the finish (529 us).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.mhc.reference import KERNEL_STREAMS as HC_MULT
from hylo.ops.mhc.reference import BlockEntry, BlockNorm, HCParams, PendingPost
from hylo.ops.norm import rms_norm

N_LOGITS = tl.constexpr(24)  # pre (4) | post (4) | comb (16): the rows of fn
LOGIT_ROWS = tl.constexpr(32)  # logits padded to a tl.dot size; row 24 carries the sum of squares
SUMSQ_ROW = tl.constexpr(24)
TABLE_ELEMENTS = 2048  # largest [32, tokens, splits] tile a finishing program sums at once


@dataclass(frozen=True)
class SplitPlan:
    """Work split of `mhc_pre`'s two launches (see the module docstring); the defaults are
    `DECODE_PLAN`."""

    split: int = 64  # hidden dims (of each stream) per projection program
    block_m: int = 16  # tokens per projection program (≥ 16: the tl.dot minimum)
    block_k: int = 32  # hidden dims per inner step of a projection program
    collapse_tokens: int = 1  # tokens per finishing program
    collapse_chunk: int = 4096  # hidden dims per finishing program
    collapse_k: int = 4096  # hidden dims per inner step of a finishing program
    num_warps: int = 2  # per projection program
    finish_warps: int = 4  # per finishing program
    split_major: bool = True  # partials stored [split, token, row]; else [token, row, split]
    # both launches start while the one before finishes, and wait for it (`ops.dependent_launch`;
    # the post launches are dependents under every plan)
    dependent_launch: bool = True
    # a pending post is mixed by the projection launch (one launch fewer), else launched before it
    fuse_post: bool = True


# The H200 sweeps' fastest at M = 1 / 16 / 64 (session 6, post then pre under graph replay, 10.2 / 11.8 / 14.2
# us before): two-warp projections (-0.5 to -1.2 us), split-major partials (each projection program's
# stores contiguous: -1.3 us at M = 64), dependent launches (-0.6 to -0.9 us; post as one too made M = 64
# 5 us slower then, after a kernel that did not let it start early; since S32 every decode kernel does),
# whole-chunk collapse steps (-0.3 us).
DECODE_PLAN = SplitPlan()
# The H200 sweep's fastest pre at M = 13312 (365 us when the projection's products had fn's rows as their
# rows, 226 us of them; with 16-token blocks 550: each program reads fn's 24 × 4·split slice once per token
# block, so small blocks read fn three times as often as the streams; blocks of 32 / 128 tokens or 128
# dims: 701 / 390 / 390 us). With tokens as the rows: 278 us; 128-token blocks 285-289, 8 warps 335,
# 128-dim steps 273, splits of 512 / 2048 275 / 269 (one run, S6-14). Token-major partials: split-major
# ones made the previous projection 15 us slower here (not measured since). On an H100 (S37-4, one run):
# 64-dim steps 359.6, 128-dim 352.2 us, splits of 2048 356.5, 128-token blocks 370.9, 32-token 540.7: the
# 128-dim steps, faster on both GPUs.
PREFILL_PLAN = SplitPlan(
    split=1024,
    block_m=64,
    block_k=128,
    collapse_tokens=4,
    collapse_chunk=1024,
    collapse_k=256,
    num_warps=4,
    split_major=False,
    dependent_launch=False,
    fuse_post=False,
)
# Not measured between M = 64 and 13312: from here the prefill plan's projection has 512 programs
# (~4 per H200 SM), while the decode plan's 64-dim splits multiply its partials 16-fold.
PREFILL_PLAN_FROM = 2048


def default_plan(tokens: int) -> SplitPlan:
    return PREFILL_PLAN if tokens >= PREFILL_PLAN_FROM else DECODE_PLAN


# the widest rows a prefill entry's finishing programs take whole (GLM-5.3-Flash's hidden, the width measured)
WHOLE_ROWS_MAX = 4096
# a prefill projection's dims a step where it mixes a pending post (H100, M = 13312, S39-2: 32 dims on 4 warps
# 711 us the entry, 8 warps 847, 64 dims on 8 warps 1114, 128-token blocks of 32 dims 753)
POST_FUSED_BLOCK_K = 32


def entry_plan(tokens: int, hidden: int, with_norm: bool, with_post: bool = False) -> SplitPlan:
    """`mhc_enter`'s plan where none is given: `default_plan`, except for a prefill entry with the block's
    norm (and rows of at most WHOLE_ROWS_MAX dims). Its finishing programs take one whole row each and apply
    the norm there (one launch and a round trip of the block input fewer: at M = 13312 on an H100 the entry
    780 -> 751 us, RESULTS S37-4); with a pending post (`with_post`) the projection launch mixes it into the
    streams it reads, 32 dims a step so that its five fp32 tiles fit in registers (one launch and a read of
    the streams fewer: 755.7 -> 711.0 us, S39-2; with the prefill plan's 128-dim steps it spilled: 1660)."""
    plan = default_plan(tokens)
    if with_norm and plan is PREFILL_PLAN and hidden <= WHOLE_ROWS_MAX:
        width = triton.next_power_of_2(hidden)
        plan = replace(PREFILL_PLAN, collapse_tokens=1, collapse_chunk=width, collapse_k=width)
        if with_post:
            plan = replace(plan, fuse_post=True, block_k=POST_FUSED_BLOCK_K)
    return plan


class Partials(NamedTuple):
    """The projection's partial logits (rows 0-23) and sums of squares (row `SUMSQ_ROW`) of each
    (split, token), at `data + split·split_stride + token·token_stride + row·row_stride`
    (`SplitPlan.split_major` picks the order)."""

    data: torch.Tensor
    split_stride: int
    token_stride: int
    row_stride: int


class Mix(NamedTuple):
    """The pending post a projection mixes into the streams it reads (`PendingPost`: `out [T, D]`, fp32
    `post [T, 4]` and `comb [T, 4, 4]`) and where it stores the new streams (`[T, 4, D]`)."""

    out: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    new_streams: torch.Tensor


class Finish(NamedTuple):
    """What the finishing programs read and write besides the streams and partials: the projection's fp32
    `base [24]` and `scale [3]`, the outputs `post [T, 4]`, `comb [T, 4, 4]` and `block_input [T, D]`,
    the block's RMSNorm weight (read only with NORM) and `tables`, LOGIT_ROWS fp32 of scratch per
    (finishing program, token)."""

    base: torch.Tensor
    scale: torch.Tensor
    post: torch.Tensor
    comb: torch.Tensor
    block_input: torch.Tensor
    norm_weight: torch.Tensor
    tables: torch.Tensor


# ---------------------------------------------------------------- pieces


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
def _project(acc, x, fn, stream: tl.constexpr, d, dmask, D: tl.constexpr, SPLIT_FN: tl.constexpr, PRECISION):
    """acc [BM, 32] += x [BM, BK] @ fn's rows (24 real, 8 zero) at stream's dims d, transposed [BK, 32]."""
    r = tl.arange(0, LOGIT_ROWS)
    ptr = fn + r[None, :] * (4 * D) + stream * D + d[:, None]
    f = tl.load(ptr, mask=dmask[:, None] & (r < N_LOGITS)[None, :], other=0.0).to(tl.float32)
    high = f.to(x.dtype)
    acc = tl.dot(x, high, acc, input_precision=PRECISION)
    if SPLIT_FN:
        acc = tl.dot(x, (f - high.to(tl.float32)).to(x.dtype), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _normalized(a, b, c, d, eps):
    """(a, b, c, d) / (a + b + c + d + eps) as one division and four products (Triton's fp32 division
    is PTX div.full, within 2 ulp; with the product, within 3 ulp of the reference's IEEE divisions).
    The Sinkhorn loop runs 160 of these per token in one program's serial chain: the sm_90 build of
    the finishing kernel has 20 divisions where four a row had 68."""
    inverse = 1.0 / (a + b + c + d + eps)
    return a * inverse, b * inverse, c * inverse, d * inverse


@triton.jit
def _softmax_row(z, k: tl.constexpr, hc_eps):
    """Row k of comb: softmax over j of its logits (rows 8 + 4k + j of the program's table `z` in
    memory, [BT] pointers), plus hc_eps (as the reference)."""
    row = z + 8 + 4 * k
    z0, z1, z2, z3 = tl.load(row), tl.load(row + 1), tl.load(row + 2), tl.load(row + 3)
    top = tl.maximum(tl.maximum(z0, z1), tl.maximum(z2, z3))
    e0, e1, e2, e3 = tl.exp(z0 - top), tl.exp(z1 - top), tl.exp(z2 - top), tl.exp(z3 - top)
    inverse = 1.0 / (e0 + e1 + e2 + e3)
    return e0 * inverse + hc_eps, e1 * inverse + hc_eps, e2 * inverse + hc_eps, e3 * inverse + hc_eps


@triton.jit
def _store_comb(z, comb_out, rows, rmask, hc_eps, ITERS: tl.constexpr):
    """The Sinkhorn-normalised comb of the tokens `rows`; each token's 4 × 4 matrix lives in sixteen
    [BT] vectors, so the normalisations are plain arithmetic, no cross-thread reductions."""
    c00, c01, c02, c03 = _softmax_row(z, 0, hc_eps)
    c10, c11, c12, c13 = _softmax_row(z, 1, hc_eps)
    c20, c21, c22, c23 = _softmax_row(z, 2, hc_eps)
    c30, c31, c32, c33 = _softmax_row(z, 3, hc_eps)
    c00, c10, c20, c30 = _normalized(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _normalized(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _normalized(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _normalized(c03, c13, c23, c33, hc_eps)
    for _ in range(ITERS - 1):
        c00, c01, c02, c03 = _normalized(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _normalized(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _normalized(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _normalized(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _normalized(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _normalized(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _normalized(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _normalized(c03, c13, c23, c33, hc_eps)
    dst = comb_out + rows * 16
    _store_row(dst, 0, c00, c01, c02, c03, rmask)
    _store_row(dst, 1, c10, c11, c12, c13, rmask)
    _store_row(dst, 2, c20, c21, c22, c23, rmask)
    _store_row(dst, 3, c30, c31, c32, c33, rmask)


@triton.jit
def _store_row(dst, k: tl.constexpr, a, b, c, d, rmask):
    tl.store(dst + 4 * k, a, mask=rmask)
    tl.store(dst + 4 * k + 1, b, mask=rmask)
    tl.store(dst + 4 * k + 2, c, mask=rmask)
    tl.store(dst + 4 * k + 3, d, mask=rmask)


@triton.jit
def _collapse(streams, rows, rmask, pre0, pre1, pre2, pre3, d, D: tl.constexpr):
    """Block input Σ_i pre_i·stream_i (fp32 [BT, CK]) of the tokens `rows` at dims d, and its mask."""
    mask = rmask[:, None] & (d < D)[None, :]
    ptr = streams + rows[:, None].to(tl.int64) * (4 * D) + d[None, :]
    x = pre0[:, None] * tl.load(ptr, mask=mask, other=0.0).to(tl.float32)
    x += pre1[:, None] * tl.load(ptr + D, mask=mask, other=0.0).to(tl.float32)
    x += pre2[:, None] * tl.load(ptr + 2 * D, mask=mask, other=0.0).to(tl.float32)
    x += pre3[:, None] * tl.load(ptr + 3 * D, mask=mask, other=0.0).to(tl.float32)
    return x, mask


@triton.jit
def _rms_normed(x, mask, weight, d, eps, D: tl.constexpr, DTYPE: tl.constexpr):
    """RMSNorm of whole rows x (fp32 [BT, ≥ D], rounded to DTYPE as the block input is) with `weight`,
    in `ops.norm`'s roundings: fp32 statistics, the normalised row rounded to DTYPE, then scaled."""
    x = x.to(DTYPE).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / D + eps)
    w = tl.load(weight + d, mask=d < D, other=0.0).to(tl.float32)
    return tl.where(mask, (x * inv[:, None]).to(DTYPE).to(tl.float32) * w[None, :], 0.0)


# ---------------------------------------------------------------- kernels


@triton.jit(do_not_specialize=["M"])  # one compile serves every token count
def _split_project_kernel(
    streams, fn, partials, mix, M,
    D: tl.constexpr, SPLIT: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr, SPLIT_FN: tl.constexpr,
    PRECISION: tl.constexpr, POST: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Partial logits and sum of squares of tokens `BM·pid(1) + [0, BM)` over dims `SPLIT·pid(0) +
    [0, SPLIT)` of every stream, stored to `partials` (`Partials`). With POST the streams projected are
    the new ones, post·out + combᵀ·streams (`mix`, the previous block's pending post, as `_post_kernel`
    mixes them), which this program also stores to `mix.new_streams` at its tokens and dims: no other
    projection program reads them."""
    enter(PDL)
    split = tl.program_id(0)
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    rmask = rows < M
    dtype = streams.dtype.element_ty
    if POST:
        w0, w1, w2, w3 = _mix_weights(mix.post + rows * 4, mix.comb + rows * 16, rmask, dtype)
    acc = tl.zeros((BM, LOGIT_ROWS), tl.float32)  # tokens as the dot's rows: wgmma from 64 tokens
    squares = tl.zeros((BM,), tl.float32)
    for step in range(SPLIT // BK):
        d = split * SPLIT + step * BK + tl.arange(0, BK)
        dmask = d < D
        mask = rmask[:, None] & dmask[None, :]
        ptr = rows[:, None].to(tl.int64) * (4 * D) + d[None, :]
        x0 = tl.load(streams + ptr, mask=mask, other=0.0)
        x1 = tl.load(streams + ptr + D, mask=mask, other=0.0)
        x2 = tl.load(streams + ptr + 2 * D, mask=mask, other=0.0)
        x3 = tl.load(streams + ptr + 3 * D, mask=mask, other=0.0)
        if POST:
            o = tl.load(mix.out + rows[:, None].to(tl.int64) * D + d[None, :], mask=mask, other=0.0)
            o, s0, s1, s2, s3 = (
                o.to(tl.float32),
                x0.to(tl.float32),
                x1.to(tl.float32),
                x2.to(tl.float32),
                x3.to(tl.float32),
            )
            x0 = _expand(o, s0, s1, s2, s3, w0, dtype)
            x1 = _expand(o, s0, s1, s2, s3, w1, dtype)
            x2 = _expand(o, s0, s1, s2, s3, w2, dtype)
            x3 = _expand(o, s0, s1, s2, s3, w3, dtype)
            tl.store(mix.new_streams + ptr, x0, mask=mask)
            tl.store(mix.new_streams + ptr + D, x1, mask=mask)
            tl.store(mix.new_streams + ptr + 2 * D, x2, mask=mask)
            tl.store(mix.new_streams + ptr + 3 * D, x3, mask=mask)
        acc = _project(acc, x0, fn, 0, d, dmask, D, SPLIT_FN, PRECISION)
        acc = _project(acc, x1, fn, 1, d, dmask, D, SPLIT_FN, PRECISION)
        acc = _project(acc, x2, fn, 2, d, dmask, D, SPLIT_FN, PRECISION)
        acc = _project(acc, x3, fn, 3, d, dmask, D, SPLIT_FN, PRECISION)
        f0, f1, f2, f3 = x0.to(tl.float32), x1.to(tl.float32), x2.to(tl.float32), x3.to(tl.float32)
        squares += tl.sum(f0 * f0 + f1 * f1 + f2 * f2 + f3 * f3, axis=1)
    r = tl.arange(0, LOGIT_ROWS)
    acc += tl.where(r[None, :] == SUMSQ_ROW, squares[:, None], 0.0)
    ptr = (
        partials.data
        + split * partials.split_stride
        + rows[:, None].to(tl.int64) * partials.token_stride
        + r[None, :] * partials.row_stride
    )
    tl.store(ptr, acc, mask=rmask[:, None] & (r <= SUMSQ_ROW)[None, :])


@triton.jit(do_not_specialize=["M"])
def _finish_collapse_kernel(
    streams, partials, finish, M, rms_eps, hc_eps, norm_eps,
    D: tl.constexpr, NS: tl.constexpr, SS: tl.constexpr, BT: tl.constexpr, CHUNK: tl.constexpr,
    CK: tl.constexpr, ITERS: tl.constexpr, NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Tokens `BT·pid(1) + [0, BT)`: sums their partials (every program in the same order, so all derive
    the same bits), then collapses dims `CHUNK·pid(0) + [0, CHUNK)` into `finish.block_input`, or, as
    the last program of its tokens, computes their post and comb. With NORM (one step of CK ≥ D dims:
    whole rows) the collapsed rows are normalised with `finish.norm_weight` before the store. Each
    (program, token) has LOGIT_ROWS fp32 of `finish.tables`."""
    enter(PDL)
    chunk, token_program = tl.program_id(0), tl.program_id(1)
    rows = token_program * BT + tl.arange(0, BT)
    rmask = rows < M
    r = tl.arange(0, LOGIT_ROWS)
    weights_program = chunk == (D + CHUNK - 1) // CHUNK
    wanted = (r < 4) | (r == SUMSQ_ROW) | ((r < SUMSQ_ROW) & weights_program)  # collapses need pre only
    # issued first, so their latency hides behind the partials'
    base_row = tl.load(finish.base + r, mask=r < N_LOGITS, other=0.0)
    scale_row = tl.load(finish.scale + (r >= 4).to(tl.int32) + (r >= 8).to(tl.int32))  # pre | post | comb
    row_ptr = (
        partials.data
        + rows[None, :, None].to(tl.int64) * partials.token_stride
        + r[:, None, None] * partials.row_stride
    )
    sums = tl.zeros((LOGIT_ROWS, BT, SS), tl.float32)  # reduced after the loop: Triton 3.6 fails to
    for first in range(0, NS, SS):  # compile a reduction inside it whose result has several uses
        s = first + tl.arange(0, SS)
        mask = wanted[:, None, None] & rmask[None, :, None] & (s < NS)[None, None, :]
        split_ptr = row_ptr + s[None, None, :].to(tl.int64) * partials.split_stride
        sums += tl.load(split_ptr, mask=mask, other=0.0)
    logits = tl.sum(sums, axis=2)
    rstd = tl.rsqrt(tl.sum(tl.where(r[:, None] == SUMSQ_ROW, logits, 0.0), axis=0) / (4 * D) + rms_eps)
    z = logits * rstd[None, :] * scale_row[:, None] + base_row[:, None]
    if weights_program:
        post = 2 * tl.sigmoid(z)
        post_mask = ((r >= 4) & (r < 8))[:, None] & rmask[None, :]
        tl.store(finish.post + rows[None, :] * 4 + (r[:, None] - 4), post, mask=post_mask)
    else:
        z = tl.sigmoid(z) + hc_eps  # rows 0-3: pre
    # The rows are needed as [BT] vectors: reading them back from memory takes one barrier, while
    # extracting each from the register tile is a cross-warp reduction with barriers of its own.
    own = (chunk * tl.num_programs(1) + token_program) * BT + tl.arange(0, BT)
    table = finish.tables + own * LOGIT_ROWS
    tl.store(table[None, :] + r[:, None], z)
    tl.debug_barrier()
    if weights_program:
        _store_comb(table, finish.comb, rows, rmask, hc_eps, ITERS)
    else:
        pre0, pre1, pre2, pre3 = tl.load(table), tl.load(table + 1), tl.load(table + 2), tl.load(table + 3)
        dtype = streams.dtype.element_ty
        for step in range(CHUNK // CK):
            d = chunk * CHUNK + step * CK + tl.arange(0, CK)
            x, mask = _collapse(streams, rows, rmask, pre0, pre1, pre2, pre3, d, D)
            x = _rms_normed(x, mask, finish.norm_weight, d, norm_eps, D, dtype) if NORM else x.to(dtype)
            out_ptr = finish.block_input + rows[:, None].to(tl.int64) * D + d[None, :]
            tl.store(out_ptr, x.to(finish.block_input.dtype.element_ty), mask=mask)


@triton.jit
def _posted(
    out, streams, post, comb, M, index, D: tl.constexpr, BM: tl.constexpr, BK: tl.constexpr,
    INDEXED: tl.constexpr,
):  # fmt: skip
    """This program's result rows `tile` and dims `d` (`BM·pid(0)`, `BK·pid(1)` on), their mask, and the
    four new streams post·out + combᵀ·streams there, each rounded to the streams' dtype: of the tokens
    `index[tile]` when INDEXED, else of the tokens `tile`."""
    tile = tl.program_id(0) * BM + tl.arange(0, BM)
    d = tl.program_id(1) * BK + tl.arange(0, BK)
    rmask = tile < M
    rows = tl.load(index + tile, mask=rmask, other=0).to(tl.int64) if INDEXED else tile
    mask = rmask[:, None] & (d < D)[None, :]
    ptr = rows[:, None].to(tl.int64) * (4 * D) + d[None, :]
    o = tl.load(out + rows[:, None].to(tl.int64) * D + d[None, :], mask=mask, other=0.0).to(tl.float32)
    s0 = tl.load(streams + ptr, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(streams + ptr + D, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(streams + ptr + 2 * D, mask=mask, other=0.0).to(tl.float32)
    s3 = tl.load(streams + ptr + 3 * D, mask=mask, other=0.0).to(tl.float32)
    dtype = streams.dtype.element_ty
    w0, w1, w2, w3 = _mix_weights(post + rows * 4, comb + rows * 16, rmask, dtype)
    n0 = _expand(o, s0, s1, s2, s3, w0, dtype)
    n1 = _expand(o, s0, s1, s2, s3, w1, dtype)
    n2 = _expand(o, s0, s1, s2, s3, w2, dtype)
    n3 = _expand(o, s0, s1, s2, s3, w3, dtype)
    return tile, d, mask, n0, n1, n2, n3


@triton.jit(do_not_specialize=["M"])
def _post_kernel(
    out,
    streams,
    post,
    comb,
    new_streams,
    M,
    index,
    D: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    INDEXED: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    rows, d, mask, n0, n1, n2, n3 = _posted(out, streams, post, comb, M, index, D, BM, BK, INDEXED)
    ptr = new_streams + rows[:, None].to(tl.int64) * (4 * D) + d[None, :]
    tl.store(ptr, n0, mask=mask)
    tl.store(ptr + D, n1, mask=mask)
    tl.store(ptr + 2 * D, n2, mask=mask)
    tl.store(ptr + 3 * D, n3, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _post_mean_kernel(
    out,
    streams,
    post,
    comb,
    mean,
    M,
    index,
    D: tl.constexpr,
    BM: tl.constexpr,
    BK: tl.constexpr,
    INDEXED: tl.constexpr,
    PDL: tl.constexpr,
):
    """`_post_kernel`'s new streams, as it stores them, summed in fp32 in stream order and divided by 4
    (torch's mean of the stored streams), one row per token (per `index` entry when INDEXED)."""
    enter(PDL)
    rows, d, mask, n0, n1, n2, n3 = _posted(out, streams, post, comb, M, index, D, BM, BK, INDEXED)
    total = n0.to(tl.float32) + n1.to(tl.float32) + n2.to(tl.float32) + n3.to(tl.float32)
    tl.store(mean + rows[:, None].to(tl.int64) * D + d[None, :], (total / 4).to(n0.dtype), mask=mask)


# ---------------------------------------------------------------- launchers


_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _check_streams(streams: torch.Tensor) -> tuple[int, int]:
    if streams.dim() != 3 or streams.shape[1] != HC_MULT:
        raise ValueError(f"streams must be [tokens, {HC_MULT}, hidden], got {tuple(streams.shape)}")
    if streams.dtype not in _DTYPES:
        raise ValueError(f"streams must be bf16, fp16 or fp32, got {streams.dtype}")
    return streams.shape[0], streams.shape[2]


def _check(name: str, t: torch.Tensor, shape: tuple[int, ...], like: torch.Tensor) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device}, the streams on {like.device}")


def _check_plan(plan: SplitPlan) -> None:
    if not isinstance(plan, SplitPlan):
        raise TypeError(f"plan must be a SplitPlan, got {type(plan).__name__}")
    least_powers = {
        "split": 16,
        "block_m": 16,
        "block_k": 16,
        "collapse_tokens": 1,
        "collapse_chunk": 16,
        "collapse_k": 16,
        "num_warps": 1,
        "finish_warps": 1,
    }
    for field, least in least_powers.items():
        value = getattr(plan, field)
        if value < least or value & (value - 1):
            raise ValueError(f"plan.{field} must be a power of two ≥ {least}, got {value}")
    for inner, outer in (("block_k", "split"), ("collapse_k", "collapse_chunk")):
        if getattr(plan, inner) > getattr(plan, outer):
            raise ValueError(
                f"plan.{inner} ({getattr(plan, inner)}) exceeds plan.{outer} ({getattr(plan, outer)})"
            )


def norm_fusable(plan: SplitPlan, hidden: int) -> bool:
    """Whether `plan`'s finishing programs hold whole rows of `hidden` dims (one collapse step), so that
    they can apply the block's RMSNorm before storing the block input."""
    return plan.collapse_k >= hidden


def _check_norm(norm: BlockNorm, hidden: int, streams: torch.Tensor) -> None:
    _check("norm.weight", norm.weight, (hidden,), streams)
    if not norm.weight.is_contiguous() or norm.weight.dtype not in _DTYPES:
        raise ValueError(
            f"norm.weight must be a contiguous bf16, fp16 or fp32 vector, got {norm.weight.dtype}"
        )


def _check_pending(pending: PendingPost, tokens: int, hidden: int, streams: torch.Tensor) -> None:
    _check("out", pending.out, (tokens, hidden), streams)
    _check("post", pending.post, (tokens, HC_MULT), streams)
    _check("comb", pending.comb, (tokens, HC_MULT, HC_MULT), streams)
    if pending.out.dtype != streams.dtype:
        raise ValueError(f"out is {pending.out.dtype}, the streams {streams.dtype}")


def mhc_enter(
    streams: torch.Tensor,
    hc: HCParams,
    pending: PendingPost | None = None,
    norm: BlockNorm | None = None,
    plan: SplitPlan | None = None,
) -> BlockEntry:
    """See `reference.mhc_enter`. Two launches where `plan.fuse_post` and `norm_fusable` hold (the
    decode plan): the first mixes the pending post into the streams it projects, the second normalises
    the block input it collapses; otherwise a post launch before and an RMSNorm launch after them."""
    tokens, hidden = _check_streams(streams)
    n_proj = (2 + HC_MULT) * HC_MULT
    _check("fn", hc.fn, (n_proj, HC_MULT * hidden), streams)
    _check("base", hc.base, (n_proj,), streams)
    _check("scale", hc.scale, (3,), streams)
    if hc.sinkhorn_iters < 1:
        raise ValueError(f"sinkhorn_iters must be ≥ 1, got {hc.sinkhorn_iters}")
    plan = plan or entry_plan(tokens, hidden, norm is not None, pending is not None)
    _check_plan(plan)
    if pending is not None:
        _check_pending(pending, tokens, hidden, streams)
        if not plan.fuse_post:
            streams, pending = mhc_post(pending.out, streams, pending.post, pending.comb), None
    fused_norm = norm if norm is not None and norm_fusable(plan, hidden) else None
    if fused_norm is not None:
        _check_norm(fused_norm, hidden, streams)
    streams, fn = streams.contiguous(), hc.fn.contiguous()
    device, dtype = streams.device, streams.dtype
    new_streams = streams if pending is None else torch.empty_like(streams)
    post = torch.empty(tokens, HC_MULT, dtype=torch.float32, device=device)
    comb = torch.empty(tokens, HC_MULT, HC_MULT, dtype=torch.float32, device=device)
    input_dtype = dtype if fused_norm is None else torch.result_type(fused_norm.weight, streams)
    block_input = torch.empty(tokens, hidden, dtype=input_dtype, device=device)
    if tokens == 0:
        return BlockEntry(new_streams, post, comb, block_input)
    base, scale = hc.base.float().contiguous(), hc.scale.float().contiguous()
    n_splits = triton.cdiv(hidden, plan.split)
    if plan.split_major:
        data = torch.empty(n_splits, tokens, LOGIT_ROWS.value, dtype=torch.float32, device=device)
        partials = Partials(data, *data.stride())
    else:
        data = torch.empty(tokens, LOGIT_ROWS.value, n_splits, dtype=torch.float32, device=device)
        partials = Partials(data, 1, data.stride(0), data.stride(1))
    # where no post is pending, the projection reads no mix operand: the streams stand in for them
    mix = Mix(*((streams,) * 3 if pending is None else _mix_operands(pending)), new_streams)
    dependent = plan.dependent_launch and dependent_launches(device)
    _split_project_kernel[(n_splits, triton.cdiv(tokens, plan.block_m))](
        streams, fn, partials, mix, tokens,
        D=hidden, SPLIT=plan.split, BM=plan.block_m, BK=plan.block_k,
        SPLIT_FN=fn.element_size() > streams.element_size(),
        PRECISION="ieee" if dtype == torch.float32 else "tf32", POST=pending is not None,
        PDL=dependent, launch_pdl=dependent, num_warps=plan.num_warps,
    )  # fmt: skip
    # powers of two both: the table tile holds at most TABLE_ELEMENTS
    splits_per_step = min(
        triton.next_power_of_2(n_splits), max(1, TABLE_ELEMENTS // (LOGIT_ROWS.value * plan.collapse_tokens))
    )
    # one program per chunk and one for post and comb
    grid = (triton.cdiv(hidden, plan.collapse_chunk) + 1, triton.cdiv(tokens, plan.collapse_tokens))
    table_rows = grid[0] * grid[1] * plan.collapse_tokens  # one table per program and token
    tables = torch.empty(table_rows, LOGIT_ROWS.value, dtype=torch.float32, device=device)
    norm_weight, norm_eps = (base, 0.0) if fused_norm is None else (fused_norm.weight, fused_norm.eps)
    _finish_collapse_kernel[grid](
        new_streams, partials, Finish(base, scale, post, comb, block_input, norm_weight, tables), tokens,
        hc.rms_eps, hc.hc_eps, norm_eps,
        D=hidden, NS=n_splits, SS=splits_per_step,
        BT=plan.collapse_tokens, CHUNK=plan.collapse_chunk, CK=plan.collapse_k, ITERS=hc.sinkhorn_iters,
        NORM=fused_norm is not None, PDL=dependent, launch_pdl=dependent, num_warps=plan.finish_warps,
    )  # fmt: skip
    if norm is not None and fused_norm is None:
        block_input = rms_norm(block_input, norm.weight, norm.eps)
    return BlockEntry(new_streams, post, comb, block_input)


def _mix_operands(pending: PendingPost) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(out, post, comb) as the kernels read them: contiguous, the weights fp32."""
    return pending.out.contiguous(), pending.post.float().contiguous(), pending.comb.float().contiguous()


def mhc_pre(
    streams: torch.Tensor, hc: HCParams, plan: SplitPlan | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """See `reference.mhc_pre`: (post [T, 4], comb [T, 4, 4], block input [T, D]), two launches."""
    _, post, comb, block_input = mhc_enter(streams, hc, plan=plan)
    return post, comb, block_input


def mhc_post(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    block_m: int = 16,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """See `reference.mhc_post`: new streams post ⊗ out + combᵀ @ streams `[T, 4, D]`. The default
    tiles measured fastest on the H200: 64 dims below `PREFILL_PLAN_FROM` tokens (M = 1 / 16 / 64: 1.65
    / 1.86 / 2.32 us; 128 dims 1.85 / 2.15 / 2.49), else 128 (M = 13312: 251 us; block_m=32,
    block_k=64: 284 us)."""
    new_streams = torch.empty(streams.shape, dtype=streams.dtype, device=streams.device)
    _launch_post(
        _post_kernel, PendingPost(out, post, comb), streams, new_streams, block_m, block_k, num_warps
    )
    return new_streams


def mhc_post_mean(
    out: torch.Tensor,
    streams: torch.Tensor,
    post: torch.Tensor,
    comb: torch.Tensor,
    rows: torch.Tensor | None = None,
    block_m: int = 16,
    block_k: int | None = None,
    num_warps: int = 4,
) -> torch.Tensor:
    """See `reference.mhc_post_mean`: the new streams' mean `[T, D]` (of the tokens `rows` alone,
    `[R, D]`, read through the index) in one launch, `mhc_post`'s tiles (equal to the reference where
    the fp32 sum of the four rounded streams is exact: always unless their magnitudes differ by more
    than 2^16 in bf16)."""
    count = streams.shape[0] if rows is None else rows.shape[0]
    mean = torch.empty(count, streams.shape[2], dtype=streams.dtype, device=streams.device)
    pending = PendingPost(out, post, comb)
    _launch_post(_post_mean_kernel, pending, streams, mean, block_m, block_k, num_warps, rows)
    return mean


def _launch_post(
    kernel, pending: PendingPost, streams: torch.Tensor, result: torch.Tensor, block_m, block_k, num_warps,
    rows: torch.Tensor | None = None,
) -> None:  # fmt: skip
    """`kernel` (`_post_kernel` or `_post_mean_kernel`) over `streams` and `pending`, into `result`: a
    row of it per token, or per entry of `rows` (token indices)."""
    tokens, hidden = _check_streams(streams)
    count = tokens if rows is None else rows.shape[0]
    if block_k is None:
        block_k = 64 if count < PREFILL_PLAN_FROM else 128
    _check_pending(pending, tokens, hidden, streams)
    if count == 0:
        return
    grid = (triton.cdiv(count, block_m), triton.cdiv(hidden, block_k))
    out, post, comb = _mix_operands(pending)
    dependent = dependent_launches(streams.device)
    kernel[grid](
        out, streams.contiguous(), post, comb, result, count, rows if rows is not None else post,
        D=hidden, BM=block_m, BK=block_k, INDEXED=rows is not None, PDL=dependent, launch_pdl=dependent,
        num_warps=num_warps,
    )  # fmt: skip
