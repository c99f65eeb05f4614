"""Triton KDA step kernels over the slot pool: conv window steps, decode, one-launch verify, commit.

The sequential kernel serves three modes. Each program owns one (sequence, head, value tile) of S
(`[d_k, BV]` fp32, kept in registers) and walks the sequence's T tokens:

    S ← diag(e^{g_t}) S;  S ← S + β_t k_t (v_t − Sᵀk_t)ᵀ;  o_t = Sᵀ q_t

- decode: T = 1, o written, S stored back in place;
- verify: T = k+1 tokens from the committed S in one launch, o written for every t, S not stored
  (optionally the state after every step, for the per-step-state alternative);
- commit: replays the first n_accepted[b] verified tokens onto the committed S and stores it.

With the safe gate, verify and commit instead treat the T ≤ 32 tokens as one chunk of the chunked
form (`_one_chunk_kernel`): o = q'S + A u is one tensor-core product against S and the commit
S ← e^{G_C} S + k̄ᵀ(u − wS) two, with no step-to-step dependency.

The conv kernel computes SiLU(conv) for T tokens continuing from the slot window and, for decode and
commit, rewrites the window with the last K-1 consumed inputs (its first n[b] tokens).
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from hylo.ops.kda.reference import VerifyCache

_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def _conv_part(
    x,
    x_sb,
    x_st,
    win,
    win_stride,
    wt,
    y,
    y_sb,
    y_st,
    bi,
    c,
    ch,
    n,
    T: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    WRITE_Y: tl.constexpr,
    WRITE_WIN: tl.constexpr,
):
    """One of q|k|v: columns `c` of x are channels `ch` of the window, weight and y."""
    xb = x + bi.to(tl.int64) * x_sb
    if WRITE_Y:
        for t in tl.static_range(T):
            acc = tl.zeros([c.shape[0]], dtype=tl.float32)
            for i in tl.static_range(W):
                if t - (W - 1) + i >= 0:
                    z = tl.load(xb + (t - (W - 1) + i) * x_st + c)
                else:
                    z = tl.load(win + (t + i) * win_stride + ch)
                acc += z.to(tl.float32) * tl.load(wt + ch * W + i)
            tl.store(
                y + bi.to(tl.int64) * y_sb + t * y_st + ch, (acc * tl.sigmoid(acc)).to(y.dtype.element_ty)
            )
    if WRITE_WIN:
        r = tl.arange(0, WP)
        j = n - (W - 1) + r
        live = r < W - 1
        xval = tl.load(xb + j[:, None] * x_st + c[None, :], mask=(live & (j >= 0))[:, None], other=0.0)
        wval = tl.load(
            win + (W - 1 + j)[:, None] * win_stride + ch[None, :], mask=(live & (j < 0))[:, None], other=0.0
        )
        new = xval.to(tl.float32) + wval.to(tl.float32)
        tl.debug_barrier()
        tl.store(
            win + r[:, None] * win_stride + ch[None, :], new.to(win.dtype.element_ty), mask=live[:, None]
        )


@triton.jit
def _conv_kernel(
    xq,
    xk,
    xv,
    x_sb,
    x_st,
    pool,
    pool_stride,
    win_stride,
    slot_ids,
    weight,
    y,
    y_sb,
    y_st,
    n_keep,
    T: tl.constexpr,
    HD: tl.constexpr,
    W: tl.constexpr,
    WP: tl.constexpr,
    BC: tl.constexpr,
    WRITE_Y: tl.constexpr,
    WRITE_WIN: tl.constexpr,
    PER_SEQ: tl.constexpr,
):
    bi, cb = tl.program_id(0), tl.program_id(1)
    c = cb * BC + tl.arange(0, BC)
    win = pool + tl.load(slot_ids + bi).to(tl.int64) * pool_stride
    n = T
    if PER_SEQ:
        n = tl.load(n_keep + bi)
    _conv_part(
        xq, x_sb, x_st, win, win_stride, weight, y, y_sb, y_st, bi, c, c, n, T, W, WP, WRITE_Y, WRITE_WIN
    )
    _conv_part(
        xk, x_sb, x_st, win, win_stride, weight, y, y_sb, y_st, bi, c, HD + c, n, T, W, WP, WRITE_Y, WRITE_WIN
    )
    _conv_part(
        xv,
        x_sb,
        x_st,
        win,
        win_stride,
        weight,
        y,
        y_sb,
        y_st,
        bi,
        c,
        2 * HD + c,
        n,
        T,
        W,
        WP,
        WRITE_Y,
        WRITE_WIN,
    )


@triton.jit
def _recurrent_kernel(
    qkv, qkv_sb, qkv_st, f, f_sb, f_st, b, b_sb, b_st, dt_bias, a_log, state_pool, pool_stride, slot_ids,
    n_steps, o, o_sb, o_st, steps, scale, lower_bound,
    T: tl.constexpr, TP: tl.constexpr, H: tl.constexpr, D: tl.constexpr, BV: tl.constexpr,
    USE_LB: tl.constexpr, WRITE_O: tl.constexpr, STORE_STATE: tl.constexpr, PER_SEQ: tl.constexpr,
    STEP_STATES: tl.constexpr,
):  # fmt: skip
    bi, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bi64 = bi.to(tl.int64)
    slot = tl.load(slot_ids + bi).to(tl.int64)
    rk = tl.arange(0, D)
    rv = iv * BV + tl.arange(0, BV)
    rt = tl.arange(0, TP)
    p_s = state_pool + slot * pool_stride + h * D * D + rk[:, None] * D + rv[None, :]
    s = tl.load(p_s)

    # every token's inputs up front: the steps below then only compute
    live = rt < T
    if PER_SEQ:
        live = rt < tl.load(n_steps + bi)
    row = qkv + bi64 * qkv_sb + rt[:, None] * qkv_st + h * D
    q = tl.load(row + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    k = tl.load(row + H * D + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    v = tl.load(row + 2 * H * D + rv[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    x = tl.load(f + bi64 * f_sb + rt[:, None] * f_st + h * D + rk[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32) + tl.load(dt_bias + h * D + rk).to(tl.float32)[None, :]
    rate = tl.exp(tl.load(a_log + h).to(tl.float32))
    if USE_LB:
        g = lower_bound * tl.sigmoid(rate * x)
    else:
        g = -rate * tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    decay = tl.where(live[:, None], tl.exp(g), 1.0)  # a dead step leaves S exactly as it is
    beta = tl.load(b + bi64 * b_sb + rt * b_st + h, mask=live, other=0.0).to(tl.float32)
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
        p_o = o + bi64 * o_sb + rt[:, None] * o_st + h * D + rv[None, :]
        tl.store(p_o, out.to(o.dtype.element_ty), mask=(rt < T)[:, None])
    if STORE_STATE:
        tl.store(p_s, s)


@triton.jit
def _inv_unit_lower(lt, N: tl.constexpr):
    """(I + L)⁻¹ of a strictly lower N×N matrix given transposed (lt[j, i] = L[i, j])."""
    rows = tl.arange(0, N)
    x = tl.zeros([N, N], dtype=tl.float32)
    for i in range(N):
        col = tl.sum(tl.where(rows[None, :] == i, lt, 0.0), 1)
        r = tl.where(rows == i, 1.0, 0.0) - tl.sum(col[:, None] * x, 0)
        x = tl.where(rows[:, None] == i, r[None, :], x)
    return x


@triton.jit
def _one_chunk_kernel(
    qkv,
    qkv_sb,
    qkv_st,
    f,
    f_sb,
    f_st,
    b,
    b_sb,
    b_st,
    dt_bias,
    a_log,
    state_pool,
    pool_stride,
    slot_ids,
    n_steps,
    o,
    o_sb,
    o_st,
    scale,
    lower_bound,
    T: tl.constexpr,
    TP: tl.constexpr,
    H: tl.constexpr,
    D: tl.constexpr,
    BV: tl.constexpr,
    WRITE_O: tl.constexpr,
    STORE_STATE: tl.constexpr,
    PER_SEQ: tl.constexpr,
    PREC: tl.constexpr,
):
    """The T ≤ 32 steps of one request as one chunk (safe gate): o = q'S + A u, S ← e^{G_C}S + k̄ᵀ(u − wS)."""
    bi, h, iv = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    bi64 = bi.to(tl.int64)
    rt = tl.arange(0, TP)
    rk = tl.arange(0, D)
    rv = iv * BV + tl.arange(0, BV)
    live = rt < T
    if PER_SEQ:
        live = rt < tl.load(n_steps + bi)
    row = qkv + bi64 * qkv_sb + rt[:, None] * qkv_st + h * D
    q = tl.load(row + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    k = tl.load(row + H * D + rk[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    v = tl.load(row + 2 * H * D + rv[None, :], mask=live[:, None], other=0.0).to(tl.float32)
    x = tl.load(f + bi64 * f_sb + rt[:, None] * f_st + h * D + rk[None, :], mask=live[:, None], other=0.0)
    x = x.to(tl.float32) + tl.load(dt_bias + h * D + rk).to(tl.float32)[None, :]
    lb2 = lower_bound * 1.4426950408889634
    g = tl.where(live[:, None], lb2 * tl.sigmoid(tl.exp(tl.load(a_log + h).to(tl.float32)) * x), 0.0)
    beta = tl.load(b + bi64 * b_sb + rt * b_st + h, mask=live, other=0.0).to(tl.float32)
    beta = tl.where(live, tl.sigmoid(beta), 0.0)
    k = k / tl.sqrt(tl.sum(k * k, 1) + 1e-6)[:, None]
    gs = tl.cumsum(g, 0)
    g_c = tl.sum(g, 0)
    m = tl.sum(tl.where(rt[:, None] == 0, gs, 0.0), 0) + lb2 * (TP - 1) / 2
    kr = k * tl.exp2(m[None, :] - gs)
    lt = tl.dot(kr, tl.trans(k * tl.exp2(gs - m[None, :])), input_precision=PREC)
    lt = tl.where(rt[None, :] > rt[:, None], lt * beta[None, :], 0.0)
    xinv = _inv_unit_lower(lt, TP)
    eg = tl.exp2(gs)
    w = tl.dot(xinv, beta[:, None] * k * eg, input_precision=PREC)
    u = tl.dot(xinv, beta[:, None] * v, input_precision=PREC)
    p_s = (
        state_pool
        + tl.load(slot_ids + bi).to(tl.int64) * pool_stride
        + h * D * D
        + rk[:, None] * D
        + rv[None, :]
    )
    s = tl.load(p_s)
    if WRITE_O:
        q = q * (scale / tl.sqrt(tl.sum(q * q, 1) + 1e-6))[:, None]
        a = tl.dot(q * tl.exp2(gs - m[None, :]), tl.trans(kr), input_precision=PREC)
        a = tl.where(rt[:, None] >= rt[None, :], a, 0.0)
        qp = q * eg - tl.dot(a, w, input_precision=PREC)
        out = tl.dot(qp, s, input_precision=PREC) + tl.dot(a, u, input_precision=PREC)
        p_o = o + bi64 * o_sb + rt[:, None] * o_st + h * D + rv[None, :]
        tl.store(p_o, out.to(o.dtype.element_ty), mask=(rt < T)[:, None])
    if STORE_STATE:
        upd = u - tl.dot(w, s, input_precision=PREC)
        kg = k * tl.exp2(g_c[None, :] - gs)
        s = s * tl.exp2(g_c)[:, None] + tl.dot(tl.trans(kg), upd, input_precision=PREC)
        tl.store(p_s, s)


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


def conv_steps(q, k, v, conv_weight, conv_pool, slot_ids, *, write_y=True, write_window=False, n_keep=None):
    """SiLU(causal conv) of `[B, T, H·d]` q|k|v continuing from the slot windows. Returns y `[B, T, 3·H·d]`
    (when `write_y`); with `write_window` the window advances by T tokens, or by `n_keep[b]`."""
    bsz, t, hd = q.shape
    assert q.stride() == k.stride() == v.stride() and q.stride(2) == 1 and conv_pool.stride(2) == 1
    y = torch.empty(bsz, t, 3 * hd, dtype=q.dtype, device=q.device) if write_y else q
    width = conv_pool.shape[1] + 1
    bc = min(512, triton.next_power_of_2(hd))
    assert hd % bc == 0
    _conv_kernel[(bsz, hd // bc)](
        q,
        k,
        v,
        q.stride(0),
        q.stride(1),
        conv_pool,
        conv_pool.stride(0),
        conv_pool.stride(1),
        slot_ids,
        conv_weight if write_y else conv_pool,
        y,
        y.stride(0),
        y.stride(1),
        n_keep if n_keep is not None else slot_ids,
        T=t,
        HD=hd,
        W=width,
        WP=triton.next_power_of_2(width - 1),
        BC=bc,
        WRITE_Y=write_y,
        WRITE_WIN=write_window,
        PER_SEQ=n_keep is not None,
        num_warps=4,
    )
    return y if write_y else None


def _block_v(bsz: int, h: int, d: int, t: int) -> tuple[int, int]:
    """(BV, num_warps) of the sequential kernel, the fastest measured on the H200 (benchmarks/RESULTS.md):
    narrow tiles while the batch leaves SMs idle, 64-wide tiles with 4 warps beyond."""
    if t == 1 and bsz * h <= 64:
        return min(16, d), 2
    if t == 1 and bsz * h <= 512:
        return min(32, d), 4
    return min(64, d), 4


def recurrent(
    qkv,
    f,
    b,
    dt_bias,
    a_log,
    state_pool,
    slot_ids,
    lower_bound,
    *,
    write_o=True,
    store_state=True,
    n_steps=None,
    step_states=None,
    block_v=None,
    num_warps=None,
):
    """The step kernel on conv outputs `qkv [B, T, 3·H·d]`, f `[B, T, H·d]`, b `[B, T, H]`; see the module
    docstring for the modes. Returns o `[B, T, H, d]` when `write_o`."""
    bsz, t, _ = qkv.shape
    h, d = state_pool.shape[1], state_pool.shape[2]
    assert qkv.stride(2) == 1 and f.stride(2) == 1 and state_pool.is_contiguous()
    o = torch.empty(bsz, t, h, d, dtype=qkv.dtype, device=qkv.device) if write_o else qkv
    bv, warps = _block_v(bsz, h, d, t)
    bv, warps = block_v or bv, num_warps or warps
    use_lb = lower_bound is not None
    _recurrent_kernel[(bsz, h, d // bv)](
        qkv,
        qkv.stride(0),
        qkv.stride(1),
        f,
        f.stride(0),
        f.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        dt_bias,
        a_log,
        state_pool,
        state_pool.stride(0),
        slot_ids,
        n_steps if n_steps is not None else slot_ids,
        o,
        o.stride(0),
        o.stride(1) if write_o else 0,
        step_states if step_states is not None else state_pool,
        d**-0.5,
        float(lower_bound) if use_lb else 0.0,
        T=t,
        TP=triton.next_power_of_2(t),
        H=h,
        D=d,
        BV=bv,
        USE_LB=use_lb,
        WRITE_O=write_o,
        STORE_STATE=store_state,
        PER_SEQ=n_steps is not None,
        STEP_STATES=step_states is not None,
        num_warps=warps,
    )
    return o if write_o else None


def one_chunk(
    qkv,
    f,
    b,
    dt_bias,
    a_log,
    state_pool,
    slot_ids,
    lower_bound,
    *,
    write_o=True,
    store_state=False,
    n_steps=None,
    block_v=None,
    num_warps=None,
    precision=None,
):
    """Verify (`write_o`) or commit (`store_state`, first `n_steps[b]` tokens) of T ≤ 32 tokens per request
    as one chunk; needs the safe gate (-5 ≤ lower_bound < 0). Returns o `[B, T, H, d]` when `write_o`."""
    bsz, t, _ = qkv.shape
    h, d = state_pool.shape[1], state_pool.shape[2]
    assert t <= 32 and lower_bound is not None and -5.0 <= lower_bound < 0
    assert qkv.stride(2) == 1 and f.stride(2) == 1 and state_pool.is_contiguous()
    o = torch.empty(bsz, t, h, d, dtype=qkv.dtype, device=qkv.device) if write_o else qkv
    bv, warps = block_v or min(64, d), num_warps or 4
    _one_chunk_kernel[(bsz, h, d // bv)](
        qkv,
        qkv.stride(0),
        qkv.stride(1),
        f,
        f.stride(0),
        f.stride(1),
        b,
        b.stride(0),
        b.stride(1),
        dt_bias,
        a_log,
        state_pool,
        state_pool.stride(0),
        slot_ids,
        n_steps if n_steps is not None else slot_ids,
        o,
        o.stride(0),
        o.stride(1) if write_o else 0,
        d**-0.5,
        float(lower_bound),
        T=t,
        TP=max(16, triton.next_power_of_2(t)),
        H=h,
        D=d,
        BV=bv,
        WRITE_O=write_o,
        STORE_STATE=store_state,
        PER_SEQ=n_steps is not None,
        PREC=precision or ("ieee" if _INTERPRET else "tf32x3"),
        num_warps=warps,
    )
    return o if write_o else None


def _chunkable(t: int, lower_bound) -> bool:
    return t <= 32 and lower_bound is not None and -5.0 <= lower_bound < 0


def decode(q, k, v, f, b, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, lower_bound, **kw):
    """Triton twin of `reference.decode`: one token per sequence, window and state updated in place."""
    qkv = conv_steps(q[:, None], k[:, None], v[:, None], conv_weight, conv_pool, slot_ids, write_window=True)
    o = recurrent(qkv, f[:, None], b[:, None], dt_bias, a_log, state_pool, slot_ids, lower_bound, **kw)
    return o[:, 0]


def verify(
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
    lower_bound,
    step_states=None,
    **kw,
):
    """Triton twin of `reference.verify`: one conv launch and one launch for all T tokens (the one-chunk
    kernel; the sequential one for other gates or when `step_states` are wanted)."""
    qkv = conv_steps(q, k, v, conv_weight, conv_pool, slot_ids)
    if step_states is None and _chunkable(q.shape[1], lower_bound):
        o = one_chunk(qkv, f, b, dt_bias, a_log, state_pool, slot_ids, lower_bound, **kw)
    else:
        o = recurrent(
            qkv,
            f,
            b,
            dt_bias,
            a_log,
            state_pool,
            slot_ids,
            lower_bound,
            store_state=False,
            step_states=step_states,
            **kw,
        )
    return o, VerifyCache(q, k, v, f, b, qkv)


def commit(
    cache, conv_weight, dt_bias, a_log, conv_pool, state_pool, slot_ids, n_accepted, lower_bound, **kw
):
    """Triton twin of `reference.commit`: replay n_accepted[b] steps (one launch), advance the window."""
    qkv = cache.qkv
    if qkv is None:
        qkv = conv_steps(cache.q, cache.k, cache.v, conv_weight, conv_pool, slot_ids)
    n = n_accepted.to(torch.int32)
    step = one_chunk if _chunkable(qkv.shape[1], lower_bound) else recurrent
    step(
        qkv,
        cache.f,
        cache.b,
        dt_bias,
        a_log,
        state_pool,
        slot_ids,
        lower_bound,
        write_o=False,
        store_state=True,
        n_steps=n,
        **kw,
    )
    conv_steps(
        cache.q, cache.k, cache.v, None, conv_pool, slot_ids, write_y=False, write_window=True, n_keep=n
    )


def commit_steps(cache, step_states, conv_pool, state_pool, slot_ids, n_accepted) -> None:
    """Triton twin of `reference.commit_steps`: copy the saved state of step n_accepted[b]."""
    bsz, t, h, d, _ = step_states.shape
    n = n_accepted.to(torch.int32)
    blk = min(4096, d * d)
    _take_step_kernel[(bsz, h, d * d // blk)](
        step_states, t, state_pool, state_pool.stride(0), slot_ids, n, H=h, DD=d * d, BLK=blk, num_warps=4
    )
    conv_steps(
        cache.q, cache.k, cache.v, None, conv_pool, slot_ids, write_y=False, write_window=True, n_keep=n
    )
