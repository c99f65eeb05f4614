"""The small-M Triton GEMM (`ops/gemm/kernels.py`): FP8 block-scaled weights widened (w8a16) at one row and
with K split, quantised rows (w8a8), the transposed tile, and a bf16 weight."""

from __future__ import annotations

import torch
from code_size import HIDDEN

from hylo.ops.gemm import kernels
from hylo.ops.gemm.table import GemmConfig

BF16 = torch.bfloat16
MODULES = (kernels,)


def product(m: int, n: int, k: int, config: GemmConfig, fp8: bool = True) -> None:
    """`gemm` of zero operands: x `[m, k]`, the weight `[n, k]` (e4m3 with its block scales, or bf16)."""
    weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn if fp8 else BF16)
    scales = torch.ones(-(-n // 128), -(-k // 128)) if fp8 else None
    kernels.gemm(torch.zeros(m, k, dtype=BF16), weight, config, scales)


CASES = {
    "fp8_m1": lambda: product(1, 24832, HIDDEN, GemmConfig(16, 64, 128, 1, 4, 3)),
    "fp8_m8_split4": lambda: product(8, 4096, 12288, GemmConfig(16, 32, 128, 4, 4, 4)),
    "fp8_m16_quant_x": lambda: product(16, 2048, HIDDEN, GemmConfig(16, 64, 128, 2, 4, 3, quant_x=True)),
    "fp8_m8_swap_ab": lambda: product(8, 24576, HIDDEN, GemmConfig(16, 64, 64, 1, 4, 3, swap_ab=True)),
    "bf16_m4": lambda: product(4, HIDDEN, HIDDEN, GemmConfig(16, 64, 64, 1, 4, 3), fp8=False),
}
