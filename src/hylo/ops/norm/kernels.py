"""Triton RMSNorm: one pass over each row (read once, written once), the reference's roundings kept:
fp32 statistics, the normalised row rounded to the input dtype, then scaled by the weight."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.norm.operands import NormedIntoRows, NormedIntoSlots, NormedRows
from hylo.ops.norm.reference import NormRows, RowStore


@triton.jit
def _rms_norm_row(x, w, y, width, eps, BLOCK: tl.constexpr):
    """One row at `x` normalised into `y`: fp32 statistics, the normalised row rounded to x's dtype,
    then scaled by the weight in fp32 and rounded to y's."""
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    xv = tl.load(x + cols, mask=ok, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / width + eps)
    normed = (xv * inv).to(x.dtype.element_ty).to(tl.float32)
    out = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32) * normed
    tl.store(y + cols, out.to(y.dtype.element_ty), mask=ok)


@triton.jit
def _rms_norm_kernel(x, w, y, x_row_stride, width, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    _rms_norm_row(x + row * x_row_stride, w, y + row * width, width, eps, BLOCK)


@triton.jit
def _rms_norm_pair_kernel(first, second, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr, PDL: tl.constexpr):
    """Program (t, 0) normalises row t of `first` (`NormedIntoRows`) into its `y`; program (t, 1) row t
    of `second` (`NormedIntoSlots`) into its slot `second.index[t]`."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    if tl.program_id(1) == 0:
        x1, y1 = first.x + row * first.row_stride, first.y + row * first.width
        _rms_norm_row(x1, first.weight, y1, first.width, first.eps, BLOCK1)
    else:
        slot = tl.load(second.index + row).to(tl.int64)
        x2, out2 = second.x + row * second.row_stride, second.out + slot * second.out_row_stride
        _rms_norm_row(x2, second.weight, out2, second.width, second.eps, BLOCK2)


def rms_norm_pair(first: NormRows, second: NormRows, store: RowStore) -> torch.Tensor:
    """Triton twin of `reference.rms_norm_pair` in one launch, for 2-D row sets with a unit last stride
    (column views of one fused projection are read in place); `pair_refusal` says which calls it
    takes."""
    tokens, width1 = first.x.shape
    y1 = torch.empty(first.x.shape, dtype=torch.result_type(first.weight, first.x), device=first.x.device)
    if tokens:
        width2 = second.x.shape[1]
        dependent = dependent_launches(y1.device)
        _rms_norm_pair_kernel[(tokens, 2)](
            NormedIntoRows.of(first, y1), NormedIntoSlots.of(second, store),
            BLOCK1=triton.next_power_of_2(width1), BLOCK2=triton.next_power_of_2(width2),
            num_warps=min(16, max(1, triton.next_power_of_2(max(width1, width2)) // 512)),
            PDL=dependent, launch_pdl=dependent,
        )  # fmt: skip
    return y1


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
        dependent = dependent_launches(y.device)
        _rms_norm_kernel[(rows.shape[0],)](
            rows, weight, y, rows.stride(0), width, eps, BLOCK=block, num_warps=warps,
            PDL=dependent, launch_pdl=dependent,
        )  # fmt: skip
    return y


@triton.jit
def _add_rms_norm_kernel(x, delta, total, w, y, width, eps, BLOCK: tl.constexpr, PDL: tl.constexpr):
    """Row pid of contiguous `x` and `delta`: their sum rounded to x's dtype into `total`, and that rounded
    sum normalised into `y` as `_rms_norm_row` normalises a row."""
    enter(PDL)
    row = tl.program_id(0).to(tl.int64) * width
    cols = tl.arange(0, BLOCK)
    ok = cols < width
    xv = tl.load(x + row + cols, mask=ok, other=0.0).to(tl.float32)
    xv += tl.load(delta + row + cols, mask=ok, other=0.0).to(tl.float32)
    rounded = xv.to(total.dtype.element_ty)
    tl.store(total + row + cols, rounded, mask=ok)
    xv = rounded.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xv * xv, 0) / width + eps)
    normed = (xv * inv).to(x.dtype.element_ty).to(tl.float32)
    out = tl.load(w + cols, mask=ok, other=0.0).to(tl.float32) * normed
    tl.store(y + row + cols, out.to(y.dtype.element_ty), mask=ok)


def add_rms_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton twin of `reference.add_rms_norm` in one launch for contiguous `x` and `delta` of one shape and
    dtype (`add_refusal`)."""
    width = x.shape[-1]
    total = torch.empty_like(x)
    y = torch.empty(x.shape, dtype=torch.result_type(weight, x), device=x.device)
    rows = x.numel() // width if width else 0
    if rows:
        block = triton.next_power_of_2(width)
        dependent = dependent_launches(y.device)
        _add_rms_norm_kernel[(rows,)](
            x, delta, total, weight, y, width, eps, BLOCK=block, num_warps=min(16, max(1, block // 512)),
            PDL=dependent, launch_pdl=dependent,
        )  # fmt: skip
    return total, y


@triton.jit
def _rms_norm_cat_kernel(first, second, y, BLOCK1: tl.constexpr, BLOCK2: tl.constexpr):
    """Program (t, 0) normalises row t of `first` (`NormedRows`) into y[t, :first.width], program (t, 1)
    the second's into y[t, first.width:] (`y [T, first.width + second.width]`)."""
    row = tl.program_id(0).to(tl.int64)
    out = y + row * (first.width + second.width)
    if tl.program_id(1) == 0:
        x1 = first.x + row * first.row_stride
        _rms_norm_row(x1, first.weight, out, first.width, first.eps, BLOCK1)
    else:
        x2 = second.x + row * second.row_stride
        _rms_norm_row(x2, second.weight, out + first.width, second.width, second.eps, BLOCK2)


def rms_norm_cat(first: NormRows, second: NormRows) -> torch.Tensor:
    """Triton twin of `reference.rms_norm_cat` in one launch (no concatenation afterwards), for 2-D row
    sets with a unit last stride; `cat_refusal` says which calls it takes."""
    tokens, width1 = first.x.shape
    width2 = second.x.shape[1]
    y = torch.empty(
        tokens, width1 + width2, dtype=torch.result_type(first.weight, first.x), device=first.x.device
    )
    if tokens:
        _rms_norm_cat_kernel[(tokens, 2)](
            NormedRows.of(first), NormedRows.of(second), y,
            BLOCK1=triton.next_power_of_2(width1), BLOCK2=triton.next_power_of_2(width2),
            num_warps=min(16, max(1, triton.next_power_of_2(max(width1, width2)) // 512)),
        )  # fmt: skip
    return y
