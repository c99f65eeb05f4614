"""Triton FP8 activation quantisation: `quantize_groups` (per token and 128-channel group, the twin of
`hylo.ops.fp8.quantize_fp8_groups`) and `quantize_tile`, which other kernels call to quantise a tile
in registers. Bit for bit the torch reference's values (`round_to_e4m3`, IEEE division)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.fp8 import FP8_BLOCK


@triton.jit
def round_to_e4m3(v):
    """v (|v| ≤ 448) rounded to the nearest e4m3 value, ties to even, in fp32: adding and removing
    1.5·2^(e+20) drops all but 3 mantissa bits (the step is 2^-9 below 2^-6). The cast to fp8 that
    follows is then exact, so the GPU and the Triton interpreter (which mis-rounds values that
    carry into the next binade) store the same bits as torch."""
    magnitude = tl.abs(v)
    binade = (magnitude.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    shift = tl.maximum(binade, 0.015625) * 1572864.0
    rounded = (magnitude + shift) - shift
    return tl.where(v < 0, -rounded, rounded)


@triton.jit
def group_scale(amax):
    """amax / 448 (at least 1e-12 / 448) with IEEE division, as torch divides (Triton's `/` may not)."""
    clamped = tl.maximum(amax, 1e-12)
    return tl.math.div_rn(clamped, tl.full(clamped.shape, 448.0, tl.float32))


@triton.jit
def quantize_rows(x):
    """Each row of the fp32 tile `x` as e4m3 values (in fp32, exact to cast) and its fp32 scale."""
    scale = group_scale(tl.max(tl.abs(x), axis=1))
    return round_to_e4m3(tl.math.div_rn(x, tl.broadcast_to(scale[:, None], x.shape))), scale


@triton.jit
def quantize_tile(
    x_ptr, q_ptr, scale_ptr, rows, group, num_rows, stride_x, stride_q, stride_s, K: tl.constexpr
):
    """Rows `rows` of x, channel group `group` (128 wide): e4m3 values and their fp32 scale."""
    cols = group * 128 + tl.arange(0, 128)
    ok = (rows < num_rows)[:, None] & (cols < K)[None, :]
    x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_x + cols[None, :], mask=ok, other=0.0).to(
        tl.float32
    )
    q, scale = quantize_rows(x)
    tl.store(
        q_ptr + rows[:, None].to(tl.int64) * stride_q + cols[None, :], q.to(q_ptr.dtype.element_ty), mask=ok
    )
    tl.store(scale_ptr + rows * stride_s + group, scale, mask=rows < num_rows)


@triton.jit
def _quantize_groups_kernel(
    x_ptr, q_ptr, scale_ptr, num_rows, stride_x, stride_q, stride_s, K: tl.constexpr, BLOCK_T: tl.constexpr
):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    quantize_tile(x_ptr, q_ptr, scale_ptr, rows, tl.program_id(1), num_rows, stride_x, stride_q, stride_s, K)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton `hylo.ops.fp8.quantize_fp8_groups`: (e4m3 `[T, K]`, fp32 scale `[T, ceil(K/128)]`)."""
    x = x.contiguous()
    rows, k = x.shape
    q = torch.empty(rows, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(rows, triton.cdiv(k, FP8_BLOCK), dtype=torch.float32, device=x.device)
    if rows:
        grid = (triton.cdiv(rows, 16), scale.shape[1])
        _quantize_groups_kernel[grid](
            x, q, scale, rows, x.stride(0), q.stride(0), scale.stride(0), K=k, BLOCK_T=16
        )
    return q, scale
