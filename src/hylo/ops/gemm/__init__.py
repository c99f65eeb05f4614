"""Linear projections: a tuned Triton GEMM for a few rows on GPUs with a measured table, else torch.

`linear(x, weight)` is `x @ weightᵀ` over the last dim of x. On CUDA, when the flattened row count is at
most 64 and the GPU's table (`table.py`) has an entry for the shape, the Triton kernel runs with that
entry's configuration; everything else (CPU, prefill, untuned shapes) is `torch.nn.functional.linear`.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.nn.functional as F

from hylo.ops.gemm.table import lookup

__all__ = ["linear"]


@cache
def _gpu_name(index: int) -> str:
    return torch.cuda.get_device_name(index)


def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    if x.is_cuda and x.dtype == weight.dtype:
        rows = x.numel() // x.shape[-1]
        n, k = weight.shape
        config = lookup(_gpu_name(x.device.index or 0), rows, n, k)
        if config is not None:
            from hylo.ops.gemm.kernels import gemm

            return gemm(x.reshape(rows, k), weight, config).view(*x.shape[:-1], n)
    return F.linear(x, weight)
