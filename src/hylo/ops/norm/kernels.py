"""Triton RMSNorm: one pass over each row (read once, written once), the reference's roundings kept:
fp32 statistics, the normalised row rounded to the input dtype, then scaled by the weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x, w, y, x_row_stride, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    xv = tl.load(x + row * x_row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / width + eps)
    normed = (xv * inv).to(x.dtype.element_ty).to(tl.float32)
    out = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32) * normed
    tl.store(y + row * width + cols, out.to(y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Triton twin of `reference.rms_norm` for `x` whose rows have a unit last stride (a view of a
    wider row, as a fused projection's output splits, is read in place); `support.refusal` says
    which calls it takes."""
    width = x.shape[-1]
    rows = x.reshape(-1, width) if x.dim() != 2 else x
    y = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    if rows.shape[0]:
        block = triton.next_power_of_2(width)
        warps = min(16, max(1, block // 512))
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, y, rows.stride(0), width, eps, BLOCK=block, num_warps=warps
        )
    return y
