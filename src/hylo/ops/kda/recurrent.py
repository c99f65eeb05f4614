"""Triton KDA step kernels over the slot pool: conv window steps, decode, one-launch verify, commit.

The sequential kernel: each program owns one (sequence, head, value tile) of S (`[d_k, BV]` fp32, kept
in registers) and walks the sequence's T tokens,

    S ← diag(e^{g_t}) S;  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ q_t.

It serves decode (T = 1, S stored back in place), verify with the state after every step saved (the
per-step-state alternative) and, for gates other than the safe one or T > 16, verify and replay-commit.

With the safe gate and T ≤ 16 the block kernels take over. Verify treats the T tokens as one chunk
of the chunked form (`_block_verify_kernel`): a tensor-core product of the stacked keys and queries
against S, a T×T triangular solve, no step-to-step dependency, S only read. It also leaves, per token,
the values u it adds to the state and the gate factors, from which any accepted prefix of n tokens
commits as n rank-1 updates of S (`_block_commit_kernel`): that launch reads and writes S once, like
decode, and advances the conv window too.

The conv kernel computes SiLU(conv) for T tokens continuing from the slot window and, for decode and
the sequential commit, rewrites the window with the last K-1 consumed inputs (its first n[b] tokens).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.gemm import linear
from hylo.ops.kda import low_rank
from hylo.ops.kda.low_rank import long_row_dots, low_rank_rows
from hylo.ops.kda.operands import DecodeConv, RawQKV, ScaledWeight, SlotPool, TokenRows, WindowPool
from hylo.ops.kda.reference import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, VerifyCache
from hylo.ops.kda.rmsnorm import WindowStep, gated_rms_norm

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"
# (sequence, head) pairs of a decode step up to which its LowRank inputs are multiplied in its two launches:
# each program recomputes its head's rows, which paid at B x H = 64 on the H200 (B = 1 at 64 heads: 0.87x
# the projections then the step with FP8 weights, 0.97x bf16; B = 8 at 8 heads 0.85x / 0.91x) and lost at
# 512 (B = 8 at 64 heads: 1.43x / 1.24x), RESULTS S28-2
LOW_RANK_MAX_HEAD_ROWS = 64


@dataclass
class ReplayCache(VerifyCache):
    """A block verify's cache: `replay [3, B, T, H, d]` fp32 holds per token k 2^{m−G}, 2^{G−m} and the
    new values u/|k| (see `_block_verify_kernel`), from which any accepted prefix commits without
    recomputation; the conv output is not kept."""

    replay: torch.Tensor | None = None


@triton.jit
def _window_after(x, x_sb, x_st, win, win_stride, bi, n, c, ch, W: tl.constexpr, WP: tl.constexpr):
    """The window columns `ch` once n tokens (columns `c` of x) are consumed: the last W-1 inputs."""
    r = tl.arange(0, WP)
    j = n - (W - 1) + r
    live = r < W - 1
    xval = tl.load(
        x + bi.to(tl.int64) * x_sb + j[:, None] * x_st + c[None, :],
        mask=(live & (j >= 0))[:, None],
        other=0.0,
    )
    wval = tl.load(
        win + (W - 1 + j)[:, None] * win_stride + ch[None, :], mask=(live & (j < 0))[:, None], other=0.0
    )
    return xval.to(win.dtype.element_ty) + wval


@triton.jit
def _conv_kernel(
    raw, windows, slot_ids, weight, y, n_keep,
    T: tl.constexpr, TP: tl.constexpr, HD: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    BC: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_WIN: tl.constexpr, PER_SEQ: tl.constexpr,
):  # fmt: skip
    """BC channels of the packed q|k|v space for one sequence: y = SiLU(conv) of its T tokens (each tap
    one [TP, BC] load from the inputs or the window), then the window rewritten for these channels. `raw`
    is the `RawQKV`, `windows` the `WindowPool`, y `TokenRows`."""
    bi, cb = tl.program_id(0), tl.program_id(1)
    part = cb // (HD // BC)  # 0: q, 1: k, 2: v
    x = tl.where(part == 0, raw.q, tl.where(part == 1, raw.k, raw.v))
    x_sb, x_st, win_stride = raw.seq_stride, raw.token_stride, windows.row_stride
    c = (cb % (HD // BC)) * BC + tl.arange(0, BC)  # columns of x
    ch = part * HD + c  # channels of the window, the weight and y
    win = windows.pool + tl.load(slot_ids + bi).to(tl.int64) * windows.slot_stride
    if WRITE_Y:
        r = tl.arange(0, TP)
        live = r < T
        acc = tl.zeros([TP, BC], dtype=tl.float32)
        for i in tl.static_range(W):
            j = r + i - (W - 1)  # input row of tap i; negative rows are in the window
            z = tl.load(
                x + bi.to(tl.int64) * x_sb + j[:, None] * x_st + c[None, :],
                mask=(live & (j >= 0))[:, None],
                other=0.0,
            ).to(tl.float32)
            z += tl.load(
                win + (r + i)[:, None] * win_stride + ch[None, :], mask=(live & (j < 0))[:, None], other=0.0
            ).to(tl.float32)
            acc += z * tl.load(weight + ch * W + i)[None, :]
        p_y = y.data + bi.to(tl.int64) * y.seq_stride + r[:, None] * y.token_stride + ch[None, :]
        tl.store(p_y, (acc * tl.sigmoid(acc)).to(y.data.dtype.element_ty), mask=live[:, None])
    if WRITE_WIN:
        n = T
        if PER_SEQ:
            n = tl.load(n_keep + bi)
        new = _window_after(x, x_sb, x_st, win, win_stride, bi, n, c, ch, W, WP)
        tl.debug_barrier()  # every thread has read the old window before any row is overwritten
        rows = tl.arange(0, WP)
        tl.store(win + rows[:, None] * win_stride + ch[None, :], new, mask=(rows < W - 1)[:, None])


@triton.jit
def _conv_token(x, win, win_stride, weight, c, ch, W: tl.constexpr):
    """SiLU(causal conv) of a sequence's one new token at columns `c` of its input row `x`, continuing
    from its window `win` (channels `ch` of the window and `weight`): fp32, rounded through x's dtype
    as the conv kernel stores it, taps summed in that kernel's order."""
    acc = tl.zeros(c.shape, dtype=tl.float32)
    for i in tl.static_range(W - 1):
        acc += tl.load(win + i * win_stride + ch).to(tl.float32) * tl.load(weight + ch * W + i)
    acc += tl.load(x + c).to(tl.float32) * tl.load(weight + ch * W + W - 1)
    return (acc * tl.sigmoid(acc)).to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _recurrent_kernel(
    qkv, f, b, dt_bias, a_log, state, n_steps, o, steps, scale, lower_bound, conv, f_w, b_w,
    T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    USE_LB: tl.constexpr, WRITE_O: tl.constexpr, STORE_STATE: tl.constexpr, PER_SEQ: tl.constexpr,
    STEP_STATES: tl.constexpr, CONV: tl.constexpr, W: tl.constexpr, F_RANK: tl.constexpr,
    F_STEP: tl.constexpr, F_FP8: tl.constexpr, B_RANK: tl.constexpr, B_STEP: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One (sequence, head, value tile) over its T tokens (module docstring); qkv, f, b and o are
    `TokenRows`, `state` the `SlotPool`. With CONV (decode, T = 1) `qkv` is the raw q row (k and v rows
    in `conv`, a `DecodeConv`, same strides) and the conv runs here from the slot's window, which is only
    read: whoever launches this advances it afterwards. With F_RANK > 0 (decode) `f` is the low-rank
    factor a `[B, F_RANK]` of the gate, whose head rows this program computes with the projection `f_w`
    (a `ScaledWeight`; `low_rank.low_rank_rows`); with B_RANK > 0 (decode) `b` is the layer input `[B,
    B_RANK]` whose dot product with row h of `b_w [H, B_RANK]` is the head's β logit
    (`low_rank.long_row_dots`)."""
    enter(PDL)
    bi, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bi64 = bi.to(tl.int64)
    slot = tl.load(state.slot_ids + bi).to(tl.int64)
    rk = tl.arange(0, D)
    rv = iv * BV + tl.arange(0, BV)
    rt = tl.arange(0, TP)
    p_s = state.pool + slot * state.slot_stride + h * D * D + rk[:, None] * D + rv[None, :]
    s = tl.load(p_s)

    # every token's inputs up front: the steps below then only compute
    live = rt < T
    if PER_SEQ:
        live = rt < tl.load(n_steps + bi)
    if CONV:
        win = conv.windows.pool + slot * conv.windows.slot_stride
        rows = bi64 * qkv.seq_stride
        q = _conv_token(
            qkv.data + rows, win, conv.windows.row_stride, conv.weight, h * D + rk, h * D + rk, W
        )[None, :]
        k = _conv_token(
            conv.xk + rows, win, conv.windows.row_stride, conv.weight, h * D + rk, (H + h) * D + rk, W
        )[None, :]
        v = _conv_token(
            conv.xv + rows, win, conv.windows.row_stride, conv.weight, h * D + rv, (2 * H + h) * D + rv, W
        )[None, :]
    else:
        row = qkv.data + bi64 * qkv.seq_stride + rt[:, None] * qkv.token_stride + h * D
        q = tl.load(row + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        k = tl.load(row + H * D + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        v = tl.load(row + 2 * H * D + rv[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    if F_RANK > 0:
        x = low_rank_rows(
            f.data + bi64 * f.seq_stride + rt * 0, f_w.weight, f_w.scale, f_w.scale_stride,
            h * D + rk[None, :] + rt[:, None] * 0,
            live, F_RANK, F_STEP, F_FP8,
        )  # fmt: skip
    else:
        x = tl.load(
            f.data + bi64 * f.seq_stride + rt[:, None] * f.token_stride + h * D + rk[None, :],
            mask=live[:, None],
            other=0.0,
        )
    x = x.to(tl.float32) + tl.load(dt_bias + h * D + rk).to(tl.float32)[None, :]
    rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    if USE_LB:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.where(live[:, None], tl.exp(g), 1.0)  # a dead step leaves S exactly as it is
    if B_RANK > 0:
        beta = long_row_dots(b.data + bi64 * b.seq_stride + rt * 0, b_w, h + rt * 0, live, B_RANK, B_STEP)
    else:
        beta = tl.load(b.data + bi64 * b.seq_stride + rt * b.token_stride + h, mask=live, other=0.0).to(
            tl.float32
        )
    beta = tl.where(live, tl.sigmoid(beta), 0.0)
    k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    q = q * (scale / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None]
    out = tl.zeros([TP, BV], dtype=tl.float32)

    for t in tl.static_range(T):
        pick = rt[:, None] == t
        k_t = tl.sum(tl.where(pick, k, 0.0), 0)
        s = s * tl.sum(tl.where(pick, decay, 0.0), 0)[:, None]
        upd = tl.sum(tl.where(pick, v, 0.0), 0) - tl.sum(s * k_t[:, None], 0)
        upd = upd * tl.sum(tl.where(rt == t, beta, 0.0), 0)
        s = s + k_t[:, None] * upd[None, :]
        if WRITE_O:
            o_t = tl.sum(s * tl.sum(tl.where(pick, q, 0.0), 0)[:, None], 0)
            out = tl.where(pick, o_t[None, :], out)
        if STEP_STATES:
            tl.store(steps + ((bi64 * T + t) * H + h) * D * D + rk[:, None] * D + rv[None, :], s)
    if WRITE_O:
        p_o = o.data + bi64 * o.seq_stride + rt[:, None] * o.token_stride + h * D + rv[None, :]
        tl.store(p_o, out.to(o.data.dtype.element_ty), mask=(rt < T)[:, None])
    if STORE_STATE:
        tl.store(p_s, s)


@triton.jit
def _unit_lower_inverse(nil, TP: tl.constexpr, FACTORS: tl.constexpr, PREC: tl.constexpr):
    """(I - N)⁻¹ = (I + N)(I + N²)(I + N⁴)… for a strictly lower TP×TP N whose live block is at most
    2^FACTORS rows (so the series ends): log-depth tensor-core products instead of a row-by-row solve."""
    rt = tl.arange(0, TP)
    inv = tl.where(rt[:, None] == rt[None, :], 1.0, 0.0) + nil
    power = nil
    for _ in tl.static_range(FACTORS - 1):
        power = tl.dot(power, power, input_precision=PREC)
        inv += tl.dot(inv, power, input_precision=PREC)
    return inv


@triton.jit
def _stack_twice(x):
    """[R, C] → [2R, C]: x on top of itself."""
    both = tl.permute(tl.join(x, x), (2, 0, 1))
    return tl.reshape(both, (2 * x.shape[0], x.shape[1]))


@triton.jit
def _block_verify_kernel(
    qkv, f, b, dt_bias, a_log, state, o, replay, part_stride, scale, lower_bound, anchor,
    T: tl.constexpr, TP: tl.constexpr, FACTORS: tl.constexpr, H: tl.constexpr, D: tl.constexpr,
    DC: tl.constexpr, BV: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """The T ≤ 16 tokens of one request as one chunk of the delta rule (safe gate), for one head and one
    BV-wide slice of its state S [D, D], which is only read. With G the in-block cumulative log2 gates,
    k̂ and q̂ the normalised keys and queries, Tβ = (I + L)⁻¹ diag(β), L[c, i] = β_c k̂_c·(2^{G_c−G_i} k̂_i)
    for c > i:
        u = Tβ (v − (k̂ 2^G) S)   (the values each token adds to the state),
        o = (q̂ 2^G) S + A u,     A[c, j] = q̂_c·(2^{G_c−G_j} k̂_j) for c ≥ j.
    Any prefix of n tokens then gives S_n = 2^{G_n} S + Σ_{i<n} (k_i 2^{G_n−G_i}) (u_i/|k_i|)ᵀ, so the
    commit kernel only needs k 2^{m−G}, 2^{G−m} (m the anchor) and u/|k|, which go to `replay`.
    Keys fill rows [0, TP) and queries rows [TP, 2·TP) of one tile: a single product against kᵀ gives
    L and A, a single product against S both S-terms. The channels are walked DC at a time, the norms
    applied at the end. qkv, f, b and o are `TokenRows`, `state` the `SlotPool`."""
    bi, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bi64 = bi.to(tl.int64)
    rt = tl.arange(0, TP)
    rr = tl.arange(0, 2 * TP)
    rc = tl.arange(0, DC)
    rv = iv * BV + tl.arange(0, BV)
    tok = rr % TP
    is_q = rr >= TP
    live = tok < T
    p_s = state.pool + tl.load(state.slot_ids + bi).to(tl.int64) * state.slot_stride + h * D * D + rv[None, :]
    row = qkv.data + bi64 * qkv.seq_stride + tok[:, None] * qkv.token_stride + h * D
    p_kq = row + tl.where(is_q, 0, H * D)[:, None]
    p_f = f.data + bi64 * f.seq_stride + rt[:, None] * f.token_stride + h * D
    p_r = replay + bi64 * T * H * D + tok[:, None] * H * D + h * D
    rate = tl.exp(tl.load(a_log + h)) * -1.4426950408889634  # σ(z) = 1 / (1 + 2^{-z·log2 e})
    lb2 = lower_bound * 1.4426950408889634  # the gates in log2 units
    gram = tl.zeros([2 * TP, 2 * TP], dtype=tl.float32)
    proj = tl.zeros([2 * TP, BV], dtype=tl.float32)
    for c0 in tl.static_range(0, D, DC):
        x = tl.load(p_f + c0 + rc[None, :], mask=(rt < T)[:, None], other=0.0).to(tl.float32)
        x += tl.load(dt_bias + h * D + c0 + rc)[None, :]
        g = tl.where((rt < T)[:, None], tl.math.fdiv(lb2, 1.0 + tl.exp2(rate * x)), 0.0)
        gs = tl.cumsum(g, 0)
        # 2^{G-m} and 2^{m-G} stay within fp32 for |G| ≤ TP·|lb2| with the anchor m = lb2·TP/2;
        # keys and queries of a token share its gates: the [TP, DC] factors are stacked twice
        rise = _stack_twice(tl.exp2(gs - anchor))
        kq = tl.load(p_kq + c0 + rc[None, :], mask=live[:, None], other=0.0).to(tl.float32)
        kq_fall = kq * _stack_twice(tl.exp2(anchor - gs))
        kq_rise = kq * rise
        mine = (live & ~is_q)[:, None] & ((c0 + rc) // BV == iv)[None, :]  # this program's key channels
        tl.store(p_r + c0 + rc[None, :], kq_fall, mask=mine)
        tl.store(p_r + part_stride + c0 + rc[None, :], rise, mask=mine)
        gram = tl.dot(kq_rise, tl.trans(kq_fall), acc=gram, input_precision=PREC)
        proj = tl.dot(kq_rise, tl.load(p_s + (c0 + rc)[:, None] * D), acc=proj, input_precision=PREC)
    # the diagonal of the Gram tile is |k|² on key rows and |q|² on query rows
    sq = tl.sum(tl.where(rr[:, None] == rr[None, :], gram, 0.0), 1)
    inv_norm = tl.where(is_q, scale, 1.0) / tl.sqrt(sq + 1e-6)  # 1/|k| on key rows, scale/|q| on query rows
    gram = gram * inv_norm[:, None] * inv_norm[None, :]
    beta = tl.load(b.data + bi64 * b.seq_stride + tok * b.token_stride + h, mask=live & ~is_q, other=0.0)
    beta = beta.to(tl.float32)
    beta = tl.where(live & ~is_q, tl.sigmoid(beta), 0.0)
    keys = ~is_q[None, :]
    nil = tl.where(keys & ~is_q[:, None] & (tok[:, None] > tok[None, :]), -beta[:, None] * gram, 0.0)
    t_beta = _unit_lower_inverse(nil, 2 * TP, FACTORS, PREC) * beta[None, :]
    a_qk = tl.where(keys & is_q[:, None] & (tok[:, None] >= tok[None, :]), gram, 0.0)
    proj = proj * (inv_norm * tl.exp2(anchor))[:, None]  # k̂ 2^G S on key rows, q̂ 2^G S on query rows
    v = tl.load(row + 2 * H * D + rv[None, :], mask=(live & ~is_q)[:, None], other=0.0).to(tl.float32)
    u = tl.dot(t_beta, tl.where(is_q[:, None], 0.0, v - proj), input_precision=PREC)
    out = tl.where(is_q[:, None], proj, 0.0) + tl.dot(a_qk, u, input_precision=PREC)
    p_o = o.data + bi64 * o.seq_stride + tok[:, None] * o.token_stride + h * D + rv[None, :]
    tl.store(p_o, out.to(o.data.dtype.element_ty), mask=(live & is_q)[:, None])
    tl.store(p_r + 2 * part_stride + rv[None, :], u * inv_norm[:, None], mask=(live & ~is_q)[:, None])


@triton.jit
def _block_commit_kernel(
    replay, part_stride, state, n_steps, raw, windows, anchor,
    T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BK: tl.constexpr, W: tl.constexpr,
    WP: tl.constexpr, PREC: tl.constexpr,
):  # fmt: skip
    """Commit of the first n[b] ≤ T verified tokens from the verify kernel's `replay`: S ← 2^{G_n} S +
    Σ_{i<n} (k_i 2^{m−G_i})·2^{G_n−m} (u_i/|k_i|)ᵀ. Rows of S do not mix, so each program streams BK whole
    rows (contiguous, all value columns): every operand is one tile load issued up front, the n rank-1
    updates one [BK, TP] × [TP, D] product (tf32x3, fp32-accurate). One extra program per head advances
    its q, k, v conv windows, so that the state programs only stream (`state` the `SlotPool`, `raw` the
    verified tokens' `RawQKV`, `windows` the `WindowPool`)."""
    ik, bi, h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(n_steps + bi)
    slot = tl.load(state.slot_ids + bi).to(tl.int64)
    rv = tl.arange(0, D)
    if n > 0 and ik < D // BK:
        rk = ik * BK + tl.arange(0, BK)
        rt = tl.arange(0, TP)
        p_s = state.pool + slot * state.slot_stride + h * D * D + rk[:, None] * D + rv[None, :]
        s = tl.load(p_s)
        base = replay + bi.to(tl.int64) * T * H * D + h * D
        accepted = rt < n
        k_fall = tl.load(base + rt[None, :] * H * D + rk[:, None], mask=accepted[None, :], other=0.0)
        u = tl.load(
            base + 2 * part_stride + rt[:, None] * H * D + rv[None, :], mask=accepted[:, None], other=0.0
        )
        rise_n = tl.load(base + part_stride + (n - 1) * H * D + rk)  # 2^{G_n − m}
        s = s * (rise_n * tl.exp2(anchor))[:, None]
        s = tl.dot(k_fall * rise_n[:, None], u, acc=s, input_precision=PREC)
        tl.store(p_s, s)
    if n > 0 and ik == D // BK:
        c = h * D + rv
        win = windows.pool + slot * windows.slot_stride
        x_sb, x_st, win_stride = raw.seq_stride, raw.token_stride, windows.row_stride
        new_q = _window_after(raw.q, x_sb, x_st, win, win_stride, bi, n, c, c, W, WP)
        new_k = _window_after(raw.k, x_sb, x_st, win, win_stride, bi, n, c, H * D + c, W, WP)
        new_v = _window_after(raw.v, x_sb, x_st, win, win_stride, bi, n, c, 2 * H * D + c, W, WP)
        tl.debug_barrier()  # every thread has read the old window before any row is overwritten
        rows = tl.arange(0, WP)[:, None] * win_stride
        fresh = (tl.arange(0, WP) < W - 1)[:, None]
        tl.store(win + rows + c[None, :], new_q, mask=fresh)
        tl.store(win + rows + H * D + c[None, :], new_k, mask=fresh)
        tl.store(win + rows + 2 * H * D + c[None, :], new_v, mask=fresh)


@triton.jit
def _take_step_kernel(
    steps, T, state_pool, pool_stride, slot_ids, n_acc, H: tl.constexpr, DD: tl.constexpr, BLK: tl.constexpr
):
    bi, h, blk = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    n = tl.load(n_acc + bi)
    if n > 0:
        offs = blk * BLK + tl.arange(0, BLK)
        src = steps + ((bi.to(tl.int64) * T + n - 1) * H + h) * DD + offs
        slot = tl.load(slot_ids + bi).to(tl.int64)
        tl.store(state_pool + slot * pool_stride + h * DD + offs, tl.load(src))


def conv_steps(x: KDAInputs, conv_weight, slots: KDASlots, *, write_y=True, write_window=False, n_keep=None):
    """SiLU(causal conv) of `[B, T, H·d]` q|k|v of `x` continuing from the slot windows. Returns y
    `[B, T, 3·H·d]` (when `write_y`; `conv_weight` is read only then); with `write_window` the window
    advances by T tokens, or by `n_keep[b]`."""
    q, k, v = x.q, x.k, x.v
    conv_pool, slot_ids = slots.conv_pool, slots.slot_ids
    bsz, t, hd = q.shape
    assert q.stride() == k.stride() == v.stride() and q.stride(2) == 1
    y = torch.empty(bsz, t, 3 * hd, dtype=q.dtype, device=q.device) if write_y else q
    width = conv_pool.shape[1] + 1
    bc = min(128, triton.next_power_of_2(hd))
    assert hd % bc == 0
    tp = triton.next_power_of_2(t)
    _conv_kernel[(bsz, 3 * hd // bc)](
        RawQKV(q, k, v, q.stride(0), q.stride(1)),
        WindowPool.of(conv_pool), slot_ids,
        conv_weight if write_y else conv_pool, TokenRows.of(y),
        n_keep if n_keep is not None else slot_ids,
        T=t, TP=tp, HD=hd, W=width, WP=triton.next_power_of_2(width - 1), BC=bc, WRITE_Y=write_y,
        WRITE_WIN=write_window, PER_SEQ=n_keep is not None, num_warps=max(1, min(4, tp * bc // 256)),
    )  # fmt: skip
    return y if write_y else None


def _block_v(bsz: int, h: int, d: int, t: int, factors_inside: bool) -> tuple[int, int]:
    """(BV, num_warps) of the sequential kernel, the fastest measured (benchmarks/RESULTS.md): 64-wide
    tiles of 8 warps at 64 (sequence, head) pairs (one decode sequence of 64 heads: in the H100's decode
    replay 9.1 us a layer against 12.1 for 16-wide tiles of 2 warps, which spilled 200 bytes a thread,
    S33-2; each program computes its head's gate rows and β, so wider tiles repeat that less) and at fewer
    pairs when the gate's and β's factors are multiplied inside (`factors_inside`: a TP rank's few heads,
    where 2 warps hold the gate's rows in 255 registers and spill the same 200 bytes, S49); narrow tiles
    of 2 warps while fewer pairs of dense gates leave SMs idle (H200), 64-wide tiles with 4 warps
    beyond."""
    if t == 1 and (bsz * h == 64 or (factors_inside and bsz * h < 64)):
        return min(64, d), 8
    if t == 1 and bsz * h < 64:
        return min(16, d), 2
    if t == 1 and bsz * h <= 512:
        return min(32, d), 4
    return min(64, d), 4


def recurrent(
    qkv, x: KDAInputs, params: KDAParams, slots: KDASlots, *, write_o=True, store_state=True, n_steps=None,
    step_states=None, block_v=None, num_warps=None, conv=False,
):  # fmt: skip
    """The step kernel on conv outputs `qkv [B, T, 3·H·d]` with the gates of `x` (f `[B, T, H·d]`, b
    `[B, T, H]`, or either `LowRank` at decode); see the module docstring for the modes. Returns o
    `[B, T, H, d]` when `write_o`. With `conv` (decode: T = 1) `qkv` is None and the conv of x's raw q, k,
    v runs inside, the windows left as they are; otherwise neither the windows nor the conv weight are
    read."""
    if conv:
        qkv = x.q
    state_pool, slot_ids, lower_bound = slots.state_pool, slots.slot_ids, params.lower_bound
    bsz, t, _ = qkv.shape
    h, d = state_pool.shape[1], state_pool.shape[2]
    assert qkv.stride(2) == 1 and state_pool.is_contiguous()
    if (isinstance(x.f, LowRank) or isinstance(x.b, LowRank)) and not (conv and t == 1):
        raise ValueError("recurrent: LowRank inputs are taken by the decode launch only (conv, T = 1)")
    f, f_factors, f_constants = _gate_operands(x.f, h, d)
    b, b_weight, b_constants = _beta_operands(x.b, h)
    o = torch.empty(bsz, t, h, d, dtype=qkv.dtype, device=qkv.device) if write_o else qkv
    bv, warps = _block_v(bsz, h, d, t, factors_inside=f_constants["F_RANK"] > 0 and b_constants["B_RANK"] > 0)
    bv, warps = block_v or bv, num_warps or warps
    use_lb = lower_bound is not None
    dependent = dependent_launches(qkv.device)
    _recurrent_kernel[(bsz, h, d // bv)](
        TokenRows.of(qkv), f, b, params.dt_bias, params.a_log,
        SlotPool.of(state_pool, slot_ids), n_steps if n_steps is not None else slot_ids,
        TokenRows(o, o.stride(0), o.stride(1) if write_o else 0),
        step_states if step_states is not None else state_pool, d**-0.5,
        float(lower_bound) if use_lb else 0.0,
        # without CONV the conv operands are never read: qkv stands in
        _conv_operands(x, params, slots) if conv else DecodeConv(qkv, qkv, WindowPool(qkv, 0, 0), qkv),
        f_factors, b_weight,
        T=t, TP=triton.next_power_of_2(t), H=h, D=d, BV=bv, USE_LB=use_lb, WRITE_O=write_o,
        STORE_STATE=store_state, PER_SEQ=n_steps is not None, STEP_STATES=step_states is not None, CONV=conv,
        W=slots.conv_pool.shape[1] + 1 if conv else 1, **f_constants, **b_constants, num_warps=warps,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return o if write_o else None


def _gate_operands(
    f: torch.Tensor | LowRank, heads: int, head_dim: int
) -> tuple[TokenRows, ScaledWeight, dict]:
    """The step kernel's gate arguments: f's rows (or its factor a's), the projection (unread for a
    dense f `[B, T, H·d]`), the constexprs F_RANK, F_STEP, F_FP8."""
    if not isinstance(f, LowRank):
        assert f.stride(2) == 1
        return (
            TokenRows.of(f),
            ScaledWeight(f, f, 0),
            dict(F_RANK=0, F_STEP=1, F_FP8=False),
        )
    factor = low_rank.operands(f, heads, head_dim)
    constants = dict(F_RANK=factor.rank, F_STEP=factor.step, F_FP8=factor.fp8)
    return TokenRows(factor.a, factor.a_stride, 0), ScaledWeight(*factor.factors), constants


def _beta_operands(b: torch.Tensor | LowRank, heads: int) -> tuple[TokenRows, torch.Tensor, dict]:
    """The step kernel's β arguments: b's rows (or the layer input x's), the rows of b_proj (unread for
    a dense b `[B, T, H]`), the constexprs B_RANK, B_STEP."""
    if not isinstance(b, LowRank):
        return TokenRows.of(b), b, dict(B_RANK=0, B_STEP=1)
    rows = low_rank.operands(b, heads, 1, low_rank.ROW_STEP)
    if rows.fp8:
        raise ValueError("recurrent: β's LowRank weight must be unscaled (the dense rows of a projection)")
    return TokenRows(rows.a, rows.a_stride, 0), rows.factors[0], dict(B_RANK=rows.rank, B_STEP=rows.step)


def _conv_operands(x: KDAInputs, params: KDAParams, slots: KDASlots) -> DecodeConv:
    """The conv operands of a decode launch."""
    assert x.q.stride() == x.k.stride() == x.v.stride() and x.q.stride(-1) == 1
    return DecodeConv(x.k, x.v, WindowPool.of(slots.conv_pool), params.conv_weight)


def _block_rows(t: int) -> int:
    """TP, the rows per block of the block kernels (T ≤ TP)."""
    return max(8, triton.next_power_of_2(t))


def _anchor(lower_bound: float, t: int) -> float:
    """The log2 anchor m of the block kernels' gate factors 2^{G-m}, 2^{m-G}: with |G| ≤ TP·|lb2| both stay
    within 2^{±TP·|lb2|/2}, so their products with S cannot overflow fp32 for T ≤ 16."""
    return lower_bound * 1.4426950408889634 * (_block_rows(t) // 2)


# The block verify's tl.dot mode on the GPU. Its output must pick the tokens a decode step picks: with
# plain tf32 (10-bit operands: the fp32 state, the gated keys and queries rounded) the eager DFlash and MTP
# engines' greedy tokens parted from plain decoding's on 2 of 5 prompts of the tiny bf16 test model on an
# H100, with tf32x3 on none (S31; tests/test_prefill_graph_cuda.py compares the two paths).
VERIFY_PRECISION = "tf32x3"


def _verify_launch(bsz: int, h: int, d: int, t: int) -> tuple[int, int, int]:
    """(BV, num_warps, DC) of the block verify. Up to 8 tokens: while the batch leaves SMs idle, two value
    slices per head with the key channels in one pass (the H200 sweep's fastest, and the H100's at B = 1);
    beyond, one slice per head (no duplicated Gram and solve) on 4 warps walking the keys 32 at a time (H100,
    B = 8 at 64 heads, after a 256 MiB read as in a replay: 39.2 us against 56.7 for the 2-warp, 64-key
    launch, which spilled 728 bytes a thread; RESULTS S50-2). 9 to 16 tokens: two slices per head on 8
    warps, 32 keys at a time, at every batch (B = 1: 26.5 us against 40.2 for the 8-token launch, which
    spilled 776 bytes a thread; at B = 8, where that one spilled 2048, chosen by its compile: no stack at 255
    registers, untimed)."""
    if t > 8:
        return min(64, d), 8, min(32, d)
    if bsz * h <= 128:
        return min(64, d), 4, d
    return d, 4, min(32, d)


def block_verify(
    qkv, x: KDAInputs, params: KDAParams, slots: KDASlots, *, block_v=None, num_warps=None, key_chunk=None
):
    """Verify of T ≤ 16 tokens per request as one chunk (safe gate) on conv outputs `qkv [B, T, 3·H·d]`
    with the gates of `x`, one launch, pools untouched. Returns o `[B, T, H, d]` and the replay operands
    `[3, B, T, H, d]` fp32 that `block_commit` needs for any accepted prefix."""
    f, b = x.f, x.b
    state_pool, slot_ids, lower_bound = slots.state_pool, slots.slot_ids, params.lower_bound
    bsz, t, _ = qkv.shape
    h, d = state_pool.shape[1], state_pool.shape[2]
    if not _chunkable(t, lower_bound):
        raise ValueError(
            f"block_verify takes T ≤ 16 tokens and the safe gate, got T={t}, lower_bound={lower_bound}"
        )
    assert qkv.stride(2) == 1 and f.stride(2) == 1 and state_pool.is_contiguous()
    o = torch.empty(bsz, t, h, d, dtype=qkv.dtype, device=qkv.device)
    replay = torch.empty(3, bsz, t, h, d, dtype=torch.float32, device=qkv.device)
    bv, warps, dc = _verify_launch(bsz, h, d, t)
    bv, warps, dc = block_v or bv, num_warps or warps, key_chunk or dc
    _block_verify_kernel[(bsz, h, d // bv)](
        TokenRows.of(qkv), TokenRows.of(f),
        TokenRows.of(b), params.dt_bias, params.a_log,
        SlotPool.of(state_pool, slot_ids), TokenRows.of(o),
        replay, replay.stride(0), d**-0.5, float(lower_bound), _anchor(lower_bound, t),
        T=t, TP=_block_rows(t), FACTORS=max(1, (t - 1).bit_length()), H=h, D=d, DC=dc, BV=bv,
        PREC="ieee" if _INTERPRET else VERIFY_PRECISION, num_warps=warps,
    )  # fmt: skip
    return o, replay


def _commit_rows(bsz: int, h: int, d: int) -> int:
    """Rows of S per commit program, the fastest on the H200 (benchmarks/RESULTS.md, run S4-2): 16 for a
    single request (more programs in flight), 32 from two on."""
    return min(16 if bsz * h <= 64 else 32, d)


def block_commit(
    cache: ReplayCache, params: KDAParams, slots: KDASlots, n_accepted, *, block_k=None, num_warps=None
):
    """Commit the first n_accepted[b] tokens of a `block_verify` onto the slot states (from the replay
    operands in `cache`, no recomputation) and windows (from its raw q|k|v `[B, T, H·d]`), one launch.
    `block_k` rows of S per program; the conv weight is not read."""
    replay, q, k, v = cache.replay, cache.x.q, cache.x.k, cache.x.v
    conv_pool, state_pool, slot_ids = slots.tensors
    _, bsz, t, h, d = replay.shape
    assert q.stride() == k.stride() == v.stride() and q.stride(2) == 1
    bk, warps = block_k or _commit_rows(bsz, h, d), num_warps or 4
    if d % bk:
        raise ValueError(f"block_commit: block_k={bk} must divide the head size {d}")
    width = conv_pool.shape[1] + 1
    # a head's row tiles are neighbours in the launch order: its state is streamed in one sweep
    _block_commit_kernel[(d // bk + 1, bsz, h)](
        replay, replay.stride(0), SlotPool.of(state_pool, slot_ids), n_accepted,
        RawQKV(q, k, v, q.stride(0), q.stride(1)),
        WindowPool.of(conv_pool), _anchor(params.lower_bound, t),
        T=t, TP=max(16, triton.next_power_of_2(t)), H=h, D=d, BK=bk, W=width,
        WP=triton.next_power_of_2(width - 1), PREC="ieee" if _INTERPRET else "tf32x3", num_warps=warps,
    )  # fmt: skip


def _chunkable(t: int, lower_bound) -> bool:
    return t <= 16 and lower_bound is not None and -5.0 <= lower_bound < 0


def decode(
    x: KDAInputs, params: KDAParams, slots: KDASlots, norm: OutputNorm | None = None, **kw
) -> torch.Tensor:
    """Triton twin of `reference.decode`: one token per sequence, window and state updated in place. Two
    launches: the step kernel with the conv inside (it reads the windows), then, once every program has
    read them, the gated output norm that also advances the windows (`norm`), or the window step alone.
    `LowRank` inputs (f, b, the norm's gate) are multiplied inside those launches up to
    `LOW_RANK_MAX_HEAD_ROWS` (sequence, head) pairs, beyond it by the projection launches first."""
    if x.q.shape[0] * slots.state_pool.shape[1] > LOW_RANK_MAX_HEAD_ROWS:
        x, norm = _multiplied_out(x, norm)
    f, b = (t if isinstance(t, LowRank) else t[:, None] for t in (x.f, x.b))  # each sequence a 1-token block
    steps = KDAInputs(x.q[:, None], x.k[:, None], x.v[:, None], f, b)
    o = recurrent(None, steps, params, slots, conv=True, **kw)[:, 0]
    if norm is not None:
        return gated_rms_norm(o, norm, WindowStep(x, slots))
    conv_steps(steps, None, slots, write_y=False, write_window=True)
    return o


def _multiplied_out(x: KDAInputs, norm: OutputNorm | None) -> tuple[KDAInputs, OutputNorm | None]:
    """x and norm with their `LowRank` inputs multiplied out by `ops.gemm.linear` (projection launches)."""
    f, b = (linear(t.a, t.weight, t.scale_inv) if isinstance(t, LowRank) else t for t in (x.f, x.b))
    x = KDAInputs(x.q, x.k, x.v, f, b)
    if norm is not None and isinstance(norm.gate, LowRank):
        gate = norm.gate
        norm = OutputNorm(linear(gate.a, gate.weight, gate.scale_inv), norm.weight, norm.eps)
    return x, norm


def verify(
    x: KDAInputs, params: KDAParams, slots: KDASlots, step_states=None, **kw
) -> tuple[torch.Tensor, VerifyCache]:
    """Triton twin of `reference.verify`: one conv launch and one launch for all T tokens (the block
    kernel; the sequential one for other gates or when `step_states` are wanted)."""
    qkv = conv_steps(x, params.conv_weight, slots)
    if step_states is None and _chunkable(x.q.shape[1], params.lower_bound):
        o, replay = block_verify(qkv, x, params, slots, **kw)
        return o, ReplayCache(x, replay=replay)
    o = recurrent(qkv, x, params, slots, store_state=False, step_states=step_states, **kw)
    return o, VerifyCache(x, qkv)


def commit(cache: VerifyCache, params: KDAParams, slots: KDASlots, n_accepted, **kw) -> None:
    """Triton twin of `reference.commit`, one launch after a block verify (state and window from its
    replay operands); otherwise the sequential kernel's replay plus a window launch."""
    if isinstance(cache, ReplayCache):
        block_commit(cache, params, slots, n_accepted, **kw)
        return
    qkv = cache.qkv
    if qkv is None:
        qkv = conv_steps(cache.x, params.conv_weight, slots)
    recurrent(qkv, cache.x, params, slots, write_o=False, n_steps=n_accepted, **kw)
    _keep_windows(cache, slots, n_accepted)


def _keep_windows(cache: VerifyCache, slots: KDASlots, n_accepted) -> None:
    """Advance each verified sequence's window by its first `n_accepted[b]` tokens (one launch)."""
    conv_steps(cache.x, None, slots, write_y=False, write_window=True, n_keep=n_accepted)


def commit_steps(cache: VerifyCache, step_states, slots: KDASlots, n_accepted) -> None:
    """Triton twin of `reference.commit_steps`: copy the saved state of step n_accepted[b]."""
    bsz, t, h, d, _ = step_states.shape
    blk = min(4096, d * d)
    _take_step_kernel[(bsz, h, d * d // blk)](
        step_states,
        t,
        slots.state_pool,
        slots.state_pool.stride(0),
        slots.slot_ids,
        n_accepted,
        H=h,
        DD=d * d,
        BLK=blk,
        num_warps=4,
    )
    _keep_windows(cache, slots, n_accepted)
