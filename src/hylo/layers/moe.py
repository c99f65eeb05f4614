"""Routed + shared experts MoE block.

Under tensor parallelism the router is replicated (every rank routes every token the same way) and
the routed experts are split by expert or by tensor (`Parallel.ep_size`); the shared expert is split
by tensor. Each rank's routed and shared partial sums are added and all-reduced once: the combine is
one reduction."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.distributed.parallel import SINGLE, Parallel
from hylo.layers.mlp import MLP
from hylo.ops import moe as moe_ops
from hylo.ops.fp8 import FP8_BLOCK, quantize_fp8_blocks


class Router(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(config.n_routed_experts, config.hidden_size))
        self.register_buffer(
            "e_score_correction_bias", torch.zeros(config.n_routed_experts, dtype=torch.float32)
        )


def local_experts(config: ModelConfig, parallel: Parallel) -> tuple[int, int, int]:
    """(first expert, experts, intermediate size) of the routed experts this rank holds."""
    e, i = config.n_routed_experts, config.moe_intermediate_size
    if parallel.experts_by_expert:
        lo, hi = parallel.span(e, "n_routed_experts")
        return lo, hi - lo, i
    return 0, e, parallel.part(i, "moe_intermediate_size")


class Experts(nn.Module):
    """Routed expert weights, stacked: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`
    (this rank's experts and intermediate slice: `local_experts`)."""

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        _, e, i = local_experts(config, parallel)
        d = config.hidden_size
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    def forward(self, x: torch.Tensor, routing: moe_ops.Routing, limit: float) -> torch.Tensor:
        """The routed experts' output for x, routing included (`moe_ops.routed_experts`)."""
        return moe_ops.routed_experts(x, routing, self.gate_up_proj, self.down_proj, limit)

    def forward_routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """The output for x of the (token, choice) pairs `ids` (local expert ids) with `weights`."""
        return moe_ops.experts(x, self.gate_up_proj, self.down_proj, ids, weights, limit)


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
    def empty(
        cls, config: ModelConfig, device: str | torch.device, parallel: Parallel = SINGLE
    ) -> FP8Experts:
        """Uninitialised buffers for a checkpoint's FP8 experts (this rank's: `local_experts`). The gate
        and up blocks of an expert are stacked, so its intermediate size must be whole [128, 128]
        blocks (per rank, when split by tensor)."""
        _, e, i = local_experts(config, parallel)
        d = config.hidden_size
        if i % FP8_BLOCK:
            per_rank = " per rank" if i != config.moe_intermediate_size else ""
            raise ValueError(
                f"FP8 experts need moe_intermediate_size to be a multiple of {FP8_BLOCK}, got {i}{per_rank}"
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
            *quantize_fp8_blocks(experts.gate_up_proj.detach()),
            *quantize_fp8_blocks(experts.down_proj.detach()),
        )

    def forward(self, x: torch.Tensor, routing: moe_ops.Routing, limit: float) -> torch.Tensor:
        """The routed experts' output for x, routing included (`moe_ops.routed_experts`)."""
        scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv)
        return moe_ops.routed_experts(x, routing, self.gate_up_proj, self.down_proj, limit, scales)

    def forward_routed(
        self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, limit: float
    ) -> torch.Tensor:
        """The output for x of the (token, choice) pairs `ids` (local expert ids) with `weights`."""
        return moe_ops.experts_fp8(
            x, self.gate_up_proj, self.gate_up_proj_scale_inv, self.down_proj, self.down_proj_scale_inv,
            ids, weights, limit,
        )  # fmt: skip


class MoE(nn.Module):
    """Routed experts (`Experts`, or `FP8Experts` in place of it) plus the shared expert MLP."""

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        self.config, self.parallel = config, parallel
        self.first_expert = local_experts(config, parallel)[0]
        self.gate = Router(config)
        self.experts: Experts | FP8Experts = Experts(config, parallel)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit,
            parallel, reduce=False,
        )  # fmt: skip

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
        if self.parallel.experts_by_expert:
            routed = self._local_pairs(x, routing)
        else:
            routed = self.experts(x, routing, c.swiglu_limit)
        return self.parallel.all_reduce(routed + self.shared_experts(x))

    def _local_pairs(self, x: torch.Tensor, routing: moe_ops.Routing) -> torch.Tensor:
        """Experts split by expert: every pair routed to another rank's expert is given weight 0 (and
        this rank's first expert, so that the kernels see valid ids); it adds nothing here, and the
        rank that holds its expert adds it in the all-reduce. Those pairs are still computed: a
        kernel that drops them is left for when expert parallelism runs on GPUs."""
        ids, weights = moe_ops.route(x, *routing)
        local = ids - self.first_expert
        mine = (local >= 0) & (local < self.experts.gate_up_proj.shape[0])
        return self.experts.forward_routed(
            x, local.where(mine, 0), weights.where(mine, 0), self.config.swiglu_limit
        )
