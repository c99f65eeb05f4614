"""Routed experts split by expert (EP), on the CPU reference path: a rank computes only the (token,
choice) pairs routed to its own experts, and the ranks' partial sums add up to one rank's output.

The ranks are built with `Parallel(rank, size, size)` and no process group, and only their routed part
(`MoE.routed`, before the all-reduce) is run, one rank after another in this process. The Triton
kernels' side of the contract is tested in test_moe_kernels.py and test_moe_decode.py (interpreter)
and test_moe_expert_parallel_cuda.py (GPU).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from hylo.config import ModelConfig
from hylo.layers.moe import FP8Experts, MoE
from hylo.ops.moe import reference
from hylo.parallel.layout import Parallel

HIDDEN, INTER, EXPERTS, TOP_K, TOKENS = 64, 32, 8, 3, 11


def moe_config(**overrides) -> ModelConfig:
    fields = dict(
        hidden_size=HIDDEN,
        moe_intermediate_size=INTER,
        n_routed_experts=EXPERTS,
        num_experts_per_tok=TOP_K,
        n_group=2,
        topk_group=1,  # group-limited: a token's choices lie in one half of the experts
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["sparse"],
        indexer_types=["full"],
    )
    return ModelConfig(**(fields | overrides))


def one_rank(config: ModelConfig, seed: int = 0) -> MoE:
    torch.manual_seed(seed)
    moe = MoE(config)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return moe.requires_grad_(False)


def rank_of(whole: MoE, rank: int, size: int, ep_size: int) -> MoE:
    """Rank `rank` of `size` holding `whole`'s router and its own experts (`ep_size == size`: by expert)
    or intermediate slice (by tensor), as the loader would give it."""
    moe = MoE(whole.config, Parallel(rank, size, ep_size)).requires_grad_(False)
    moe.gate.load_state_dict(whole.gate.state_dict())
    gate_up, down = whole.experts.gate_up_proj.data, whole.experts.down_proj.data
    if ep_size == size:
        lo, hi = rank * EXPERTS // size, (rank + 1) * EXPERTS // size
        moe.experts.gate_up_proj.data, moe.experts.down_proj.data = gate_up[lo:hi], down[lo:hi]
    else:
        i = INTER // size
        rows = torch.cat(
            [torch.arange(rank * i, (rank + 1) * i), INTER + torch.arange(rank * i, (rank + 1) * i)]
        )
        moe.experts.gate_up_proj.data = gate_up[:, rows]
        moe.experts.down_proj.data = down[:, :, rank * i : (rank + 1) * i]
    return moe


def routed_flops(moe: MoE, x: torch.Tensor) -> int:
    with FlopCounterMode(display=False) as counter:
        moe.routed(x)
    return counter.get_total_flops()


@pytest.mark.parametrize("size", [2, 4])
def test_an_expert_parallel_rank_computes_only_its_experts_pairs(size):
    """The matmul FLOPs of a rank's routed part are the router's (every rank routes every token) plus
    6·D·I per pair routed to one of its experts, and the ranks' pairs are the step's pairs once:
    a rank split by expert computes 1/size of the expert rows of one rank (split by tensor, every pair
    on its slice of I). Before the fix every pair was computed on every rank (weight 0 elsewhere)."""
    whole = one_rank(moe_config())
    x = torch.randn(TOKENS, HIDDEN)
    ids, _ = reference.route(x, whole.routing)
    router = 2 * TOKENS * EXPERTS * HIDDEN
    per_pair = 6 * HIDDEN * INTER  # gate|up [2I, D] and down [D, I]
    assert routed_flops(whole, x) == router + per_pair * ids.numel()
    local = []
    for rank in range(size):
        moe = rank_of(whole, rank, size, size)
        pairs = int(((ids // (EXPERTS // size)) == rank).sum())
        assert routed_flops(moe, x) == router + per_pair * pairs
        local.append(pairs)
    assert sum(local) == ids.numel() and min(local) > 0  # this routing gives every rank some pairs
    by_tensor = rank_of(whole, 0, size, 1)
    assert routed_flops(by_tensor, x) == router + per_pair // size * ids.numel()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize(
    ("experts", "tolerance"), [("fp32", 1e-6), ("bf16", 1e-2), ("fp8", 1e-6)], ids=["fp32", "bf16", "fp8"]
)
def test_expert_parallel_ranks_sum_to_one_rank(size, experts, tolerance):
    """Σ over the ranks of each rank's routed output (its own experts' pairs) equals one rank's routed
    output: fp32 and FP8 experts (fp32 activations, dequantised weights) to fp32 rounding, bf16 to a
    few bf16 roundings (each rank rounds its partial sum). A token's choices lie in one half of the
    experts (the group limit), so every rank has tokens with no pair on it."""
    config = moe_config()
    whole = one_rank(config, seed=size)
    x = torch.randn(TOKENS, HIDDEN)
    ranks = [rank_of(whole, rank, size, size) for rank in range(size)]
    if experts == "bf16":
        x = x.bfloat16()
        for moe in (whole, *ranks):
            moe.bfloat16()
    if experts == "fp8":
        for moe in (whole, *ranks):
            moe.experts = FP8Experts.from_experts(moe.experts)
        assert [m.experts.first_expert for m in ranks] == [r * EXPERTS // size for r in range(size)]
    ids, _ = reference.route(x, whole.routing)
    expected = whole.routed(x).double()
    parts = [moe.routed(x) for moe in ranks]
    total = sum(part.double() for part in parts)
    assert float((total - expected).norm() / expected.norm()) < tolerance
    for rank, part in enumerate(parts):  # the tokens with no pair on a rank get exactly nothing there
        none_here = ((ids // (EXPERTS // size)) != rank).all(1)
        assert none_here.any() and not part[none_here].any() and part[~none_here].any(1).all()
