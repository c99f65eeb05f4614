"""Routed + shared experts MoE block."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.layers.mlp import MLP
from hylo.ops import moe as moe_ops
from hylo.ops.moe.reference import FP8_BLOCK


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )


class Experts(nn.Module):
    """Routed expert weights, stacked: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, routing: moe_ops.Routing, limit: float) -> torch.Tensor:
        """The routed experts' output for x, routing included (`moe_ops.routed_experts`)."""
        return moe_ops.routed_experts(x, routing, self.gate_up_proj, self.down_proj, limit)


class FP8Experts(nn.Module):
    """`Experts` with e4m3 weights and fp32 `*_scale_inv [E, ceil(N/128), ceil(K/128)]` per [128, 128]
    block, the layout of FP8 checkpoints; the weights stay FP8 in memory."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        gate_up_proj_scale_inv: torch.Tensor,
        down_proj: torch.Tensor,
        down_proj_scale_inv: torch.Tensor,
    ):
        super().__init__()
        self.register_buffer("gate_up_proj", gate_up_proj)
        self.register_buffer("gate_up_proj_scale_inv", gate_up_proj_scale_inv)
        self.register_buffer("down_proj", down_proj)
        self.register_buffer("down_proj_scale_inv", down_proj_scale_inv)

    @classmethod
    def empty(cls, config: ModelConfig, device: str | torch.device) -> FP8Experts:
        """Uninitialised buffers for a checkpoint's FP8 experts. The gate and up blocks of an expert are
        stacked, so its intermediate size must be whole [128, 128] blocks."""
        e, i, d = config.n_routed_experts, config.moe_intermediate_size, config.hidden_size
        if i % FP8_BLOCK:
            raise ValueError(
                f"FP8 experts need moe_intermediate_size to be a multiple of {FP8_BLOCK}, got {i}"
            )

        def buffers(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
            weight = torch.empty(e, n, k, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.empty(e, -(-n // FP8_BLOCK), -(-k // FP8_BLOCK), dtype=torch.float32, device=device)
            return weight, scale

        return cls(*buffers(2 * i, d), *buffers(d, i))

    @classmethod
    def from_experts(cls, experts: Experts) -> FP8Experts:
        """Block-quantised copy of bf16 experts (tests and benchmarks; checkpoints load FP8 directly)."""
        return cls(
            *moe_ops.quantize_fp8_blocks(experts.gate_up_proj.detach()),
            *moe_ops.quantize_fp8_blocks(experts.down_proj.detach()),
        )

    def forward(self, x: torch.Tensor, routing: moe_ops.Routing, limit: float) -> torch.Tensor:
        """The routed experts' output for x, routing included (`moe_ops.routed_experts`)."""
        scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv)
        return moe_ops.routed_experts(x, routing, self.gate_up_proj, self.down_proj, limit, scales)


class MoE(nn.Module):
    """Routed experts (`Experts`, or `FP8Experts` in place of it) plus the shared expert MLP."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts: Experts | FP8Experts = Experts(config)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        routing = moe_ops.Routing(
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        return self.experts(x, routing, c.swiglu_limit) + self.shared_experts(x)
