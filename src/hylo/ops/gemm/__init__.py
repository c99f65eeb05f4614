"""Linear projections: a tuned Triton GEMM for a few rows on GPUs with a measured table, else torch.

`linear(x, weight)` is `x @ weightᵀ` over the last dim of x. While a CUDA graph is being captured, when
the flattened row count is at most 64 and the GPU's table (`table.py`) has an entry for the shape, the
Triton kernel runs with that entry's configuration; everything else (CPU, prefill, untuned shapes, eager
launches) is `torch.nn.functional.linear`. The table was tuned under graph replay, where it wins by up to
28% per GEMM; launched eagerly, Triton's host-side launch cost (about 60 us per split-K GEMM measured in
an 8-layer decode on the H200) is far above that gain, so eager steps stay on cuBLAS.
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
    if x.is_cuda and x.dtype == weight.dtype and torch.cuda.is_current_stream_capturing():
        rows = x.numel() // x.shape[-1]
        n, k = weight.shape
        config = lookup(_gpu_name(x.device.index or 0), rows, n, k)
        if config is not None:
            from hylo.ops.gemm.kernels import gemm

            return gemm(x.reshape(rows, k), weight, config).view(*x.shape[:-1], n)
    return F.linear(x, weight)
