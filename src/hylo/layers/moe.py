"""Routed + shared experts MoE block.

Under tensor parallelism the router is replicated (every rank routes every token the same way) and
the routed experts are split by expert or by tensor (`Parallel.ep_size`); the shared expert is split
by tensor. Split by expert, a rank computes only the (token, choice) pairs routed to its own experts
(`first_expert` of the expert modules, `moe_ops.routed_experts`); split by tensor, every pair on its
intermediate slice. Each rank's routed and shared partial sums are added, and the decoder layer completes the
sum once: the combine is one reduction.

Where `moe_ops.shared_refusal` allows it (a decode-sized step on CUDA, the shared expert in the routed
experts' format and at most a routed expert's intermediate per rank: one rank, experts split by tensor,
or split by expert beside the shared expert's tensor slice), the shared expert's weights join the routed
experts' three decode launches as one more pair per token (`SharedExpert`) instead of running as its own
MLP (three launches more); elsewhere the MLP runs and its output is the routed launches' addend."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.layers.mlp import MLP
from hylo.ops import moe as moe_ops
from hylo.ops.fp8 import FP8_BLOCK, quantize_fp8_blocks
from hylo.parallel.layout import SINGLE, Parallel


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


def first_local_expert(config: ModelConfig, parallel: Parallel) -> int | None:
    """The global id of this rank's first routed expert when the experts are split by expert, else None
    (the rank holds a slice of every expert): the `first_expert` of `moe_ops.routed_experts`."""
    return local_experts(config, parallel)[0] if parallel.experts_by_expert else None


class StackedExperts(nn.Module):
    """What `Experts` and `FP8Experts` share: their stacked tensors as `weights` (`moe_ops.ExpertWeights`)
    and `first_expert`, and the forward that routes and runs them."""

    first_expert: int | None

    @property
    def weights(self) -> moe_ops.ExpertWeights:
        raise NotImplementedError

    def forward(
        self,
        x: torch.Tensor,
        routing: moe_ops.Routing,
        limit: float,
        addend: torch.Tensor | None = None,
        shared: moe_ops.SharedExpert | None = None,
    ) -> torch.Tensor:
        """The output for x of the pairs routed to these experts, routing included, plus `addend` or the
        shared expert's output where given (`moe_ops.routed_experts`)."""
        w = self.weights
        return moe_ops.routed_experts(
            x, routing, w.gate_up, w.down, limit, w.scales, self.first_expert, addend, shared
        )


class Experts(StackedExperts):
    """Routed expert weights, stacked: `gate_up_proj [E, 2I, D]` (gate rows first), `down_proj [E, D, I]`
    (this rank's experts and intermediate slice: `local_experts`); `first_expert`: the global id of
    the first of them, split by expert (`first_local_expert`)."""

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        _, e, i = local_experts(config, parallel)
        d = config.hidden_size
        self.first_expert = first_local_expert(config, parallel)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, d))
        self.down_proj = nn.Parameter(torch.empty(e, d, i))

    @property
    def weights(self) -> moe_ops.ExpertWeights:
        return moe_ops.ExpertWeights(self.gate_up_proj, self.down_proj)


class FP8Experts(StackedExperts):
    """`Experts` with e4m3 weights and fp32 `*_scale_inv [E, ceil(N/128), ceil(K/128)]` per [128, 128]
    block, the layout of FP8 checkpoints; the weights stay FP8 in memory."""

    def __init__(
        self,
        gate_up_proj: torch.Tensor,
        gate_up_proj_scale_inv: torch.Tensor,
        down_proj: torch.Tensor,
        down_proj_scale_inv: torch.Tensor,
        first_expert: int | None = None,
    ):
        super().__init__()
        self.first_expert = first_expert
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

        return cls(*buffers(2 * i, d), *buffers(d, i), first_local_expert(config, parallel))

    @classmethod
    def from_experts(cls, experts: Experts) -> FP8Experts:
        """Block-quantised copy of bf16 experts (tests and benchmarks; checkpoints load FP8 directly)."""
        return cls(
            *quantize_fp8_blocks(experts.gate_up_proj.detach()),
            *quantize_fp8_blocks(experts.down_proj.detach()),
            experts.first_expert,
        )

    @property
    def weights(self) -> moe_ops.ExpertWeights:
        scales = (self.gate_up_proj_scale_inv, self.down_proj_scale_inv)
        return moe_ops.ExpertWeights(self.gate_up_proj, self.down_proj, scales)


class MoE(nn.Module):
    """Routed experts (`Experts`, or `FP8Experts` in place of it) plus the shared expert MLP."""

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        self.config, self.parallel = config, parallel
        self.gate = Router(config)
        self.experts: Experts | FP8Experts = Experts(config, parallel)
        self.shared_experts = MLP(
            config.hidden_size, config.moe_intermediate_size * config.n_shared_experts, config.swiglu_limit,
            parallel,
        )  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        routing, shared = self.routing, self.shared_expert()
        weights = self.experts.weights
        if shared is not None and moe_ops.shared_refusal(x, routing.top_k, weights, shared) is None:
            out = self.experts(x, routing, self.config.swiglu_limit, shared=shared)
        else:
            # the shared expert's output joins the routed sum inside its combine (a decode step: one
            # launch fewer), as the add after it would
            out = self.routed(x, addend=self.shared_experts(x))
        return out  # this rank's partial sum: the decoder layer completes it

    def shared_expert(self) -> moe_ops.SharedExpert | None:
        """The shared expert MLP's tensors as one expert's (`moe_ops.SharedExpert`: gate rows then up rows
        of one weight, and down), or None where its projections do not hold them so: FP8 parts padded
        to block boundaries or a part left unquantised, or one projection FP8 and the other not."""
        mlp = self.shared_experts
        gate_up, down = mlp.gate_up_proj, mlp.down_proj
        inter = down.in_features
        rows = {"gate_proj": ("weight", 0, inter), "up_proj": ("weight", inter, 2 * inter)}
        if gate_up.dense_weight is not None or gate_up.rows() != rows or gate_up.fp8 != down.fp8:
            return None
        scales = (gate_up.weight_scale_inv, down.weight_scale_inv) if down.fp8 else None
        return moe_ops.SharedExpert(gate_up.weight, down.weight, scales)

    @property
    def routing(self) -> moe_ops.Routing:
        """The router's tensors and choice rule (replicated: every rank routes every token alike)."""
        c = self.config
        return moe_ops.Routing(
            self.gate.weight,
            self.gate.e_score_correction_bias,
            c.num_experts_per_tok,
            c.n_group,
            c.topk_group,
            c.norm_topk_prob,
            c.routed_scaling_factor,
        )

    def routed(self, x: torch.Tensor, addend: torch.Tensor | None = None) -> torch.Tensor:
        """This rank's part of the routed experts' output (plus `addend` where given): every token is
        routed over all experts; split by expert, only the pairs routed to this rank's experts are
        computed (the rank holding a pair's expert adds it in the all-reduce)."""
        return self.experts(x, self.routing, self.config.swiglu_limit, addend)
