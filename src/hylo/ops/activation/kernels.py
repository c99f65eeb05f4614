"""Triton clamped SwiGLU: one launch for the reference's four elementwise kernels (two clamps, SiLU,
the product), the reference's roundings kept: SiLU in fp32 rounded to the input dtype, the product in
fp32 rounded again."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter

BLOCK = 1024  # columns per program: one decode row of GLM-5.3-Flash's shared expert (2048) is 2 programs


@triton.jit
def _swiglu_clamp_kernel(gate, up, out, row_stride, width, limit, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.minimum(tl.load(gate + row * row_stride + cols, mask=ok, other=0.0).to(tl.float32), limit)
    u = tl.load(up + row * row_stride + cols, mask=ok, other=0.0).to(tl.float32)
    u = tl.minimum(tl.maximum(u, -limit), limit)
    silu = (g / (1.0 + tl.exp(-g))).to(out.dtype.element_ty).to(tl.float32)
    tl.store(out + row * width + cols, (silu * u).to(out.dtype.element_ty), mask=ok)


def swiglu_clamp(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """Triton twin of `reference.swiglu_clamp` for the calls `refusal` takes: `gate` and `up` of one
    shape, dtype and row stride with a unit last stride (the two column halves of one fused gate|up
    product are read in place). Returns a new contiguous tensor of their shape."""
    width = gate.shape[-1]
    gate_rows, up_rows = gate.reshape(-1, width), up.reshape(-1, width)
    out = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    if gate_rows.shape[0] and width:
        grid = (gate_rows.shape[0], triton.cdiv(width, BLOCK))
        dependent = dependent_launches(out.device)
        _swiglu_clamp_kernel[grid](
            gate_rows, up_rows, out, gate_rows.stride(0), width, float(limit), BLOCK=BLOCK, num_warps=4,
            PDL=dependent, launch_pdl=dependent,
        )  # fmt: skip
    return out
