"""Triton grouped block conv: `reference.grouped_block_conv` in one launch (the reference's pad, kernel
add, flip, multiply and sum are five). One program per (block row, slice of H); the taps are a
static loop. Rounding as the reference's: the kernel sum and each product round to x's dtype, the
sum over taps accumulates in fp32 and rounds once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.block_conv.operands import BlockRows, ConvKernel


@triton.jit
def _grouped_block_conv_kernel(
    x, kernel, out, hidden, TAPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Program (r, i, j) writes channels j·BLOCK_H.. of row i of block r of `out` from `x` (both
    `BlockRows`, `[R, B, hidden]`) and that row's taps of `kernel` (`ConvKernel`)."""
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = h < hidden
    dtype = x.data.dtype.element_ty
    acc = tl.zeros([BLOCK_H], tl.float32)
    deltas = kernel.deltas + r * kernel.block_stride + i * kernel.row_stride
    for t in tl.static_range(TAPS):
        if i >= t:  # a tap before the block start reads zeros
            base = tl.load(kernel.base + t * kernel.base_tap_stride + h, mask=inside, other=0.0)
            delta = tl.load(deltas + t * kernel.tap_stride + h // GROUP_SIZE, mask=inside, other=0.0)
            tap = (base.to(tl.float32) + delta.to(tl.float32)).to(dtype)
            xv = tl.load(x.data + r * x.block_stride + (i - t) * x.row_stride + h, mask=inside, other=0.0)
            acc += (tap.to(tl.float32) * xv.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out.data + r * out.block_stride + i * out.row_stride + h, acc.to(dtype), mask=inside)


def grouped_block_conv(
    x: torch.Tensor, base_kernel: torch.Tensor, deltas: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Triton twin of `reference.grouped_block_conv` for the calls `refusal` takes."""
    blocks, rows, hidden = x.shape
    out = torch.empty(blocks, rows, hidden, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    block_h = min(triton.next_power_of_2(hidden), 1024)
    _grouped_block_conv_kernel[(blocks, rows, triton.cdiv(hidden, block_h))](
        BlockRows.of(x), ConvKernel.of(base_kernel, deltas), BlockRows.of(out), hidden,
        TAPS=base_kernel.shape[0], GROUP_SIZE=group_size, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out
