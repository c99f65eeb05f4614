"""Triton grouped block conv: `reference.grouped_block_conv` in one launch (the reference's pad, kernel
add, flip, multiply and sum are five). One program per (block row, slice of H); the taps are a
static loop. Rounding as the reference's: the kernel sum and each product round to x's dtype, the
sum over taps accumulates in fp32 and rounds once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _grouped_block_conv_kernel(
    x_ptr, base_ptr, deltas_ptr, out_ptr, rows_per_block, hidden,
    stride_xr, stride_xb, stride_base, stride_dr, stride_db, stride_dt, stride_or, stride_ob,
    TAPS: tl.constexpr, GROUP_SIZE: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    i = tl.program_id(1)
    h = tl.program_id(2) * BLOCK_H + tl.arange(0, BLOCK_H)
    inside = h < hidden
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], tl.float32)
    for t in tl.static_range(TAPS):
        if i >= t:  # a tap before the block start reads zeros
            base = tl.load(base_ptr + t * stride_base + h, mask=inside, other=0.0)
            delta = tl.load(deltas_ptr + r * stride_dr + i * stride_db + t * stride_dt + h // GROUP_SIZE,
                            mask=inside, other=0.0)  # fmt: skip
            kernel = (base.to(tl.float32) + delta.to(tl.float32)).to(dtype)
            x = tl.load(x_ptr + r * stride_xr + (i - t) * stride_xb + h, mask=inside, other=0.0)
            acc += (kernel.to(tl.float32) * x.to(tl.float32)).to(dtype).to(tl.float32)
    tl.store(out_ptr + r * stride_or + i * stride_ob + h, acc.to(dtype), mask=inside)


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
        x, base_kernel, deltas, out, rows, hidden,
        x.stride(0), x.stride(1), base_kernel.stride(0), deltas.stride(0), deltas.stride(1), deltas.stride(2),
        out.stride(0), out.stride(1),
        TAPS=base_kernel.shape[0], GROUP_SIZE=group_size, BLOCK_H=block_h, num_warps=4,
    )  # fmt: skip
    return out
