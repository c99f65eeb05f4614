"""The rows of a `LowRank` input that a KDA decode kernel reads, computed by that kernel from the factors.

A decode step's gate pre-activation f and output-norm gate are `a [B, r] @ W[H·d, r]ᵀ` with r = d (the
layer's f_a|g_a and its per-head f_b, g_b). Each program of the step kernel and of the output norm reads
one head's d rows of such a product for one token: it computes them from the token's `a` row and the
head's [d, r] slice of W (e4m3 widened with its block scale, or as stored), accumulated in fp32 and
rounded to a's dtype as the projection's output is. Every head's slice is read by the programs of that
head only, so the weight is read once per token from memory (the value tiles of a head share it
through L2), as a projection launch would read it, and the two launches are gone. The value tiles'
recomputation of their head's rows pays only while the step is small (`recurrent.LOW_RANK_MAX_HEAD_ROWS`).

β's logits of an FP8 checkpoint are `x [B, hidden] @ W_b[H, hidden]ᵀ` in the model dtype (b_proj's rows,
left out of the e4m3 GEMM: `layers.linear.FusedLinear`). Each step program computes its head's one logit
as a dot product of the hidden size (`long_row_dots`): a runtime loop, so the compiled code does not
grow with r as the unrolled `low_rank_rows` would.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.kda.reference import LowRank

RANK_STEP = 32  # columns of W per inner step at most: a [rows, d, RANK_STEP] fp32 tile stays in registers
# columns per step of `long_row_dots`: a 2-warp step program holds 8 fp32 of each of a, W and the sums per
# thread, and a hidden size of 4096 takes 8 steps
ROW_STEP = 512


@triton.jit
def low_rank_rows(
    a_rows,
    w_ptr,
    w_scale_ptr,
    w_scale_stride,
    w_rows,
    ok,
    R: tl.constexpr,
    RB: tl.constexpr,
    FP8: tl.constexpr,
):
    """fp32 `[BR, C]`: row i is `Σ_j a_rows[i][j] · W[w_rows[i, c], j]` over the R columns of W (`[·, R]`,
    contiguous), rounded to a's dtype. `a_rows` are `[BR]` pointers to rows of a, `w_rows` `[BR, C]` row
    indices of W; rows where `ok` is false give 0. With FP8, W is e4m3 scaled per [128, 128] block by
    the fp32 `scale_inv` at `w_scale_ptr` (row stride `w_scale_stride`)."""
    acc = tl.zeros(w_rows.shape, tl.float32)
    rows = w_rows.to(tl.int64)[:, :, None]
    for j0 in tl.static_range(0, R, RB):
        j = j0 + tl.arange(0, RB)
        live = j < R
        a = tl.load(a_rows[:, None] + j[None, :], mask=ok[:, None] & live[None, :], other=0.0).to(tl.float32)
        both = ok[:, None, None] & live[None, None, :]
        w = tl.load(w_ptr + rows * R + j[None, None, :], mask=both, other=0.0).to(tl.float32)
        if FP8:
            block = (rows // 128) * w_scale_stride + (j // 128)[None, None, :]
            w = w * tl.load(w_scale_ptr + block, mask=both, other=0.0)
        acc += tl.sum(w * a[:, None, :], 2)
    return acc.to(a_rows.dtype.element_ty).to(tl.float32)


@triton.jit
def long_row_dots(a_rows, w_ptr, w_rows, ok, R: tl.constexpr, RB: tl.constexpr):
    """fp32 `[BR]`: entry i is `Σ_j a_rows[i][j] · W[w_rows[i], j]` over the R columns of W (`[·, R]`,
    contiguous, a's dtype), summed in fp32 and rounded to a's dtype; entries where `ok` is false give 0.
    `a_rows` are `[BR]` pointers to rows of a, `w_rows` `[BR]` row indices of W. The columns are walked RB
    at a time in a loop that is not unrolled (R is a hidden size)."""
    acc = tl.zeros((a_rows.shape[0], RB), tl.float32)
    rows = w_rows.to(tl.int64)[:, None] * R
    for j0 in tl.range(0, R, RB):
        j = j0 + tl.arange(0, RB)
        both = ok[:, None] & (j < R)[None, :]
        a = tl.load(a_rows[:, None] + j[None, :], mask=both, other=0.0).to(tl.float32)
        acc += a * tl.load(w_ptr + rows + j[None, :], mask=both, other=0.0).to(tl.float32)
    return tl.sum(acc, 1).to(a_rows.dtype.element_ty).to(tl.float32)


class Operands(NamedTuple):
    """What a launch takes of a `LowRank` input: the factor a and its row stride, the projection's
    (W, its scales or W itself, the scales' row stride), and the constexprs of `low_rank_rows` or
    `long_row_dots` (the rank R, its inner step RB, whether W is FP8)."""

    a: torch.Tensor
    a_stride: int
    factors: tuple[torch.Tensor, torch.Tensor, int]
    rank: int
    step: int
    fp8: bool


def operands(x: LowRank, heads: int, head_dim: int, max_step: int = RANK_STEP) -> Operands:
    """The launch operands of `x` read as `[B, heads·head_dim]`, after a ValueError naming what does not
    fit; the inner step is `max_step` columns at most (`RANK_STEP` for `low_rank_rows`, `ROW_STEP` for
    `long_row_dots`)."""
    a, w, scale = x.a, x.weight, x.scale_inv
    rank = a.shape[-1]
    if a.dim() != 2 or a.stride(-1) != 1:
        raise ValueError(
            f"LowRank: a must be [B, r] with unit column stride, got {tuple(a.shape)} {a.stride()}"
        )
    if tuple(w.shape) != (heads * head_dim, rank) or not w.is_contiguous():
        raise ValueError(
            f"LowRank: weight must be a contiguous [{heads * head_dim}, {rank}], got {tuple(w.shape)}"
        )
    step = min(max_step, triton.next_power_of_2(rank))
    if scale is None:
        if w.dtype != a.dtype:
            raise ValueError(f"LowRank: an unscaled weight must be a's dtype {a.dtype}, got {w.dtype}")
        return Operands(a, a.stride(0), (w, w, 0), rank, step, False)
    blocks = (triton.cdiv(w.shape[0], FP8_BLOCK), triton.cdiv(rank, FP8_BLOCK))
    if w.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or tuple(scale.shape) != blocks:
        raise ValueError(
            f"LowRank: a scaled weight must be float8_e4m3fn with fp32 scale_inv {blocks}, got {w.dtype} "
            f"and {scale.dtype} {tuple(scale.shape)}"
        )
    return Operands(a, a.stride(0), (w, scale, scale.stride(0)), rank, step, True)
