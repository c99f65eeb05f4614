"""FP8 (float8_e4m3fn) quantisation shared by the op families, as DeepSeek-V3-style FP8 checkpoints and
serving use it: weights in [128, 128] blocks with one fp32 scale each, activations per token and
128-channel group. The torch references are here; `kernels` holds the Triton activation quantiser and
the in-kernel `quantize_tile` that the MoE kernels fuse.
"""

from __future__ import annotations

import torch

__all__ = ["FP8_BLOCK", "FP8_MAX", "dequantize_fp8_blocks", "quantize_fp8_blocks", "quantize_fp8_groups"]

FP8_BLOCK = 128
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """amax / 448 (at least 1e-12 / 448) by IEEE division on every device: torch on CUDA multiplies by
    the reciprocal of a scalar divisor, which misses the quotient's last bit for some amax (and then
    some e4m3 values), so the divisor is a tensor."""
    clamped = amax.clamp(min=1e-12)
    return clamped / torch.full_like(clamped, FP8_MAX)


def quantize_fp8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-scaled e4m3 of `[..., N, K]` weights, as FP8 checkpoints store them: (fp8 weight, fp32
    `scale_inv [..., ceil(N/128), ceil(K/128)]`) with weight ≈ fp8 · scale_inv per [128, 128] block."""
    *lead, n, k = weight.shape
    rows, cols = -(-n // FP8_BLOCK), -(-k // FP8_BLOCK)
    padded = weight.new_zeros(*lead, rows * FP8_BLOCK, cols * FP8_BLOCK, dtype=torch.float32)
    padded[..., :n, :k] = weight.float()
    blocks = padded.unflatten(-1, (cols, FP8_BLOCK)).unflatten(-3, (rows, FP8_BLOCK))
    scale = _fp8_scale(blocks.abs().amax(dim=(-3, -1)))
    q = (blocks / scale[..., :, None, :, None]).flatten(-4, -3).flatten(-2)[..., :n, :k]
    return q.to(torch.float8_e4m3fn), scale


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`[..., N, K]` e4m3 weight times its per-[128, 128]-block `scale_inv`, in `dtype`."""
    n, k = weight.shape[-2:]
    scale = scale_inv.float().repeat_interleave(FP8_BLOCK, -2)[..., :n, :]
    return (weight.float() * scale.repeat_interleave(FP8_BLOCK, -1)[..., :k]).to(dtype)


def quantize_fp8_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token-group-128 e4m3 activations: (fp8 `[T, K]`, fp32 scale `[T, ceil(K/128)]`),
    x ≈ fp8 · scale."""
    t, k = x.shape
    groups = -(-k // FP8_BLOCK)
    padded = x.new_zeros(t, groups * FP8_BLOCK, dtype=torch.float32)
    padded[:, :k] = x.float()
    padded = padded.view(t, groups, FP8_BLOCK)
    scale = _fp8_scale(padded.abs().amax(-1))
    return (padded / scale[..., None]).flatten(1)[:, :k].to(torch.float8_e4m3fn), scale
