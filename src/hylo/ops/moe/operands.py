"""The MoE family's typed operand bundles: what its Triton kernels take, grouped by role (a tensor with the
strides that address it), so that a launch passes a dozen named operands instead of sixteen positional ones.
Triton unpacks a NamedTuple argument into its fields with the same specialisation as loose ones. The routing's
`Choices` (`reference`) and the `routing.Alignment` are bundles of the same kind."""

from __future__ import annotations

from typing import NamedTuple

import torch

from hylo.ops.moe.reference import Routing


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


class Matrix(NamedTuple):
    """A `[rows, cols]` tensor of unit column stride: element (r, c) at `data + r·stride + c`."""

    data: torch.Tensor
    stride: int

    @classmethod
    def of(cls, t: torch.Tensor) -> Matrix:
        """`t`, whose columns must be contiguous, by its own row stride."""
        assert t.stride(-1) == 1
        return cls(t, t.stride(0))


class Router(NamedTuple):
    """The router as the decode prologue takes it: `weight [E, D]` (expert e's row at `weight +
    e·row_stride`, unit column stride), the fp32 correction `bias [E]` and the routing weights' `scaling`."""

    weight: torch.Tensor
    row_stride: int
    bias: torch.Tensor
    scaling: float

    @classmethod
    def of(cls, routing: Routing) -> Router:
        weight = routing.weight.contiguous()
        return cls(
            weight, weight.stride(0), routing.correction_bias.float().contiguous(), float(routing.scaling)
        )


class Fp8Rows(NamedTuple):
    """Rows quantised to e4m3 `data [T, D]` with their fp32 group scales `scales [T, ceil(D/128)]`, both
    contiguous (their row strides are the kernel's compile-time D and ceil(D/128))."""

    data: torch.Tensor
    scales: torch.Tensor


class Placement(NamedTuple):
    """What the decode prologue's alignment places into its `num_blocks` row blocks: the pairs of global
    experts `[first_expert, first_expert + num_experts)`, numbered from 0, after the shared expert's pair of
    each of `shared_tokens` tokens (0: none) in the first blocks."""

    num_blocks: int
    first_expert: int
    num_experts: int
    shared_tokens: int


class ExpertIds(NamedTuple):
    """The pairs' global expert ids `ids [T·k]` and the global id `first` of the first expert the weights
    hold: pair p belongs to the weights' expert `ids[p] − first` where that lies in `[0, E)` (expert
    parallelism; with every expert on the rank, first 0)."""

    ids: torch.Tensor
    first: int


class ExpertBlocks(NamedTuple):
    """Every expert's pair count `counts`, first row block `starts` and end block `ends` (`[E_PAD]`
    registers, empty experts past E): what `routing._expert_blocks` gives the placing steps."""

    counts: torch.Tensor
    starts: torch.Tensor
    ends: torch.Tensor
