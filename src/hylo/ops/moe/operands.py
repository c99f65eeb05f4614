"""The MoE family's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with the
strides that address it), so that a launch passes a dozen named operands instead of sixteen positional ones.
Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose ones. The routing's
`Choices` (`reference`) and the `routing.Alignment` are bundles of the same kind."""

from __future__ import annotations

from typing import NamedTuple

import torch


class Rows(NamedTuple):
    """Activation rows as the grouped-GEMM kernels take them: row r of `data` at `data + r·stride`, its FP8
    group scales at `scales + r·scale_stride` (`data` again where unscaled: the kernels read scales only
    where FP8). (Not `values`: Triton's tuples use that name.)"""

    data: torch.Tensor
    scales: torch.Tensor
    stride: int
    scale_stride: int

    @classmethod
    def of(cls, data: torch.Tensor, scales: torch.Tensor | None = None) -> Rows:
        """A `[rows, K]` activation and its group scales (None where unscaled) by their own strides."""
        scales = data if scales is None else scales
        return cls(data, scales, data.stride(0), scales.stride(0))


class Weights(NamedTuple):
    """Experts' `[N, K]` weights as the kernels take them: expert e's row n at `weight + e·expert_stride
    + n·row_stride`, its [128, 128] block scales at `scale + e·scale_expert_stride + (n // 128)·
    scale_row_stride` (`weight` again, never read, where unscaled); one expert's own tensors (the shared
    expert's) have expert strides 0."""

    weight: torch.Tensor
    scale: torch.Tensor
    expert_stride: int
    row_stride: int
    scale_expert_stride: int
    scale_row_stride: int

    @classmethod
    def of(cls, weight: torch.Tensor, scale: torch.Tensor | None = None) -> Weights:
        """Stacked `[E, N, K]` experts or one expert's `[N, K]` tensors, and their scales (None: unscaled)."""
        scale = weight if scale is None else scale
        if weight.dim() == 2:
            return cls(weight, scale, 0, weight.stride(0), 0, scale.stride(0))
        return cls(weight, scale, weight.stride(0), weight.stride(1), scale.stride(0), scale.stride(1))
