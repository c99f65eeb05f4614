"""Triton chunked KDA prefill over packed variable-length sequences (state in the slot pool).

Three launches, the first two fully parallel over (64-token chunk, head):

1. `_conv_gate_kernel`, also over small sub-tiles so that no program spills: causal conv + SiLU of q, k, v
   from the projections in blocks of whole rows (the block at a sequence's start reads its slot's conv
   window, then rewrites it) with the scaled inverse L2 norms of q and k, and, in column blocks of the
   whole chunk, the in-chunk cumulative safe gate G (log2 units, fp32), β = σ(b) and e^{G_C} (G_C: the
   value at the chunk's last token).
2. `_intra_kernel`: the in-chunk algebra, with q and k normalised,

       X = (I + L)⁻¹,  L[i,j] = β_i k_i·k_j e^{G_i-G_j} (i > j),  A[i,j] = q_i·k_j e^{G_i-G_j} (i ≥ j)
       w = X diag(β) (k ⊙ e^G),  u = X diag(β) v,  q̄ = q ⊙ e^G,  k̄ = k ⊙ e^{G_C−G}

   and stores w, u, q̄, k̄ and A, all in the activations' dtype.
3. `_recur_kernel`, one program per (sequence, head, value tile), walking the chunks in order:

       δ = u − w S,   o = q̄ S + A δ,   S ← diag(e^{G_C}) S + k̄ᵀ δ

   δ = X diag(β) (v − (k ⊙ e^G) S) is the chunk's update, so A δ is its in-chunk output; δ enters both
   products rounded to the activations' dtype.

Measured slower and removed (H100, T=13312, 64 heads, the whole prefill; this layout 2688 us): launches 1
and 2 replaced by launches that read the projections themselves, so that the conv outputs and G (2.2 GB,
written then read) never reach memory (one launch 2x slower, RESULTS S44-2; two launches 3266-5133 us),
the Gram in 32-row sub-blocks (5224 us) and the in-chunk launch in CUDA C++ (4497 us); the Gram 32
columns a step was within noise (2667 us).

Intermediates are stored per chunk, padded to 64 rows (padding rows are exact zeros or, for G, its
last value), so the later launches read whole tiles. The Gram matrices are summed over column blocks in
16-row sub-blocks: e^{G_i-G_j} is split around an anchor per sub-block of rows, the gate total before it
plus lb·8, so both factors stay within 2^±58 for a gate bounded by lb ≥ -5 (e^{G_i-G_j} of a whole chunk
spans down to 2^-462, past fp32) and nothing after token i enters row i. The triangular inverse takes
the four 16×16 diagonal blocks by a Neumann product (nilpotency ends it after four factors), then merges
them with the strictly-block-lower rest: X = (I − N)(I + N²) X_d with N = X_d E.
"""

from __future__ import annotations

import itertools
import os

import torch
import triton
import triton.language as tl

from hylo.ops.kda.operands import (
    ChunkRows,
    ChunkTerms,
    GateInputs,
    PackedQKV,
    PackedSeqs,
    SlotPool,
    SnapshotTargets,
)
from hylo.ops.kda.reference import CHUNK_TOKENS, ChunkSnapshots, KDAInputs, KDAParams, KDASlots

BT = CHUNK_TOKENS  # chunk length
BC = 16  # sub-block of rows in the Gram pass
SEQ_TILE = 64  # sequence offsets the recurrence sums per loop step (locating its sequence's first chunk)
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _locate(cu, idx, n_seq, BT: tl.constexpr, BLOCK_B: tl.constexpr):
    """For the idx-th chunk of the packed batch: (sequence, its first token, its end, chunk in it)."""
    offs = tl.arange(0, BLOCK_B)
    lo = tl.load(cu + offs, mask=offs < n_seq, other=0)
    hi = tl.load(cu + offs + 1, mask=offs < n_seq, other=0)
    nch = (hi - lo + BT - 1) // BT
    cum = tl.cumsum(nch, 0)
    # a chunk past the batch's last (a padded batch's launch covers the most chunks its tokens could
    # hold) lands past the last sequence's end: every row masked, no window rewritten
    seq = tl.minimum(tl.sum((cum <= idx).to(tl.int32), 0), n_seq - 1)
    pick = offs == seq
    first = tl.sum(tl.where(pick, cum - nch, 0), 0)
    bos = tl.sum(tl.where(pick, lo, 0), 0)
    eos = tl.sum(tl.where(pick, hi, 0), 0)
    return seq, bos, eos, idx - first


@triton.jit
def _sigmoid(x, FAST: tl.constexpr):
    """σ(x); FAST: from the approximate, flush-to-zero exp2 and reciprocal instructions (relative error
    ~2^-21) instead of tl.sigmoid's exp and division with their denormal and range fix-ups. With the
    taps as FMAs this took the first launch from 3992 to 3288 SASS instructions and, on the H200, from
    1103 to 975 us at T=13312. The interpreter has no inline PTX: it takes tl.sigmoid."""
    if FAST:
        e = tl.inline_asm_elementwise(
            "ex2.approx.ftz.f32 $0, $1;",
            "=f,f",
            [x * -1.4426950408889634],
            dtype=tl.float32,
            is_pure=True,
            pack=1,
        )
        return tl.inline_asm_elementwise(
            "rcp.approx.ftz.f32 $0, $1;", "=f,f", [e + 1.0], dtype=tl.float32, is_pure=True, pack=1
        )
    return tl.sigmoid(x)


@triton.jit
def _conv_silu(
    x,
    win,
    taps,
    rows,
    col,
    n_left,
    start,
    W: tl.constexpr,
    X_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
    FAST: tl.constexpr,
):
    """SiLU(causal conv) at `rows` (broadcasting against the channel index `col`) counted from the token x
    points at, in-sequence position `start`; 0 from row `n_left` on; fp32 rounded to x's dtype like the
    reference. Tap i reads the input i-(W-1) rows back: from x at or after the sequence start, else (only
    when `start` is 0) from the slot window row."""
    live = rows < n_left
    acc = tl.zeros(rows.shape, tl.float32) * tl.zeros(col.shape, tl.float32)
    for i in tl.static_range(W):
        j = rows - (W - 1) + i
        xv = tl.load(x + j * X_STRIDE + col, mask=live & (j >= -start), other=0.0)
        acc = tl.fma(xv.to(tl.float32), tl.load(taps + col * W + i), acc)
    if start == 0:
        for i in tl.static_range(W - 1):
            j = rows - (W - 1) + i
            wv = tl.load(win + (W - 1 + j) * WIN_STRIDE + col, mask=live & (j < 0), other=0.0)
            acc = tl.fma(wv.to(tl.float32), tl.load(taps + col * W + i), acc)
    y = acc * _sigmoid(acc, FAST)
    return y.to(x.dtype.element_ty).to(tl.float32)


@triton.jit
def _gate(f, bias, rate, lb2, rows, live, col, F_STRIDE: tl.constexpr, FAST: tl.constexpr):
    """Safe gate in log2 units, lb·σ(e^A·(f + dt_bias)), 0 on rows past the sequence end (f at the row 0
    token)."""
    fv = tl.load(f + rows * F_STRIDE + col, mask=live, other=0.0).to(tl.float32)
    return tl.where(live, lb2 * _sigmoid(rate * (fv + bias), FAST), 0.0)


@triton.jit
def _rewrite_window(
    x_end,
    win,
    cols,
    seq_len,
    W: tl.constexpr,
    WP: tl.constexpr,
    X_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
):
    """New window = the last W-1 inputs of the sequence (older ones from the old window); x_end points
    at the token W-1 rows before the sequence end."""
    r = tl.arange(0, WP)
    j = seq_len - (W - 1) + r  # in-sequence position of window row r
    live = r < W - 1
    xval = tl.load(x_end + r[:, None] * X_STRIDE + cols[None, :], mask=(live & (j >= 0))[:, None], other=0.0)
    wval = tl.load(
        win + (W - 1 + j)[:, None] * WIN_STRIDE + cols[None, :], mask=(live & (j < 0))[:, None], other=0.0
    )
    new = xval.to(tl.float32) + wval.to(tl.float32)
    tl.debug_barrier()
    tl.store(win + r[:, None] * WIN_STRIDE + cols[None, :], new.to(win.dtype.element_ty), mask=live[:, None])


@triton.jit
def _unit_lower_inverse(low, BC: tl.constexpr, PREC: tl.constexpr):
    """(I + L)⁻¹ of a batch of strictly lower 16×16 blocks: (I − L)(I + L²)(I + L⁴)(I + L⁸) (L¹⁶ = 0)."""
    r = tl.arange(0, BC)
    eye = (r[:, None] == r[None, :]).to(tl.float32)[None, :, :]
    sq2 = tl.dot(low, low, input_precision=PREC)
    sq4 = tl.dot(sq2, sq2, input_precision=PREC)
    sq8 = tl.dot(sq4, sq4, input_precision=PREC)
    inv = tl.dot(eye - low, eye + sq2, input_precision=PREC)
    inv = tl.dot(inv, eye + sq4, input_precision=PREC)
    return tl.dot(inv, eye + sq8, input_precision=PREC)


@triton.jit
def _conv_gate_kernel(
    raw,
    gate,
    conv_w,
    windows,
    seqs,
    rows_out,
    decay_c,
    scale,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    X_STRIDE: tl.constexpr,
    F_STRIDE: tl.constexpr,
    B_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
    BT: tl.constexpr,
    CONV_ROWS: tl.constexpr,
    GATE_COLS: tl.constexpr,
    BLOCK_B: tl.constexpr,
    SUBS: tl.constexpr,
    HEADS_FIRST: tl.constexpr,
    FAST_MATH: tl.constexpr,
):
    """Program (chunk, head, sub): sub < 3·BT/CONV_ROWS convolves CONV_ROWS whole rows of q, k or v (the
    norms need whole rows); the rest take GATE_COLS columns of the gate over the whole chunk (the cumulative
    sum runs down it). Bases are 64-bit per program, offsets in it 32-bit. The grid is (chunk, head, sub),
    or with HEADS_FIRST one dimension ordered head fastest, then sub, then chunk (a dimension of its own
    would cap the chunks at 65535), so that programs next to each other in launch order read the other
    heads' parts of the same rows. `raw` is the `PackedQKV`, `gate` the `GateInputs`, `windows` the slots'
    conv windows (a `SlotPool`), `seqs` the `PackedSeqs`; it writes `rows_out` (the `ChunkRows`) and
    e^{G_C} into `decay_c`."""
    if HEADS_FIRST:
        flat = tl.program_id(0)
        h, sub, pid = flat % H, (flat // H) % SUBS, flat // (H * SUBS)
    else:
        pid, h, sub = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    seq, bos, eos, chunk = _locate(seqs.cu, pid, seqs.count, BT, BLOCK_B)
    HD: tl.constexpr = H * D
    ROW_BLOCKS: tl.constexpr = BT // CONV_ROWS
    head_tile = pid.to(tl.int64) * H + h
    if sub < 3 * ROW_BLOCKS:
        part = sub // ROW_BLOCKS
        r0 = (sub % ROW_BLOCKS) * CONV_ROWS
        if part == 0:
            x = raw.q
        elif part == 1:
            x = raw.k
        else:
            x = raw.v
        x += h * D
        start = chunk * BT + r0
        rows = tl.arange(0, CONV_ROWS)[:, None]
        cols = tl.arange(0, D)
        slot = tl.load(windows.slot_ids + seq).to(tl.int64)
        win = windows.pool + slot * windows.slot_stride + part * HD + h * D
        yv = _conv_silu(
            x + (bos + start).to(tl.int64) * X_STRIDE,
            win,
            conv_w + (part * HD + h * D) * W,
            rows,
            cols[None, :],
            eos - bos - start,
            start,
            W,
            X_STRIDE,
            WIN_STRIDE,
            FAST_MATH,
        )
        tile = rows_out.y + (((pid.to(tl.int64) * 3 + part) * H + h) * BT + r0) * D
        tl.store(tile + rows * D + cols[None, :], yv.to(rows_out.y.dtype.element_ty))
        if part < 2:
            norm = tl.where(part == 0, scale, 1.0) / tl.sqrt(tl.sum(yv * yv, 1) + 1e-6)
            norm_tile = rows_out.rnorm + ((pid.to(tl.int64) * 2 + part) * H + h) * BT + r0
            tl.store(norm_tile + tl.arange(0, CONV_ROWS), norm)
        # rows ≥ CONV_ROWS ≥ W-1 never reach back before the sequence: the row block at its start is the
        # only reader of the old window of these channels, so it rewrites it
        if start == 0:
            x_end = x + (eos - (W - 1)).to(tl.int64) * X_STRIDE
            _rewrite_window(x_end, win, cols, eos - bos, W, WP, X_STRIDE, WIN_STRIDE)
    else:
        c0 = (sub - 3 * ROW_BLOCKS) * GATE_COLS
        chunk_rows = tl.arange(0, BT)[:, None]
        col = c0 + tl.arange(0, GATE_COLS)[None, :]
        live = chunk_rows < eos - bos - chunk * BT
        first_tok = (bos + chunk * BT).to(tl.int64)
        g = _gate(
            gate.f + first_tok * F_STRIDE + h * D,
            tl.load(gate.dt_bias + h * D + col),
            tl.exp(tl.load(gate.a_log + h).to(tl.float32)),
            lower_bound * 1.4426950408889634,
            chunk_rows,
            live,
            col,
            F_STRIDE,
            FAST_MATH,
        )
        tl.store(rows_out.gcum + head_tile * BT * D + chunk_rows * D + col, tl.cumsum(g, 0))
        tl.store(decay_c + head_tile * D + col, tl.exp2(tl.sum(g, 0)[None, :]))
        if c0 == 0:
            logit = tl.load(gate.b + first_tok * B_STRIDE + chunk_rows * B_STRIDE + h, mask=live, other=0.0)
            tl.store(
                rows_out.beta + head_tile * BT + chunk_rows,
                tl.where(live, tl.sigmoid(logit.to(tl.float32)), 0.0),
            )


@triton.jit
def _dot(a, b, acc, PREC: tl.constexpr):
    """acc + a @ b of fp32 tiles: `PREC` a `tl.dot` input precision, or "bf16" for both operands rounded to
    bf16 (fp32's exponent range: the anchored gate factors reach 2^±58; the products are exact in the
    fp32 accumulator)."""
    if PREC == "bf16":
        out = tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc)
    else:
        out = tl.dot(a, b, acc, input_precision=PREC)
    return out


@triton.jit
def _lower_inverse(low, low_diag, BT: tl.constexpr, BC: tl.constexpr, SOLVE_PREC: tl.constexpr,
                   MERGE_PREC: tl.constexpr):  # fmt: skip
    """(I + L)⁻¹ `[BT, BT]` of a strictly lower L given as `low` `[NB, BC, BT]` (sub-block s's rows) and its
    diagonal blocks `low_diag` `[NB, BC, BC]`: the diagonal blocks by `_unit_lower_inverse`, merged with the
    strictly-block-lower rest as X = (I − N)(I + N²) X_d, N = X_d E."""
    NB: tl.constexpr = BT // BC
    sub = tl.arange(0, NB)
    inv_diag = _unit_lower_inverse(low_diag, BC, SOLVE_PREC)
    same_block = sub[:, None, None, None] == sub[None, None, :, None]
    x_diag = tl.reshape(tl.where(same_block, inv_diag[:, :, None, :], 0.0), [BT, BT])
    r2 = tl.arange(0, BT)
    eye = (r2[:, None] == r2[None, :]).to(tl.float32)
    off_diag = tl.where((r2[None, :] // BC) < (r2[:, None] // BC), tl.reshape(low, [BT, BT]), 0.0)
    nil = _dot(x_diag, off_diag, None, MERGE_PREC)
    nil2 = _dot(nil, nil, None, MERGE_PREC)
    return _dot(_dot(eye - nil, eye + nil2, None, MERGE_PREC), x_diag, None, MERGE_PREC)


@triton.jit
def _chunk_inverse(
    rows,
    att_out,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK: tl.constexpr,
    UNROLL: tl.constexpr,
    GRAM_PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr,
):
    """X = (I + L)⁻¹ of one chunk and head, [BT, BT] fp32, from its `ChunkRows` (pointers at its q-part
    tiles, as `_chunk_outputs` takes them); stores A at `att_out`."""
    y_q, rn_q, gcum, beta = rows
    y_k, rn_k = y_q + H * BT * D, rn_q + H * BT
    NB: tl.constexpr = BT // BC
    sub = tl.arange(0, NB)
    row = tl.arange(0, BC)
    i3 = sub[:, None, None] * BC + row[None, :, None]  # [NB, BC, 1]: row in the chunk
    prev = sub[:, None, None] * BC - 1  # [NB, 1, 1]: the row before each sub-block
    anchor = lower_bound * 1.4426950408889634 * (BC // 2)
    later_block = sub[None, :, None] > sub[:, None, None]  # [s, t]: t > s
    akk = tl.zeros([NB, BC, BT], dtype=tl.float32)
    aqk = tl.zeros([NB, BC, BT], dtype=tl.float32)
    kk_diag = tl.zeros([NB, BC, BC], dtype=tl.float32)
    for c0 in tl.range(0, D, BK, loop_unroll_factor=UNROLL):
        col = c0 + tl.arange(0, BK)[None, None, :]
        yq = tl.load(y_q + i3 * D + col).to(tl.float32)
        yk = tl.load(y_k + i3 * D + col).to(tl.float32)
        before = tl.load(gcum + prev * D + col, mask=prev >= 0, other=0.0)  # gate sum before the sub-block
        local = tl.load(gcum + i3 * D + col) - before
        row_scale = tl.exp2(local - anchor)  # e^{G_i - a_s} for row i of sub-block s
        kc = yk * tl.exp2(anchor - local)  # e^{a_t - G_j} for column j of sub-block t
        # e^{a_s - G_j} = e^{a_t - G_j} e^{a_s - a_t}, the second ≤ 1 for t ≤ s; blocks t > s are not needed
        before = tl.reshape(before, [NB, BK])
        block_ratio = tl.where(later_block, 0.0, tl.exp2(before[:, None, :] - before[None, :, :]))
        cols = tl.reshape(kc[None, :, :, :] * block_ratio[:, :, None, :], [NB, BT, BK])
        cols = tl.trans(cols, (0, 2, 1))
        akk = _dot(yk * row_scale, cols, akk, GRAM_PREC)
        aqk = _dot(yq * row_scale, cols, aqk, GRAM_PREC)
        kk_diag = _dot(yk * row_scale, tl.trans(kc, (0, 2, 1)), kk_diag, GRAM_PREC)

    return _gram_inverse(akk, aqk, kk_diag, rn_q, rn_k, beta, att_out, BT, BC, SOLVE_PREC, MERGE_PREC)


@triton.jit
def _gram_inverse(
    akk,
    aqk,
    kk_diag,
    rn_q,
    rn_k,
    beta,
    att_out,
    BT: tl.constexpr,
    BC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr,
):
    """From one chunk's unnormalised Gram sums (`akk`, `aqk` `[NB, BC, BT]`: the rows of sub-block s against
    every column; `kk_diag` `[NB, BC, BC]`: each sub-block against itself) and the chunk's inverse norms of q
    and k and β (`rn_q`, `rn_k`, `beta`: pointers at its 64 rows): stores A at `att_out` and returns
    X = (I + L)⁻¹ `[BT, BT]` fp32."""
    NB: tl.constexpr = BT // BC
    sub = tl.arange(0, NB)
    row = tl.arange(0, BC)
    i3 = sub[:, None, None] * BC + row[None, :, None]  # [NB, BC, 1]: row in the chunk
    rk = tl.load(rn_k + tl.arange(0, BT))[None, None, :]
    j3 = tl.arange(0, BT)[None, None, :]
    # stored now, so that A is not kept live through the inverse
    att = tl.where(j3 <= i3, aqk * tl.load(rn_q + i3) * rk, 0.0)
    tl.store(att_out + i3 * BT + j3, att.to(att_out.dtype.element_ty))
    rk3 = tl.load(rn_k + i3)  # [NB, BC, 1]
    b3 = tl.load(beta + i3)
    low = tl.where(j3 < i3, akk * (b3 * rk3) * rk, 0.0)
    rk_cols = tl.reshape(rk3, [NB, 1, BC])
    low_diag = tl.where(row[None, None, :] < row[None, :, None], kk_diag * (b3 * rk3) * rk_cols, 0.0)
    return _lower_inverse(low, low_diag, BT, BC, SOLVE_PREC, MERGE_PREC)


@triton.jit
def _chunk_outputs(
    inv,
    rows,
    terms,
    c0,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BK: tl.constexpr,
    OUT_PREC: tl.constexpr,
):
    """Columns c0.. of w, q̄, k̄, u of one chunk and head: `rows` and `terms` are its `ChunkRows` and
    `ChunkTerms` (pointers at its q-part tiles: k's and v's conv outputs and k's norms H tiles on)."""
    y_q, rn_q, gcum, beta = rows
    y_k, y_v, rn_k = y_q + H * BT * D, y_q + 2 * H * BT * D, rn_q + H * BT
    w_out, qg_out, kg_out, u_out = terms.w, terms.qg, terms.kg, terms.u
    r = tl.arange(0, BT)[:, None]
    col = c0 + tl.arange(0, BK)[None, :]
    off = r * D + col
    # each tile is stored as soon as it is made, w last, so that few [BT, BK] tiles are live at once
    bt = tl.load(beta + r)
    u = _dot(inv, bt * tl.load(y_v + off).to(tl.float32), None, OUT_PREC)
    tl.store(u_out + off, u.to(u_out.dtype.element_ty))
    g = tl.load(gcum + off)
    decay = tl.exp2(g)
    q = tl.load(y_q + off).to(tl.float32) * tl.load(rn_q + r)
    tl.store(qg_out + off, (q * decay).to(qg_out.dtype.element_ty))
    k = tl.load(y_k + off).to(tl.float32) * tl.load(rn_k + r)
    tl.store(kg_out + off, (k * tl.exp2(tl.load(gcum + (BT - 1) * D + col) - g)).to(kg_out.dtype.element_ty))
    w = _dot(inv, bt * k * decay, None, OUT_PREC)
    tl.store(w_out + off, w.to(w_out.dtype.element_ty))


@triton.jit
def _intra_kernel(
    rows,
    terms,
    lower_bound,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    BC: tl.constexpr,
    BK1: tl.constexpr,
    BK2: tl.constexpr,
    UNROLL: tl.constexpr,
    GRAM_PREC: tl.constexpr,
    SOLVE_PREC: tl.constexpr,
    MERGE_PREC: tl.constexpr,
    OUT_PREC: tl.constexpr,
):
    """Program (chunk, head): reads the first launch's `ChunkRows`, writes the chunk's w, q̄, k̄, u and A
    into `terms` (the `ChunkTerms`; e^{G_C} there is the first launch's)."""
    pid, h = tl.program_id(0), tl.program_id(1)
    tile = (pid * H + h) * BT * D
    rows_at = ChunkRows(
        rows.y + ((pid * 3) * H + h) * BT * D,
        rows.rnorm + ((pid * 2) * H + h) * BT,
        rows.gcum + tile,
        rows.beta + (pid * H + h) * BT,
    )
    inv = _chunk_inverse(
        rows_at,
        terms.att + (pid * H + h) * BT * BT,
        lower_bound,
        H,
        D,
        BT,
        BC,
        BK1,
        UNROLL,
        GRAM_PREC,
        SOLVE_PREC,
        MERGE_PREC,
    )
    terms_at = ChunkTerms(
        terms.w + tile, terms.qg + tile, terms.kg + tile, terms.u + tile, terms.att, terms.decay_c
    )
    for c0 in tl.static_range(0, D, BK2):  # unrolled: the [BT, BT] operand is laid out once
        _chunk_outputs(
            inv,
            rows_at,
            terms_at,
            c0,
            H,
            D,
            BT,
            BK2,
            OUT_PREC,
        )


@triton.jit
def _chunk_step(
    s,
    terms,
    o_out,
    bos,
    eos,
    c,
    first,
    h,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    rk,
    rv,
):
    """One chunk: δ = u − wS, o = q̄S + Aδ, then S ← diag(e^{G_C}) S + k̄ᵀδ (`terms` the `ChunkTerms`)."""
    r = tl.arange(0, BT)
    head_tile = (first + c) * H + h
    tile = head_tile * BT * D + r[:, None] * D
    w = tl.load(terms.w + tile + rk[None, :])
    qg = tl.load(terms.qg + tile + rk[None, :])
    kg = tl.load(terms.kg + tile + rk[None, :])
    u = tl.load(terms.u + tile + rv[None, :])
    att = tl.load(terms.att + head_tile * BT * BT + r[:, None] * BT + r[None, :])
    dc = tl.load(terms.decay_c + head_tile * D + rk)
    op_ty = terms.w.dtype.element_ty
    s_op = s.to(op_ty)
    delta = (u.to(tl.float32) - tl.dot(w, s_op)).to(op_ty)
    o = tl.dot(att, delta, tl.dot(qg, s_op))
    tok = bos + c * BT + r
    out = (tok.to(tl.int64) * H + h) * D
    tl.store(o_out + out[:, None] + rv[None, :], o.to(o_out.dtype.element_ty), mask=(tok < eos)[:, None])
    return s * dc[:, None] + tl.dot(tl.trans(kg), delta)


@triton.jit
def _snapshot_after(
    s,
    chunk_idx,
    chunk_end,
    snap,
    raw,
    iv,
    h,
    rk,
    rv,
    H: tl.constexpr,
    D: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    X_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
):
    """Where packed chunk `chunk_idx` has a snapshot id in `snap` (the `SnapshotTargets`): S after it into
    that snapshot, and (value tile 0) the head's conv window, the W-1 rows of `raw` (the `PackedQKV`) before
    `chunk_end` (a token index)."""
    sid = tl.load(snap.chunk_ids + chunk_idx)
    if sid >= 0:
        base = snap.state + sid.to(tl.int64) * snap.state_stride + h * D * D
        tl.store(base + rk[:, None] * D + rv[None, :], s)
        if iv == 0:
            r = tl.arange(0, WP)
            live = (r < W - 1)[:, None]
            rows = (chunk_end - (W - 1) + r).to(tl.int64)[:, None] * X_STRIDE
            cols = h * D + tl.arange(0, D)[None, :]
            win = snap.conv + sid.to(tl.int64) * snap.conv_stride + r[:, None] * WIN_STRIDE + cols
            HD: tl.constexpr = H * D
            for part in tl.static_range(3):
                if part == 0:
                    x = raw.q
                elif part == 1:
                    x = raw.k
                else:
                    x = raw.v
                val = tl.load(x + rows + cols, mask=live, other=0.0)
                tl.store(win + part * HD, val.to(snap.conv.dtype.element_ty), mask=live)


@triton.jit
def _chunk_then_snapshot(
    s,
    terms,
    o_out,
    snap,
    raw,
    bos,
    eos,
    c,
    first,
    iv,
    h,
    rk,
    rv,
    H: tl.constexpr,
    D: tl.constexpr,
    BT: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    X_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
):
    """Chunk `c` of the sequence (`_chunk_step`), then with SNAPSHOTS its snapshot (`_snapshot_after`);
    returns S after it."""
    s = _chunk_step(s, terms, o_out, bos, eos, c, first, h, H, D, BT, rk, rv)
    if SNAPSHOTS:
        _snapshot_after(
            s, first + c, bos + (c + 1) * BT, snap, raw, iv, h, rk, rv, H, D, W, WP, X_STRIDE, WIN_STRIDE
        )
    return s


@triton.jit
def _recur_kernel(
    terms,
    o_out,
    state,
    cu,
    snap,
    raw,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    BT: tl.constexpr,
    SEQ_TILE: tl.constexpr,
    FOR_LOOP: tl.constexpr,
    STAGES: tl.constexpr,
    SNAPSHOTS: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    X_STRIDE: tl.constexpr,
    WIN_STRIDE: tl.constexpr,
):
    """Program (value tile, head, sequence) walks the sequence's chunks (`terms` the `ChunkTerms`, o `[N, H,
    d]`, `state` the states' `SlotPool`, `cu` the offsets); with SNAPSHOTS, after each chunk whose packed
    index has a snapshot id in `snap` (a `SnapshotTargets`) it leaves S and the conv window there (the rows
    of `raw`, a `PackedQKV`; `_snapshot_after`)."""
    iv, h, seq = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    # the chunks of the sequences before this one, SEQ_TILE offsets at a time: no constexpr depends on
    # the step's sequence count, so one compiled kernel serves every batch (a warm-up cannot reach them all)
    first = tl.full([], 0, tl.int64)
    start = 0
    while start < seq:
        offs = start + tl.arange(0, SEQ_TILE)
        lo = tl.load(cu + offs, mask=offs < seq, other=0).to(tl.int64)
        hi = tl.load(cu + offs + 1, mask=offs < seq, other=0).to(tl.int64)
        first += tl.sum((hi - lo + BT - 1) // BT, 0)
        start += SEQ_TILE
    bos = tl.load(cu + seq).to(tl.int64)
    eos = tl.load(cu + seq + 1).to(tl.int64)
    slot = tl.load(state.slot_ids + seq).to(tl.int64)
    rk = tl.arange(0, D)
    rv = iv * BV + tl.arange(0, BV)
    p_s = state.pool + slot * state.slot_stride + h * D * D + rk[:, None] * D + rv[None, :]
    s = tl.load(p_s)
    n_chunks = tl.cdiv(eos - bos, BT)
    if FOR_LOOP:
        for c in tl.range(0, n_chunks, num_stages=STAGES):
            s = _chunk_then_snapshot(
                s, terms, o_out, snap, raw, bos, eos, c, first, iv, h, rk, rv,
                H, D, BT, W, WP, X_STRIDE, WIN_STRIDE, SNAPSHOTS,
            )  # fmt: skip
    else:  # the interpreter cannot take a run-time bound in range()
        c = 0
        while c < n_chunks:
            s = _chunk_then_snapshot(
                s, terms, o_out, snap, raw, bos, eos, c, first, iv, h, rk, rv,
                H, D, BT, W, WP, X_STRIDE, WIN_STRIDE, SNAPSHOTS,
            )  # fmt: skip
            c += 1
    tl.store(p_s, s)


def chunk_count(cu_seqlens_cpu, num_tokens: int, num_seqs: int) -> int:
    """The chunks of the packed sequences; without host offsets (a padded batch, `cu_seqlens` on the
    device alone) the most that `num_tokens` packed tokens in `num_seqs` sequences can hold."""
    if cu_seqlens_cpu is None:
        return -(-num_tokens // BT) + num_seqs - 1
    return sum(-(-(b - a) // BT) for a, b in itertools.pairwise(cu_seqlens_cpu))


PREP_KEYS = frozenset(
    {
        "conv_rows",
        "gate_cols",
        "conv_warps",
        "intra_warps",
        "intra_stages",
        "gram_precision",
        "solve_precision",
        "merge_precision",
        "output_precision",
        "gram_unroll",
        "conv_order",
    }
)


def prefill(
    x: KDAInputs, params: KDAParams, slots: KDASlots, cu_seqlens, cu_seqlens_cpu, snapshots=None, **tuning
) -> torch.Tensor:
    """Triton twin of `reference.prefill` (see there for the arguments, `cu_seqlens_cpu` None and
    `snapshots` included: nothing is read back); returns o `[N, H, d]`.

    Needs the safe gate with -5 ≤ lower_bound < 0. `tuning` goes to `prep` (its keyword arguments) and
    `recur` (the rest)."""
    h, d = slots.state_pool.shape[1:3]
    terms = prep(
        x,
        params,
        slots,
        cu_seqlens,
        cu_seqlens_cpu,
        **{key: val for key, val in tuning.items() if key in PREP_KEYS},
    )
    # a padded batch's tokens past its last sequence are never written by `recur`
    make = torch.empty if cu_seqlens_cpu is not None else torch.zeros
    o = make(x.q.shape[0], h, d, dtype=x.q.dtype, device=x.q.device)
    recur(
        terms,
        o,
        slots,
        cu_seqlens,
        snapshots,
        x,
        **{key: val for key, val in tuning.items() if key not in PREP_KEYS},
    )
    return o


def prep(
    x: KDAInputs,
    params: KDAParams,
    slots: KDASlots,
    cu_seqlens: torch.Tensor,
    cu_seqlens_cpu: list[int] | None,
    *,
    conv_rows: int = 16,
    gate_cols: int = 32,
    conv_warps: int = 2,
    intra_warps: int = 4,
    intra_stages: int = 1,
    gram_precision: str | None = None,
    solve_precision: str = "tf32x3",
    merge_precision: str | None = None,
    output_precision: str | None = None,
    gram_unroll: int = 1,
    conv_order: str = "head",
) -> ChunkTerms:
    """The parallel launches; returns the `ChunkTerms` (w, q̄, k̄, u `[chunks, H, 64, d]`, A `[chunks, H, 64,
    64]` and e^{G_C} `[chunks, H, d]`).

    `gram_precision` / `solve_precision` / `merge_precision` / `output_precision` are the `tl.dot` modes of
    the Gram, the 16×16 inverses (tf32x3: their Neumann product amplifies rounding), the 64×64 merge and the
    w/u products: a `tl.dot` input precision for fp32 operands, or "bf16" for operands rounded to bf16. None
    takes "bf16" for bf16 activations (H100, T=13312, 64 heads: the in-chunk launch 1546 -> 1318 us, the
    output's error against the fp32 reference 3.9e-3 -> 4.4e-3, FLA's own 4.5e-3: benchmarks/RESULTS.md
    S44-1) and "tf32" otherwise; the w/u products take 64 columns at a time (32, on the H100, ended in an
    illegal address: S44-2; below 64-wide heads they take fp32 operands, as bf16 ones 32 columns wide
    fault there too: S50-2), `gram_unroll` is the unrolling of the Gram loop. The first launch convolves
    `conv_rows` rows (a power of two from W-1 to 64) per program and takes the gate in `gate_cols` columns,
    both with `conv_warps` warps; its programs run chunk after chunk of one head and part
    (`conv_order="chunk"`) or head after head of one chunk and part ("head"). The defaults measured fastest
    on the H200 (first launch at T=13312: 975 us; chunk order with 4 warps 1179 us before the fast sigmoid;
    8-row or 32/64-row conv blocks, 16/64/128-column gate blocks, 1, 4 or 8 warps, the gate's cumulative sum
    as a triangular tl.dot, and the conv taps shifted out of one tile by tl.dot were all slower:
    benchmarks/RESULTS.md, session 5; on the H100, 32-row conv blocks, 64-column gate blocks and 4 warps
    again, and the in-chunk launch on 2 warps, in 2 stages or with its Gram loop unrolled twice: S44-2).
    Moving the gate or v's conv into the in-chunk launch, so that G or v's conv output never reaches
    memory, was slower too (whole prefill 2976 / 2840 / 3074 us with the gate / v / both moved, against
    2704: the in-chunk launch's registers grow to 209-255 and it loses a CTA a SM; S46-1).
    Reads the slots' windows, not their states."""
    q, k, v, f, b = x.tensors
    conv_pool, slot_ids, lower_bound = slots.conv_pool, slots.slot_ids, params.lower_bound
    h = slots.state_pool.shape[1]
    d = q.shape[1] // h
    n_seq = slot_ids.shape[0]
    width = params.conv_weight.shape[1]
    products = "bf16" if q.dtype == torch.bfloat16 else "tf32"
    gram_precision, merge_precision = (
        products if mode is None else mode for mode in (gram_precision, merge_precision)
    )
    if output_precision is None:  # bf16 w/u products 32 columns wide end in an illegal address on the H100
        output_precision = products if d >= 64 else "tf32"
    if not -5.0 <= lower_bound < 0:
        raise ValueError(f"the chunked Triton path needs -5 <= lower_bound < 0, got {lower_bound}")
    if conv_rows not in (8, 16, 32, 64) or conv_rows < width - 1:
        raise ValueError(f"conv_rows must be 8, 16, 32 or 64 and at least {width - 1}, got {conv_rows}")
    gate_cols = min(gate_cols, d)
    if gate_cols < 1 or d % gate_cols or gate_cols & (gate_cols - 1):
        raise ValueError(f"gate_cols must be a power of two dividing the head size {d}, got {gate_cols}")
    if not (q.stride() == k.stride() == v.stride() and q.stride(1) == 1):
        raise ValueError("q, k, v must share strides with unit channel stride")
    if f.stride(1) != 1 or conv_pool.stride(2) != 1:
        raise ValueError("f and conv_pool need a unit channel stride")
    n_chunks = chunk_count(cu_seqlens_cpu, q.shape[0], n_seq)
    if conv_order not in ("chunk", "head"):
        raise ValueError(f"conv_order must be 'chunk' or 'head', got {conv_order!r}")
    heads_first = conv_order == "head"
    dev = q.device
    rows = ChunkRows(
        torch.empty(n_chunks, 3, h, BT, d, dtype=q.dtype, device=dev),
        torch.empty(n_chunks, 2, h, BT, dtype=torch.float32, device=dev),
        torch.empty(n_chunks, h, BT, d, dtype=torch.float32, device=dev),
        torch.empty(n_chunks, h, BT, dtype=torch.float32, device=dev),
    )
    decay_c = torch.empty(n_chunks, h, d, dtype=torch.float32, device=dev)
    subs = 3 * BT // conv_rows + d // gate_cols
    _conv_gate_kernel[(h * subs * n_chunks,) if heads_first else (n_chunks, h, subs)](
        PackedQKV(q, k, v),
        GateInputs(f, b, params.dt_bias, params.a_log),
        params.conv_weight,
        SlotPool.of(conv_pool, slot_ids),
        PackedSeqs(cu_seqlens, n_seq),
        rows,
        decay_c,
        d**-0.5,
        float(lower_bound),
        H=h,
        D=d,
        W=width,
        WP=triton.next_power_of_2(width - 1),
        X_STRIDE=q.stride(0),
        F_STRIDE=f.stride(0),
        B_STRIDE=b.stride(0),
        WIN_STRIDE=conv_pool.stride(1),
        BT=BT,
        CONV_ROWS=conv_rows,
        GATE_COLS=gate_cols,
        BLOCK_B=triton.next_power_of_2(n_seq + 1),
        SUBS=subs,
        HEADS_FIRST=heads_first,
        FAST_MATH=not _INTERPRET,
        num_warps=conv_warps,
    )
    terms = ChunkTerms(
        *(torch.empty(n_chunks, h, BT, d, dtype=q.dtype, device=dev) for _ in range(4)),
        torch.empty(n_chunks, h, BT, BT, dtype=q.dtype, device=dev),
        decay_c,
    )
    _intra_kernel[(n_chunks, h)](
        rows,
        terms,
        float(lower_bound),
        H=h,
        D=d,
        BT=BT,
        BC=BC,
        BK1=min(16, d),
        BK2=min(64, d),
        UNROLL=gram_unroll,
        GRAM_PREC=gram_precision,
        SOLVE_PREC=solve_precision,
        MERGE_PREC=merge_precision,
        OUT_PREC=output_precision,
        num_warps=intra_warps,
        num_stages=intra_stages,
    )
    return terms


RECUR_MIN_PROGRAMS = 64


def value_tile(heads: int, seqs: int, d: int) -> int:
    """The recurrence's value tile: the widest of 64 and 32 that still launches `RECUR_MIN_PROGRAMS`
    programs (one a sequence, head and tile), else 16. A TP8 rank's 8 heads of one 13312-token sequence:
    16 columns 218 us, 32 254, 64 332 (H100, RESULTS S40-4); 64 heads keep 64."""
    for bv in (64, 32):
        if (d // min(bv, d)) * heads * seqs >= RECUR_MIN_PROGRAMS:
            return bv
    return 16


def recur(
    terms: ChunkTerms,
    o,
    slots: KDASlots,
    cu_seqlens,
    snapshots: ChunkSnapshots | None = None,
    inputs: KDAInputs | None = None,
    *,
    block_v: int | None = None,
    stages: int = 3,
    warps: int = 4,
) -> None:
    """The sequential launch: δ = u − wS, o = q̄S + Aδ per chunk into o `[N, H, d]`, S carried through the
    slots' states; `snapshots` taken after their chunks (windows from `inputs`' pre-conv q, k, v).
    `block_v`: the value tile (default `value_tile`)."""
    state_pool, slot_ids = slots.state_pool, slots.slot_ids
    h, d = state_pool.shape[1], state_pool.shape[2]
    assert state_pool.is_contiguous()
    n_seq = slot_ids.shape[0]
    bv = min(block_v or value_tile(h, n_seq, d), d)
    if snapshots is None:  # never read: SNAPSHOTS is off
        snap, raw = SnapshotTargets(slot_ids, state_pool, 0, state_pool, 0), PackedQKV(o, o, o)
        width, x_stride, win_stride = 2, 0, 0
    else:
        assert inputs is not None
        snap = SnapshotTargets(
            snapshots.chunk_ids,
            snapshots.state,
            snapshots.state.stride(0),
            snapshots.conv,
            snapshots.conv.stride(0),
        )
        raw = PackedQKV(inputs.q, inputs.k, inputs.v)
        width, x_stride, win_stride = (
            snapshots.conv.shape[1] + 1,
            inputs.q.stride(0),
            snapshots.conv.stride(1),
        )
    # value tiles of a head next to each other in launch order: they read the same w, q̄, k̄ and A, which
    # then come from L2 once; with the sequence first, a batch larger than one wave read them twice
    _recur_kernel[(d // bv, h, n_seq)](
        terms,
        o,
        SlotPool.of(state_pool, slot_ids),
        cu_seqlens,
        snap,
        raw,
        H=h,
        D=d,
        BV=bv,
        BT=BT,
        SEQ_TILE=SEQ_TILE,
        FOR_LOOP=not _INTERPRET,
        STAGES=stages,
        SNAPSHOTS=snapshots is not None,
        W=width,
        WP=triton.next_power_of_2(max(width - 1, 1)),
        X_STRIDE=x_stride,
        WIN_STRIDE=win_stride,
        num_warps=warps,
    )


__all__ = ["BT", "chunk_count", "prefill", "prep", "recur"]
