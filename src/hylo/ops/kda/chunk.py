"""Triton chunked KDA prefill over packed variable-length sequences (state in the slot pool).

Three launches. `_conv_kernel` (one program per 64-token chunk, head and q|k|v part) computes the
causal conv + SiLU from the slot window, rewriting the window for a sequence's first chunk, and the
scaled inverse L2 norms of q and k. `_intra_kernel` (per chunk and head, all in parallel) computes the
safe gate and its in-chunk cumulative sum, β = σ(b), and the in-chunk algebra

    X = (I + L)⁻¹,  L[i,j] = β_i Σ_d k_i k_j e^{G_i-G_j} (i > j),  A[i,j] = Σ_d q_i k_j e^{G_i-G_j} (i ≥ j)
    w = X diag(β) (k ⊙ e^G),  u = X diag(β) v,  q' = q ⊙ e^G − A w,  o₀ = A u,  k̄ = k ⊙ e^{G_C−G}

with G the cumulative log decay from the chunk start and G_C its value at the chunk's last token (the
d-sums run over column blocks to bound registers). `_recur_kernel` runs one program per (sequence,
head, value tile), walking the chunks in order:

    o = o₀ + q' S,   S ← diag(e^{G_C}) S + k̄ᵀ (u − w S)

The 64-row chunk is handled as two 32-row halves. e^{G_i−G_j} is never formed from e^{±G} of a whole
chunk: the diagonal 32×32 blocks factor it around an anchor G_first + lb·31/2 (only the half's first
token, so nothing from the future enters a causal score), which keeps both factors within e^{±77.5} for
a gate bounded by lb ≥ -5; the off-diagonal block factors around the boundary, where both factors are
≤ 1. The bound is why this path needs the safe gate.
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

BT = 64  # chunk length
HB = 32  # half chunk
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _locate(cu, idx, n_seq, BT: tl.constexpr, BLOCK_B: tl.constexpr):
    """For the idx-th chunk of the packed batch: (sequence, its first token, its end, chunk in it)."""
    offs = tl.arange(0, BLOCK_B)
    lo = tl.load(cu + offs, mask=offs < n_seq, other=0)
    hi = tl.load(cu + offs + 1, mask=offs < n_seq, other=0)
    nch = (hi - lo + BT - 1) // BT
    cum = tl.cumsum(nch, 0)
    seq = tl.sum((cum <= idx).to(tl.int32), 0)
    pick = offs == seq
    first = tl.sum(tl.where(pick, cum - nch, 0), 0)
    bos = tl.sum(tl.where(pick, lo, 0), 0)
    eos = tl.sum(tl.where(pick, hi, 0), 0)
    return seq, bos, eos, idx - first


@triton.jit
def _conv_rows(x, x_stride, win, win_stride, wt, pos, seq_len, bos, cols, W: tl.constexpr):
    """SiLU(causal conv) at in-sequence positions `pos` for the columns `cols` (fp32, rounded like x).

    Tap i reads input pos-(W-1)+i: from x (rows bos+..) when ≥ 0, else from the slot window row."""
    acc = tl.zeros([pos.shape[0], cols.shape[0]], dtype=tl.float32)
    live = pos < seq_len
    for i in tl.static_range(W):
        j = pos - (W - 1) + i
        from_x = live & (j >= 0)
        from_w = live & (j < 0)
        xv = tl.load(
            x + (bos + j).to(tl.int64)[:, None] * x_stride + cols[None, :], mask=from_x[:, None], other=0.0
        )
        wv = tl.load(win + (W - 1 + j)[:, None] * win_stride + cols[None, :], mask=from_w[:, None], other=0.0)
        tap = tl.load(wt + cols * W + i)
        acc += (xv.to(tl.float32) + wv.to(tl.float32)) * tap[None, :]
    y = acc * tl.sigmoid(acc)
    return y.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _first_row(x, rows):
    return tl.sum(tl.where(rows[:, None] == 0, x, 0.0), 0)


@triton.jit
def _unit_lower_inverse(lt_a, lt_b, HB: tl.constexpr):
    """(I + L)⁻¹ for two strictly lower HB×HB matrices given transposed (lt[j, i] = L[i, j])."""
    rows = tl.arange(0, HB)
    xa = tl.zeros([HB, HB], dtype=tl.float32)
    xb = tl.zeros([HB, HB], dtype=tl.float32)
    for i in range(HB):
        eye = tl.where(rows == i, 1.0, 0.0)
        la = tl.sum(tl.where(rows[None, :] == i, lt_a, 0.0), 1)
        lb = tl.sum(tl.where(rows[None, :] == i, lt_b, 0.0), 1)
        ra = eye - tl.sum(la[:, None] * xa, 0)
        rb = eye - tl.sum(lb[:, None] * xb, 0)
        xa = tl.where(rows[:, None] == i, ra[None, :], xa)
        xb = tl.where(rows[:, None] == i, rb[None, :], xb)
    return xa, xb


@triton.jit
def _rewrite_window(
    x, x_stride, win, win_stride, xcols, wcols, seq_len, bos, W: tl.constexpr, WP: tl.constexpr
):
    """New window = the last W-1 inputs of the sequence (older ones from the old window)."""
    r = tl.arange(0, WP)
    j = seq_len - (W - 1) + r
    live = r < W - 1
    xval = tl.load(
        x + (bos + j).to(tl.int64)[:, None] * x_stride + xcols[None, :],
        mask=(live & (j >= 0))[:, None],
        other=0.0,
    )
    wval = tl.load(
        win + (W - 1 + j)[:, None] * win_stride + wcols[None, :], mask=(live & (j < 0))[:, None], other=0.0
    )
    new = xval.to(tl.float32) + wval.to(tl.float32)
    tl.debug_barrier()
    tl.store(win + r[:, None] * win_stride + wcols[None, :], new.to(win.dtype.element_ty), mask=live[:, None])


@triton.jit
def _conv_part(
    x,
    x_stride,
    win,
    win_stride,
    conv_w,
    y,
    rnorm,
    pos,
    seq_len,
    bos,
    h,
    part,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    NORM: tl.constexpr,
    FIRST,
):
    """conv + SiLU of one head of one of q|k|v over a chunk into y; q/k also get their scaled 1/‖·‖."""
    cols = tl.arange(0, D)
    ch = part * H * D + h * D + cols
    yv = _conv_rows(
        x,
        x_stride,
        win + part * H * D,
        win_stride,
        conv_w + part * H * D * W,
        pos,
        seq_len,
        bos,
        h * D + cols,
        W,
    )
    ok = pos < seq_len
    tok = (bos + pos).to(tl.int64)
    tl.store(y + tok[:, None] * (3 * H * D) + ch[None, :], yv.to(y.dtype.element_ty), mask=ok[:, None])
    if NORM:
        r = scale / tl.sqrt(tl.sum(yv * yv, 1) + 1e-6)
        tl.store(rnorm + (tok * 2 + part) * H + h, r, mask=ok)
    if FIRST:
        _rewrite_window(x, x_stride, win, win_stride, h * D + cols, ch, seq_len, bos, W, WP)


@triton.jit
def _conv_kernel(
    xq,
    xk,
    xv,
    x_stride,
    conv_w,
    conv_pool,
    pool_stride,
    win_stride,
    slot_ids,
    cu,
    n_seq,
    y,
    rnorm,
    scale,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_B: tl.constexpr,
):
    pid, h, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, bos, eos, chunk = _locate(cu, pid, n_seq, BT, BLOCK_B)
    win = conv_pool + tl.load(slot_ids + seq).to(tl.int64) * pool_stride
    pos = chunk * BT + tl.arange(0, BT)
    first = chunk == 0  # that program is the only reader of the old window of its channels: it rewrites it
    if part == 0:
        _conv_part(
            xq,
            x_stride,
            win,
            win_stride,
            conv_w,
            y,
            rnorm,
            pos,
            eos - bos,
            bos,
            h,
            0,
            scale,
            H,
            D,
            W,
            WP,
            True,
            first,
        )
    elif part == 1:
        _conv_part(
            xk,
            x_stride,
            win,
            win_stride,
            conv_w,
            y,
            rnorm,
            pos,
            eos - bos,
            bos,
            h,
            1,
            1.0,
            H,
            D,
            W,
            WP,
            True,
            first,
        )
    else:
        _conv_part(
            xv,
            x_stride,
            win,
            win_stride,
            conv_w,
            y,
            rnorm,
            pos,
            eos - bos,
            bos,
            h,
            2,
            1.0,
            H,
            D,
            W,
            WP,
            False,
            first,
        )


@triton.jit
def _load_half(y, rnorm, f, f_stride, bias, rate, lb2, tok, ok, h, cols, H: tl.constexpr, D: tl.constexpr):
    """Normalised q, k and the gate (log2 units, 0 on dead rows) of rows `tok`, columns `cols`."""
    base = tok[:, None] * (3 * H * D) + h * D + cols[None, :]
    q = tl.load(y + base, mask=ok[:, None], other=0.0).to(tl.float32)
    k = tl.load(y + base + H * D, mask=ok[:, None], other=0.0).to(tl.float32)
    q = q * tl.load(rnorm + (tok * 2) * H + h, mask=ok, other=0.0)[:, None]
    k = k * tl.load(rnorm + (tok * 2 + 1) * H + h, mask=ok, other=0.0)[:, None]
    fv = tl.load(f + tok[:, None] * f_stride + h * D + cols[None, :], mask=ok[:, None], other=0.0)
    g = tl.where(ok[:, None], lb2 * tl.sigmoid(rate * (fv.to(tl.float32) + bias[None, :])), 0.0)
    return q, k, g


@triton.jit
def _intra_kernel(
    y,
    rnorm,
    f,
    f_stride,
    b,
    b_stride,
    dt_bias,
    a_log,
    cu,
    n_seq,
    w_out,
    qp_out,
    kg_out,
    u_out,
    o_out,
    dc_out,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    DH: tl.constexpr,
    BT: tl.constexpr,
    HB: tl.constexpr,
    BLOCK_B: tl.constexpr,
    PREC: tl.constexpr,
):
    pid, h = tl.program_id(0), tl.program_id(1)
    _, bos, eos, chunk = _locate(cu, pid, n_seq, BT, BLOCK_B)
    rows = tl.arange(0, HB)
    pos_a = chunk * BT + rows
    pos_b = pos_a + HB
    ok_a, ok_b = pos_a < eos - bos, pos_b < eos - bos
    tok_a, tok_b = (bos + pos_a).to(tl.int64), (bos + pos_b).to(tl.int64)
    rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    lb2 = lower_bound * 1.4426950408889634
    shift = lb2 * (HB - 1) / 2
    beta_a = tl.where(
        ok_a, tl.sigmoid(tl.load(b + tok_a * b_stride + h, mask=ok_a, other=0.0).to(tl.float32)), 0.0
    )
    beta_b = tl.where(
        ok_b, tl.sigmoid(tl.load(b + tok_b * b_stride + h, mask=ok_b, other=0.0).to(tl.float32)), 0.0
    )

    # in-chunk scores, accumulated over column blocks; each factored around an anchor that keeps both
    # factors finite (see the module docstring)
    lt_a = tl.zeros([HB, HB], dtype=tl.float32)
    lt_b = tl.zeros([HB, HB], dtype=tl.float32)
    l_ba = tl.zeros([HB, HB], dtype=tl.float32)
    a_a = tl.zeros([HB, HB], dtype=tl.float32)
    a_b = tl.zeros([HB, HB], dtype=tl.float32)
    a_ba = tl.zeros([HB, HB], dtype=tl.float32)
    for c0 in range(0, D, DH):
        cols = c0 + tl.arange(0, DH)
        bias = tl.load(dt_bias + h * D + cols).to(tl.float32)
        q_a, k_a, g_a = _load_half(y, rnorm, f, f_stride, bias, rate, lb2, tok_a, ok_a, h, cols, H, D)
        q_b, k_b, g_b = _load_half(y, rnorm, f, f_stride, bias, rate, lb2, tok_b, ok_b, h, cols, H, D)
        tot_a = tl.sum(g_a, 0)
        tl.store(dc_out + (pid * H + h) * D + cols, tl.exp2(tot_a + tl.sum(g_b, 0)))
        g_a = tl.cumsum(g_a, 0)
        g_b = tot_a[None, :] + tl.cumsum(g_b, 0)
        m_a = _first_row(g_a, rows) + shift
        m_b = _first_row(g_b, rows) + shift
        kr_a = k_a * tl.exp2(m_a[None, :] - g_a)
        kr_b = k_b * tl.exp2(m_b[None, :] - g_b)
        kr_x = k_a * tl.exp2(tot_a[None, :] - g_a)
        lt_a += tl.dot(kr_a, tl.trans(k_a * tl.exp2(g_a - m_a[None, :])), input_precision=PREC)
        lt_b += tl.dot(kr_b, tl.trans(k_b * tl.exp2(g_b - m_b[None, :])), input_precision=PREC)
        l_ba += tl.dot(k_b * tl.exp2(g_b - tot_a[None, :]), tl.trans(kr_x), input_precision=PREC)
        a_a += tl.dot(q_a * tl.exp2(g_a - m_a[None, :]), tl.trans(kr_a), input_precision=PREC)
        a_b += tl.dot(q_b * tl.exp2(g_b - m_b[None, :]), tl.trans(kr_b), input_precision=PREC)
        a_ba += tl.dot(q_b * tl.exp2(g_b - tot_a[None, :]), tl.trans(kr_x), input_precision=PREC)
    causal_t = rows[None, :] > rows[:, None]  # [j, i]: i > j
    lt_a = tl.where(causal_t, lt_a * beta_a[None, :], 0.0)
    lt_b = tl.where(causal_t, lt_b * beta_b[None, :], 0.0)
    l_ba = l_ba * beta_b[:, None]
    incl = rows[:, None] >= rows[None, :]
    a_a = tl.where(incl, a_a, 0.0)
    a_b = tl.where(incl, a_b, 0.0)

    x_a, x_b = _unit_lower_inverse(lt_a, lt_b, HB)
    x_ba = -tl.dot(tl.dot(x_b, l_ba, input_precision=PREC), x_a, input_precision=PREC)

    out_ty = w_out.dtype.element_ty
    for c0 in range(0, D, DH):
        cols = c0 + tl.arange(0, DH)
        bias = tl.load(dt_bias + h * D + cols).to(tl.float32)
        q_a, k_a, g_a = _load_half(y, rnorm, f, f_stride, bias, rate, lb2, tok_a, ok_a, h, cols, H, D)
        q_b, k_b, g_b = _load_half(y, rnorm, f, f_stride, bias, rate, lb2, tok_b, ok_b, h, cols, H, D)
        tot_a = tl.sum(g_a, 0)
        g_c = tot_a + tl.sum(g_b, 0)
        g_a = tl.cumsum(g_a, 0)
        g_b = tot_a[None, :] + tl.cumsum(g_b, 0)
        ea, eb = tl.exp2(g_a), tl.exp2(g_b)
        bk_a = beta_a[:, None] * k_a * ea
        w_a = tl.dot(x_a, bk_a, input_precision=PREC)
        w_b = tl.dot(x_ba, bk_a, input_precision=PREC) + tl.dot(
            x_b, beta_b[:, None] * k_b * eb, input_precision=PREC
        )
        off_a = (tok_a * H + h)[:, None] * D + cols[None, :]
        off_b = (tok_b * H + h)[:, None] * D + cols[None, :]
        tl.store(w_out + off_a, w_a.to(out_ty), mask=ok_a[:, None])
        tl.store(w_out + off_b, w_b.to(out_ty), mask=ok_b[:, None])
        qp_a = q_a * ea - tl.dot(a_a, w_a, input_precision=PREC)
        qp_b = q_b * eb - tl.dot(a_ba, w_a, input_precision=PREC) - tl.dot(a_b, w_b, input_precision=PREC)
        tl.store(qp_out + off_a, qp_a.to(out_ty), mask=ok_a[:, None])
        tl.store(qp_out + off_b, qp_b.to(out_ty), mask=ok_b[:, None])
        tl.store(kg_out + off_a, (k_a * tl.exp2(g_c[None, :] - g_a)).to(out_ty), mask=ok_a[:, None])
        tl.store(kg_out + off_b, (k_b * tl.exp2(g_c[None, :] - g_b)).to(out_ty), mask=ok_b[:, None])

        v_a = tl.load(
            y + tok_a[:, None] * (3 * H * D) + 2 * H * D + h * D + cols[None, :],
            mask=ok_a[:, None],
            other=0.0,
        ).to(tl.float32)
        v_b = tl.load(
            y + tok_b[:, None] * (3 * H * D) + 2 * H * D + h * D + cols[None, :],
            mask=ok_b[:, None],
            other=0.0,
        ).to(tl.float32)
        bv_a = beta_a[:, None] * v_a
        u_a = tl.dot(x_a, bv_a, input_precision=PREC)
        u_b = tl.dot(x_ba, bv_a, input_precision=PREC) + tl.dot(
            x_b, beta_b[:, None] * v_b, input_precision=PREC
        )
        tl.store(u_out + off_a, u_a.to(out_ty), mask=ok_a[:, None])
        tl.store(u_out + off_b, u_b.to(out_ty), mask=ok_b[:, None])
        o_a = tl.dot(a_a, u_a, input_precision=PREC)
        o_b = tl.dot(a_ba, u_a, input_precision=PREC) + tl.dot(a_b, u_b, input_precision=PREC)
        tl.store(o_out + off_a, o_a.to(o_out.dtype.element_ty), mask=ok_a[:, None])
        tl.store(o_out + off_b, o_b.to(o_out.dtype.element_ty), mask=ok_b[:, None])


@triton.jit
def _chunk_step(
    s,
    w_in,
    qp_in,
    kg_in,
    u_in,
    o_io,
    dc_in,
    bos,
    eos,
    c,
    first,
    h,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    rk,
    rv,
):
    """One chunk: o = o₀ + q'S, then S ← diag(e^{G_C}) S + k̄ᵀ(u − wS)."""
    tok = bos + c * BT + tl.arange(0, BT)
    ok = tok < eos
    base = (tok.to(tl.int64) * H + h) * D
    w = tl.load(w_in + base[:, None] + rk[None, :], mask=ok[:, None], other=0.0)
    qp = tl.load(qp_in + base[:, None] + rk[None, :], mask=ok[:, None], other=0.0)
    kg = tl.load(kg_in + base[:, None] + rk[None, :], mask=ok[:, None], other=0.0)
    u = tl.load(u_in + base[:, None] + rv[None, :], mask=ok[:, None], other=0.0)
    o0 = tl.load(o_io + base[:, None] + rv[None, :], mask=ok[:, None], other=0.0)
    dc = tl.load(dc_in + ((first + c) * H + h) * D + rk)
    op_ty = w_in.dtype.element_ty
    s_op = s.to(op_ty)
    o = o0.to(tl.float32) + tl.dot(qp, s_op)
    tl.store(o_io + base[:, None] + rv[None, :], o.to(o_io.dtype.element_ty), mask=ok[:, None])
    upd = u.to(tl.float32) - tl.dot(w, s_op)
    return s * dc[:, None] + tl.dot(tl.trans(kg), upd.to(op_ty))


@triton.jit
def _recur_kernel(
    w_in,
    qp_in,
    kg_in,
    u_in,
    o_io,
    dc_in,
    state_pool,
    pool_stride,
    slot_ids,
    cu,
    n_seq,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    BLOCK_B: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    STAGES: tl.constexpr,
):
    seq, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = tl.arange(0, BLOCK_B)
    lo = tl.load(cu + offs, mask=offs < n_seq, other=0)
    hi = tl.load(cu + offs + 1, mask=offs < n_seq, other=0)
    first = tl.sum(tl.where(offs < seq, (hi - lo + BT - 1) // BT, 0), 0)
    bos = tl.sum(tl.where(offs == seq, lo, 0), 0)
    eos = tl.sum(tl.where(offs == seq, hi, 0), 0)
    slot = tl.load(slot_ids + seq).to(tl.int64)
    rk = tl.arange(0, D)
    rv = iv * BV + tl.arange(0, BV)
    p_s = state_pool + slot * pool_stride + h * D * D + rk[:, None] * D + rv[None, :]
    s = tl.load(p_s)
    n_chunks = tl.cdiv(eos - bos, BT)
    if FOR_LOOP:
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            s = _chunk_step(
                s, w_in, qp_in, kg_in, u_in, o_io, dc_in, bos, eos, c, first, h, H, D, BV, BT, rk, rv
            )
    else:  # the interpreter cannot take a run-time bound in range()
        c = 0
        while c < n_chunks:
            s = _chunk_step(
                s, w_in, qp_in, kg_in, u_in, o_io, dc_in, bos, eos, c, first, h, H, D, BV, BT, rk, rv
            )
            c += 1
    tl.store(p_s, s)


def chunk_count(cu_seqlens_cpu) -> int:
    return sum(-(-(b - a) // BT) for a, b in itertools.pairwise(cu_seqlens_cpu))


def prefill(
    q,
    k,
    v,
    f,
    b,
    conv_weight,
    dt_bias,
    a_log,
    conv_pool,
    state_pool,
    slot_ids,
    cu_seqlens,
    cu_seqlens_cpu,
    lower_bound: float,
    **tuning,
) -> torch.Tensor:
    """Triton twin of `reference.prefill` (see there for the arguments); returns o `[N, H, d]`.

    Needs the safe gate with -5 ≤ lower_bound < 0. `tuning` goes to `prep` / `recur`."""
    prep_keys = {"precision", "prep_warps", "col_block"}
    bufs = prep(
        q,
        k,
        v,
        f,
        b,
        conv_weight,
        dt_bias,
        a_log,
        conv_pool,
        slot_ids,
        cu_seqlens,
        cu_seqlens_cpu,
        lower_bound,
        state_pool.shape[1],
        **{key: val for key, val in tuning.items() if key in prep_keys},
    )
    recur(
        bufs,
        state_pool,
        slot_ids,
        cu_seqlens,
        **{key: val for key, val in tuning.items() if key not in prep_keys},
    )
    return bufs[4]


def prep(
    q,
    k,
    v,
    f,
    b,
    conv_weight,
    dt_bias,
    a_log,
    conv_pool,
    slot_ids,
    cu_seqlens,
    cu_seqlens_cpu,
    lower_bound,
    h: int,
    *,
    precision: str | None = None,
    prep_warps: int = 4,
    col_block: int = 64,
) -> tuple[torch.Tensor, ...]:
    """The parallel launches (conv + norm, then in-chunk algebra); returns (w, q', k̄, u, o₀, e^{G_C}).
    `precision` is the `tl.dot` mode of the fp32 in-chunk products (tf32; ieee under the interpreter)."""
    n, hd = q.shape
    d = hd // h
    n_seq = slot_ids.shape[0]
    if not -5.0 <= lower_bound < 0:
        raise ValueError(f"the chunked Triton path needs -5 <= lower_bound < 0, got {lower_bound}")
    assert q.stride() == k.stride() == v.stride() and q.stride(1) == 1 and f.stride(1) == 1
    assert conv_pool.stride(2) == 1
    precision = precision or ("ieee" if _INTERPRET else "tf32")
    n_chunks = chunk_count(cu_seqlens_cpu)
    block_b = triton.next_power_of_2(n_seq + 1)
    width = conv_weight.shape[1]
    y = torch.empty(n, 3 * hd, dtype=q.dtype, device=q.device)
    rnorm = torch.empty(n, 2, h, dtype=torch.float32, device=q.device)
    _conv_kernel[(n_chunks, h, 3)](
        q,
        k,
        v,
        q.stride(0),
        conv_weight,
        conv_pool,
        conv_pool.stride(0),
        conv_pool.stride(1),
        slot_ids,
        cu_seqlens,
        n_seq,
        y,
        rnorm,
        d**-0.5,
        H=h,
        D=d,
        W=width,
        WP=triton.next_power_of_2(width - 1),
        BT=BT,
        BLOCK_B=block_b,
        num_warps=4,
    )
    o, w, qp, kg, u = (torch.empty(n, h, d, dtype=q.dtype, device=q.device) for _ in range(5))
    dc = torch.empty(n_chunks, h, d, dtype=torch.float32, device=q.device)
    _intra_kernel[(n_chunks, h)](
        y,
        rnorm,
        f,
        f.stride(0),
        b,
        b.stride(0),
        dt_bias,
        a_log,
        cu_seqlens,
        n_seq,
        w,
        qp,
        kg,
        u,
        o,
        dc,
        float(lower_bound),
        H=h,
        D=d,
        DH=min(col_block, d),
        BT=BT,
        HB=HB,
        BLOCK_B=block_b,
        PREC=precision,
        num_warps=prep_warps,
    )
    return w, qp, kg, u, o, dc


def recur(
    bufs, state_pool, slot_ids, cu_seqlens, *, block_v: int = 64, stages: int = 2, warps: int = 4
) -> None:
    """The sequential launch: o₀ += q'S per chunk, S carried through the slot (in place)."""
    w, qp, kg, u, o, dc = bufs
    h, d = state_pool.shape[1], state_pool.shape[2]
    assert state_pool.is_contiguous()
    n_seq = slot_ids.shape[0]
    bv = min(block_v, d)
    _recur_kernel[(n_seq, h, d // bv)](
        w,
        qp,
        kg,
        u,
        o,
        dc,
        state_pool,
        state_pool.stride(0),
        slot_ids,
        cu_seqlens,
        n_seq,
        H=h,
        D=d,
        BV=bv,
        BT=BT,
        BLOCK_B=triton.next_power_of_2(n_seq + 1),
        FOR_LOOP=not _INTERPRET,
        STAGES=stages,
        num_warps=warps,
    )


__all__ = ["BT", "chunk_count", "prefill", "prep", "recur"]
