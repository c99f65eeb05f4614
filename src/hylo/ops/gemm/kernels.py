"""Triton GEMMs: `x [M, K] @ weight[N, K]ᵀ` for a few rows, and cuBLAS's block-scaled FP8 matmul.

`gemm` serves M ≤ 64 (decode, verify). At these sizes the product is bound by reading the weight
once, so the work is spread over enough programs to keep every SM streaming: N is tiled and, where N
alone gives too few tiles, K is split across programs whose fp32 partials a second launch sums
(deterministic, no atomics). An e4m3 weight with per-[128, 128]-block scales is read as it is stored
(one byte per element) and widened to x's dtype in registers; each K tile lies inside one scale
block, so the block's scale multiplies the tile's partial product (w8a16: x is not quantised). With
`GemmConfig.quant_x` each row's K tile of x is quantised to e4m3 in registers instead and the tile's
product runs on the FP8 tensor cores, the weight never widened (w8a8, as cuBLAS's block-scaled matmul).
With `GemmConfig.swap_ab` the kernel computes the transposed tile, `weight tile · x tileᵀ`: the weight's
`block_n` rows become the MMA's M side, so from 64 of them Hopper's warpgroup MMA takes the widened weight
from registers, where a 16-row x tile as the M side runs the older `mma.sync` (the small-M trick of
CUTLASS's FP8 kernels in vLLM and TensorRT-LLM); which orientation is faster per shape is the tuner's call.

`scaled_mm` serves prefill-sized M with FP8 weights: x is quantised per token and 128-channel group
(`quantize_groups`, as DeepSeek-V3's and HF's FP8 linears do) and cuBLAS multiplies on the FP8
tensor cores with both block scales (`torch.nn.functional.scaled_mm`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.fp8.kernels import quantize_groups, quantize_rows
from hylo.ops.gemm.operands import SplitTiles
from hylo.ops.gemm.table import GemmConfig
from hylo.ops.operands import Rows

SCALE_BLOCK = tl.constexpr(FP8_BLOCK)
SCALED_MM_ROW_ALIGN = 16  # rows of x padded to a multiple of this for cuBLAS's block-scaled matmul


@triton.jit
def _per_row(v, SWAP_AB: tl.constexpr):
    """A per-row vector (rows of x) broadcast over an output tile, [M, N] or with SWAP_AB [N, M]."""
    return v[None, :] if SWAP_AB else v[:, None]


@triton.jit
def _per_col(v, SWAP_AB: tl.constexpr):
    """A per-column vector (rows of the weight) broadcast over an output tile, as `_per_row`."""
    return v[:, None] if SWAP_AB else v[None, :]


@triton.jit
def _tile_product(x, w, SWAP_AB: tl.constexpr):
    """`x [BM, BK] · w [BN, BK]ᵀ` in fp32, as `[BM, BN]`, or with SWAP_AB its transpose `[BN, BM]`
    computed as `w · xᵀ` (the weight tile is then the MMA's A operand)."""
    if SWAP_AB:
        product = tl.dot(w, tl.trans(x), out_dtype=tl.float32)
    else:
        product = tl.dot(x, tl.trans(w), out_dtype=tl.float32)
    return product


@triton.jit(do_not_specialize=["M"])  # one compile serves every row count of a decode batch
def _gemm_kernel(
    x,
    w,
    scales,
    out,
    M,
    N,
    K,
    k_per_split,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALED: tl.constexpr,
    QUANT_X: tl.constexpr,
    SWAP_AB: tl.constexpr,
    PDL: tl.constexpr,
):
    """Program (column tile, K split, row tile) of `x [M, K] @ w [N, K]ᵀ`: x, w and the weight's block
    scales `[ceil(N/128), ceil(K/128)]` are `Rows`, `out` the `SplitTiles`; its split's K range is
    `k_per_split` long."""
    enter(PDL)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    rows = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_M] if SWAP_AB else [BLOCK_M, BLOCK_N], tl.float32)
    lo = split * k_per_split
    for start in range(lo, lo + k_per_split, BLOCK_K):
        k = start + ks
        k_ok = k[None, :] < K
        x_tile = tl.load(x.data + rows[:, None] * x.row_stride + k[None, :], mask=(rows[:, None] < M) & k_ok)
        w_tile = tl.load(w.data + cols[:, None] * w.row_stride + k[None, :], mask=(cols[:, None] < N) & k_ok)
        if SCALED:  # the tile's [128, 128] block scale of each output column
            block = (cols // SCALE_BLOCK) * scales.row_stride + start // SCALE_BLOCK
            scale = _per_col(tl.load(scales.data + block, mask=cols < N), SWAP_AB)
            if QUANT_X:  # each row's K tile as e4m3 with its own scale: an FP8 × FP8 product
                xq, x_scale = quantize_rows(x_tile.to(tl.float32))
                acc += (
                    _tile_product(xq.to(w_tile.dtype), w_tile, SWAP_AB) * scale * _per_row(x_scale, SWAP_AB)
                )
            else:
                acc += _tile_product(x_tile, w_tile.to(x_tile.dtype), SWAP_AB) * scale
        else:
            acc += _tile_product(x_tile, w_tile, SWAP_AB)
    mask = _per_row(rows < M, SWAP_AB) & _per_col(cols < N, SWAP_AB)
    tl.store(
        out.data
        + split * out.split_stride
        + _per_row(rows * out.row_stride, SWAP_AB)
        + _per_col(cols, SWAP_AB),
        acc.to(out.data.dtype.element_ty),
        mask=mask,
    )


@triton.jit
def _sum_splits_kernel(
    part_ptr, out_ptr, numel, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(part_ptr + s * numel + offs, mask=mask)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemm(
    x: torch.Tensor, weight: torch.Tensor, config: GemmConfig, scale_inv: torch.Tensor | None = None
) -> torch.Tensor:
    """`x [M, K] @ weight [N, K]ᵀ` in x's dtype with fp32 accumulation; rows of x and weight contiguous.
    With `scale_inv` the weight is e4m3 with per-[128, 128]-block fp32 scales
    `[ceil(N/128), ceil(K/128)]`, and the config's `block_k` must divide 128."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k:
        raise ValueError(f"gemm: x has K={k} but weight is {tuple(weight.shape)}")
    c = config
    if scale_inv is not None:
        blocks = (triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
        if weight.dtype != torch.float8_e4m3fn or tuple(scale_inv.shape) != blocks:
            raise ValueError(
                f"gemm: a scaled weight is float8_e4m3fn with scale_inv {blocks}, got {weight.dtype} "
                f"with {tuple(scale_inv.shape)}"
            )
        if FP8_BLOCK % c.block_k:
            raise ValueError(f"gemm: block_k {c.block_k} must divide the scale block ({FP8_BLOCK})")
    elif c.quant_x:
        raise ValueError("gemm: quant_x quantises x for an e4m3 weight; this weight has no scale_inv")
    x = x if x.stride(-1) == 1 else x.contiguous()
    weight = weight if weight.stride(-1) == 1 else weight.contiguous()
    k_per_split = triton.cdiv(triton.cdiv(k, c.split_k), c.block_k) * c.block_k
    split_k = triton.cdiv(k, k_per_split)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    part = out if split_k == 1 else torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(n, c.block_n), split_k, triton.cdiv(m, c.block_m))
    scaled = scale_inv is not None
    dependent = dependent_launches(x.device)
    _gemm_kernel[grid](
        Rows.of(x), Rows.of(weight),
        Rows.of(scale_inv) if scaled else Rows(weight, 0),
        SplitTiles(part, m * n, n), m, n, k, k_per_split,
        BLOCK_M=c.block_m, BLOCK_N=c.block_n, BLOCK_K=c.block_k, SCALED=scaled, QUANT_X=c.quant_x,
        SWAP_AB=c.swap_ab, num_warps=c.num_warps, num_stages=c.num_stages,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    if split_k > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](
            part, out, m * n, SPLIT_K=split_k, BLOCK=block, PDL=dependent, launch_pdl=dependent
        )
    return out


def scaled_mm_refusal(x: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why `scaled_mm` cannot take this product (None: it can). cuBLAS's block-scaled matmul reads
    the weight's scales K-block-major in groups of four, so K must be whole groups of 4 × 128."""
    n, k = weight.shape
    if not x.is_cuda or torch.cuda.get_device_capability(x.device)[0] != 9:
        return "cuBLAS's block-scaled FP8 matmul runs on Hopper GPUs only"
    if x.dtype != torch.bfloat16:
        return f"x is {x.dtype}, the FP8 matmul writes bf16"
    if k % (4 * FP8_BLOCK) or n % FP8_BLOCK:
        return f"N={n} must be a multiple of {FP8_BLOCK} and K={k} of {4 * FP8_BLOCK}"
    return None


def scaled_mm(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    """`x [M, K] @ weight [N, K]ᵀ` (e4m3 weight, fp32 `scale_inv [N/128, K/128]`) on the FP8 tensor
    cores, x quantised per token and 128-channel group; bf16 out. Check `scaled_mm_refusal` first."""
    rows = x.shape[0]
    if rows % SCALED_MM_ROW_ALIGN:  # cuBLAS finds no algorithm for some row counts (1, 90, 150 seen)
        x = F.pad(x, (0, 0, 0, -rows % SCALED_MM_ROW_ALIGN))
    q, x_scale = quantize_groups(x)
    m, groups = x_scale.shape
    m_major = torch.empty_strided((m, groups), (1, m), dtype=x_scale.dtype, device=x.device)
    m_major.copy_(x_scale)  # cuBLAS reads the activation scales M-major
    return F.scaled_mm(
        q, weight.t(),
        m_major, F.ScalingType.BlockWise1x128,
        scale_inv.t(), F.ScalingType.BlockWise128x128,
        output_dtype=x.dtype,
    )[:rows]  # fmt: skip
