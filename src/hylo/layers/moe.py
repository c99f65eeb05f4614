"""Routed + shared experts MoE block."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.layers.mlp import MLP
from hylo.ops import moe as moe_ops


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


class MoE(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.gate = Router(config)
        self.experts = Experts(config)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        ids, weights = moe_ops.route(
            x,
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )
        routed = moe_ops.experts(
            x, self.experts.gate_up_proj, self.experts.down_proj, ids, weights, c.swiglu_limit
        )
        return routed + self.shared_experts(x)
