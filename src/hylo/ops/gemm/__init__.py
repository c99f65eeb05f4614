"""Linear projections: bf16/fp32 weights, or e4m3 weights with per-[128, 128]-block scales.

`linear(x, weight, scale_inv)` is `x @ weightᵀ` over the last dim of x (`weight` dequantised by
`scale_inv` when given). Which implementation runs:

- CPU: torch, the FP8 weight dequantised to x's dtype (the reference).
- FP8 products of at most 16 rows on a Hopper GPU, captured or eager: the CUDA C++ GEMV
  (`gemv_cuda`, built at first use) wherever `gemv_cuda.refusal` has nothing against the call (the
  shape, the GPU, `HYLO_FP8_GEMV=0`, a failed build or check), else the rules below. Its launch is a
  ctypes call of a few us, assumed cheap enough for eager steps too (measured by the lead, not here).
- A few rows (at most 64) while a CUDA graph is being captured, for a shape the GPU's table
  (`table.py`) holds: the Triton kernel with that entry's configuration (`kernels.gemm`). The table
  was tuned under graph replay, where it wins by up to 28% per GEMM; launched eagerly, Triton's
  host-side launch cost (about 60 us per split-K GEMM measured in an 8-layer decode on the H200) is
  far above that gain, so eager bf16 steps stay on cuBLAS.
- The dense part of an FP8 `FusedLinear` (`dense_part=True`: a bf16 product of a few rows and at most
  `NARROW_MAX_N` columns) that the table lacks, while a graph is captured: the Triton kernel with
  `fallback_config`, 5-17% faster than cuBLAS there on the H100 (RESULTS S30-4; both launch twice: a K
  split and its sum). Only there: a bf16 model's own narrow products stay on cuBLAS under capture as
  eagerly, so that its graphs give its eager steps' tokens.
- Other bf16 products: `torch.nn.functional.linear` (cuBLAS).
- Other FP8 products: cuBLAS's block-scaled FP8 matmul (`kernels.scaled_mm`) from `SCALED_MM_MIN_ROWS`
  rows where it takes the shape (`kernels.scaled_mm_refusal` says why not), else the Triton kernel
  with `fallback_config` (`table.heuristic_config`: K split where N gives the SMs too few tiles):
  an FP8 weight is never widened to a bf16 copy on the GPU.
"""

from __future__ import annotations

import logging
from functools import cache

import torch
import torch.nn.functional as F

from hylo.ops.dispatch import use_kernel
from hylo.ops.fp8 import dequantize_fp8_blocks
from hylo.ops.gemm import gemv_cuda
from hylo.ops.gemm.table import (
    M_BUCKETS,
    NARROW_MAX_N,
    GemmConfig,
    heuristic_config,
    lookup,
    table_path,
)

__all__ = ["linear"]

logger = logging.getLogger("hylo")

SCALED_MM_MIN_ROWS = 65  # below it a product reads the weight once and the w8a16 kernel streams it


@cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


@cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


INTERPRETER_SMS = 132  # the SM count a CPU (Triton's interpreter) plans for: a Hopper's


def sm_count(device: torch.device) -> int:
    """The SMs kernels on `device` plan their grids for (`INTERPRETER_SMS` on a CPU)."""
    return _sm_count(device.index or 0) if device.type == "cuda" else INTERPRETER_SMS


def fallback_config(rows: int, n: int, k: int, device: torch.device) -> GemmConfig:
    """The Triton configuration of a product of `rows` rows that the GPU's table has no entry for (FP8
    ones, and the narrow bf16 ones under capture): `table.heuristic_config` for the device's SM count."""
    sms = sm_count(device)
    return heuristic_config(rows, n, k, sms)


@cache
def _announce_small_m_fp8(device: torch.device) -> None:
    """Log once per device what the small-M FP8 products run on: the GPU's tuned table or the heuristic
    configurations, and whether the CUDA GEMV is on (building and checking it here if it is not yet)."""
    name = _gpu_name(device.index or 0)
    table = table_path(name)
    tuning = f"tuned table {table.name}" if table.exists() else "no tuned table (heuristic configurations)"
    off = gemv_cuda.device_refusal(device)
    logger.info(
        "FP8 GEMMs of up to %d rows on %s: %s; CUDA GEMV for up to %d rows: %s",
        M_BUCKETS[-1], name, tuning, gemv_cuda.MAX_ROWS, "on" if off is None else f"off ({off})",
    )  # fmt: skip


def linear(
    x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor | None = None, dense_part: bool = False
) -> torch.Tensor:
    n, k = weight.shape
    rows = x.numel() // x.shape[-1]
    if not use_kernel("gemm.linear", x):
        if scale_inv is not None:
            weight = dequantize_fp8_blocks(weight, scale_inv, x.dtype)
        return F.linear(x, weight)
    if scale_inv is None and x.dtype != weight.dtype:
        return F.linear(x, weight)
    from hylo.ops.gemm import kernels

    flat = x.reshape(rows, k)
    if scale_inv is not None and rows <= M_BUCKETS[-1]:
        _announce_small_m_fp8(x.device)
        if rows <= gemv_cuda.MAX_ROWS and gemv_cuda.takes(flat, weight, scale_inv):
            return gemv_cuda.gemv(flat, weight, scale_inv).view(*x.shape[:-1], n)
    if torch.cuda.is_current_stream_capturing():
        config = lookup(_gpu_name(x.device.index or 0), rows, n, k, fp8=scale_inv is not None)
        narrow = dense_part and scale_inv is None and n <= NARROW_MAX_N and rows <= M_BUCKETS[-1]
        if config is None and narrow:
            config = fallback_config(rows, n, k, x.device)
        if config is not None:
            return kernels.gemm(flat, weight, config, scale_inv).view(*x.shape[:-1], n)
    if scale_inv is None:
        return F.linear(x, weight)
    if rows >= SCALED_MM_MIN_ROWS and kernels.scaled_mm_refusal(flat, weight) is None:
        out = kernels.scaled_mm(flat, weight, scale_inv)
    else:
        out = kernels.gemm(flat, weight, fallback_config(rows, n, k, x.device), scale_inv)
    return out.view(*x.shape[:-1], n)
