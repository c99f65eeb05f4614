"""Triton sigmoid-gated RMSNorm per head: `RMSNorm(x)·w·σ(gate)` in fp32, one pass over x and gate; in a
decode step it also advances the conv windows (`WindowStep`), which the step kernel before it only read."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.kda import low_rank
from hylo.ops.kda.low_rank import low_rank_rows
from hylo.ops.kda.operands import RawQKV, ScaledWeight, WindowPool
from hylo.ops.kda.reference import KDAInputs, KDASlots, LowRank, OutputNorm


@dataclass(frozen=True)
class WindowStep:
    """A decode step's raw inputs `x` (one token per sequence, `[B, H·d]` each) whose window step (every
    slot's conv window shifted by one, the new input last) runs with the output norm of its sequences."""

    x: KDAInputs
    slots: KDASlots


@triton.jit
def _step_window(win, x, ok, win_stride, W: tl.constexpr, WP: tl.constexpr):
    """Shift the windows at `win` ([BR, D] pointers to their row 0) by one token, `x` ([BR, D] pointers)
    last: every row is read before any is written."""
    r = tl.arange(0, WP)[None, :, None]
    live = ok[:, None, None]
    old = tl.load(win[:, None, :] + (r + 1) * win_stride, mask=live & (r < W - 2), other=0.0)
    new = tl.load(x[:, None, :] + r * 0, mask=live & (r == W - 2), other=0.0)
    tl.debug_barrier()  # the program's threads have read the rows they will overwrite
    tl.store(win[:, None, :] + r * win_stride, old + new.to(old.dtype), mask=live & (r < W - 1))


@triton.jit
def _gated_norm_kernel(
    x, gate, gate_sb, w, y, n_rows, eps, raw, windows, slot_ids, g_w,
    D: tl.constexpr, BR: tl.constexpr, H: tl.constexpr, W: tl.constexpr, WP: tl.constexpr,
    ADVANCE: tl.constexpr, G_RANK: tl.constexpr, G_STEP: tl.constexpr, G_FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Rows `BR·pid + [0, BR)` of x (one head of one token each); with ADVANCE, row s·H + h also steps
    sequence s's window at head h's q, k and v channels (no other program touches them; `raw` the step's
    `RawQKV`, `windows` the `WindowPool`). With G_RANK > 0 `gate` is the low-rank factor a `[tokens,
    G_RANK]` (row stride `gate_sb`) of the gate, whose rows the program computes with the projection `g_w`
    (a `ScaledWeight`; `low_rank.low_rank_rows`)."""
    enter(PDL)
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    cols = tl.arange(0, D)
    ok = rows < n_rows
    offs = rows.to(tl.int64)[:, None] * D + cols[None, :]
    xv_ = tl.load(x + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    if G_RANK > 0:
        token, head = rows // H, rows % H
        a_rows = gate + token.to(tl.int64) * gate_sb
        g_rows = head[:, None] * D + cols[None, :]
        gv = low_rank_rows(a_rows, g_w.weight, g_w.scale, g_w.scale_stride, g_rows, ok, G_RANK, G_STEP, G_FP8)
    else:
        gv = tl.load(gate + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(xv_ * xv_, 1) / D + eps)
    out = xv_ * r[:, None] * tl.load(w + cols).to(tl.float32)[None, :] * tl.sigmoid(gv)
    tl.store(y + offs, out.to(y.dtype.element_ty), mask=ok[:, None])
    if ADVANCE:
        seq, head = rows // H, rows % H
        slot = tl.load(slot_ids + seq, mask=ok, other=0).to(tl.int64)
        win = windows.pool + slot[:, None] * windows.slot_stride + head[:, None] * D + cols[None, :]
        src = seq.to(tl.int64)[:, None] * raw.seq_stride + head[:, None] * D + cols[None, :]
        _step_window(win, raw.q + src, ok, windows.row_stride, W, WP)
        _step_window(win + H * D, raw.k + src, ok, windows.row_stride, W, WP)
        _step_window(win + 2 * H * D, raw.v + src, ok, windows.row_stride, W, WP)


def gated_rms_norm(x: torch.Tensor, norm: OutputNorm, window: WindowStep | None = None) -> torch.Tensor:
    """Triton twin of `reference.gated_rms_norm` for `x [N, H, d]` and a gate of as many elements; with
    `window` (x is then `[B, H, d]`, a decode step's output) the same launch steps its sequences' conv
    windows, which must no longer be read by anything launched before it that has not finished (stream
    order guarantees it)."""
    d, heads = x.shape[-1], x.shape[-2]
    x = x.contiguous()
    y = torch.empty_like(x)
    n_rows = x.numel() // d
    if window is None:
        advance, br = (RawQKV(x, x, x, 0, 0), WindowPool(x, 0, 0), x), max(1, 4096 // d)  # unread
        width = 2
    else:
        q, pool = window.x.q, window.slots.conv_pool
        assert q.stride() == window.x.k.stride() == window.x.v.stride() and q.stride(-1) == 1
        raw = RawQKV(q, window.x.k, window.x.v, q.stride(0), 0)  # one token a sequence
        advance = (raw, WindowPool.of(pool), window.slots.slot_ids)
        br, width = max(1, 1024 // d), pool.shape[1] + 1  # more programs: each also moves 9 window rows
    if isinstance(norm.gate, LowRank):
        factor = low_rank.operands(norm.gate, heads, d)
        if x.dim() != 3 or factor.a.shape[0] != x.shape[0]:
            raise ValueError(f"gated_rms_norm: a LowRank gate needs x [tokens, H, d], got {tuple(x.shape)}")
        gate, factors = (factor.a, factor.a_stride), ScaledWeight(*factor.factors)
        constants = dict(G_RANK=factor.rank, G_STEP=factor.step, G_FP8=factor.fp8)
        br = 1  # one head's [d, r] slice of the projection per program: all programs share the read
    else:
        gate, factors = (norm.gate.reshape(x.shape).contiguous(), 0), ScaledWeight(x, x, 0)  # unread
        constants = dict(G_RANK=0, G_STEP=1, G_FP8=False)
    dependent = dependent_launches(x.device)
    _gated_norm_kernel[(triton.cdiv(n_rows, br),)](
        x, *gate, norm.weight, y, n_rows, norm.eps, *advance, factors,
        D=d, BR=br, H=heads, W=width, WP=triton.next_power_of_2(width), ADVANCE=window is not None,
        **constants, num_warps=4,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return y
