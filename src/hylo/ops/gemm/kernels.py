"""Triton GEMM for a few rows: `x [M, K] @ weight[N, K]ᵀ` with M ≤ 64 (decode, verify).

At these sizes the product is bound by reading the weight once, so the work is spread over enough
programs to keep every SM streaming: N is tiled and, where N alone gives too few tiles, K is split
across programs whose fp32 partials a second launch sums (deterministic, no atomics).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.gemm.table import GemmConfig


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count of a decode batch
def _gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    K,
    k_per_split,
    stride_xm,
    stride_wn,
    stride_os,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    lo = split * k_per_split
    for start in range(lo, lo + k_per_split, BLOCK_K):
        k = start + ks
        k_ok = k[None, :] < K
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & k_ok)
        w = tl.load(w_ptr + cols[:, None] * stride_wn + k[None, :], mask=(cols[:, None] < N) & k_ok)
        acc += tl.dot(x, tl.trans(w))
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    tl.store(
        out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(x: torch.Tensor, weight: torch.Tensor, config: GemmConfig) -> torch.Tensor:
    """`x [M, K] @ weight [N, K]ᵀ` in x's dtype with fp32 accumulation; rows of x and weight contiguous."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"gemm: x has K={k} but weight is {tuple(weight.shape)}")
    c = config
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, c.block_n), split_k, triton.cdiv(m, c.block_m))
    _gemm_kernel[grid](
        x, weight, part, m, n, k, k_per_split,
        x.stride(0), weight.stride(0), m * n, n,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k,
        num_warps=c.num_warps, num_stages=c.num_stages,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](part, out, m * n, SPLIT_K=split_k, BLOCK=block)
    return out
