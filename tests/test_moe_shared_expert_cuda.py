"""The shared expert as one more pair of the routed experts' decode launches, compiled on the GPU: against
the same step with the shared expert's output as the addend, the torch reference, a CUDA graph replay,
and hylo's `MoE` layer with and without the fold. Run this file on its own process (the interpreter
test modules switch Triton to the interpreter for the whole process)."""

from __future__ import annotations

import pytest
import torch

from hylo.config import ModelConfig
from hylo.layers.moe import FP8Experts, MoE
from hylo.ops import moe as moe_ops
from hylo.ops.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks
from hylo.ops.moe import decode, kernels, reference
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

EXPERTS, RANKS, TOP_K, HIDDEN, INTER, LIMIT = 64, 8, 8, 1024, 512, 7.0
LOCAL = EXPERTS // RANKS


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


@pytest.fixture(scope="module")
def model():
    """Routing, routed experts (bf16 and their FP8 quantisation) and a shared expert of the same shapes."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    routing = Routing(
        (torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).bfloat16(),
        torch.randn(EXPERTS, generator=gen, device="cuda") * 0.1,
        TOP_K, 1, 1, True, 2.5,
    )  # fmt: skip

    def weights(experts: int) -> ExpertWeights:
        gate_up = torch.randn(experts, 2 * INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5
        down = torch.randn(experts, HIDDEN, INTER, generator=gen, device="cuda") * INTER**-0.5
        return ExpertWeights(gate_up.bfloat16(), down.bfloat16())

    return routing, weights(EXPERTS), weights(1)


def fp8(w: ExpertWeights) -> ExpertWeights:
    (gate_up, gate_up_scale), (down, down_scale) = quantize_fp8_blocks(w.gate_up), quantize_fp8_blocks(w.down)
    return ExpertWeights(gate_up, down, (gate_up_scale, down_scale))


def one(w: ExpertWeights) -> SharedExpert:
    """Expert 0 of `w` as a shared expert (its own tensors)."""
    scales = None if w.scales is None else (w.scales[0][0], w.scales[1][0])
    return SharedExpert(w.gate_up[0], w.down[0], scales)


def dequantized(w: ExpertWeights) -> ExpertWeights:
    """fp32 weights: FP8 ones dequantised (the reference's view of them)."""
    if w.scales is None:
        return ExpertWeights(w.gate_up.float(), w.down.float())
    gate_up_scale, down_scale = w.scales
    return ExpertWeights(
        dequantize_fp8_blocks(w.gate_up, gate_up_scale, torch.float32),
        dequantize_fp8_blocks(w.down, down_scale, torch.float32),
    )


@pytest.mark.parametrize("tokens", [1, 5, 8])
@pytest.mark.parametrize("rank", [None, 3], ids=["one_rank", "rank3_of_8"])
@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8"])
def test_the_folded_step_is_the_step_plus_the_shared_expert(model, tokens, rank, fp8_weights):
    """bf16 activations. Against the step whose addend is the shared expert's output by the general kernel
    path (one routed pair of weight 1: the same GEMM rows, up to the order of a row's fp32 K sums and one
    bf16 rounding of each row, so a few bf16 ulps: 1e-2); against the fp32 reference on the (dequantised)
    weights: bf16 rounding 1e-2, e4m3 activations 0.08 (as for the routed step alone)."""
    routing, routed, shared_weights = model
    routed, shared_weights = (fp8(routed), fp8(shared_weights)) if fp8_weights else (routed, shared_weights)
    mine = slice(None) if rank is None else slice(rank * LOCAL, (rank + 1) * LOCAL)
    scales = None if routed.scales is None else tuple(s[mine] for s in routed.scales)
    w = ExpertWeights(routed.gate_up[mine], routed.down[mine], scales)
    first = None if rank is None else rank * LOCAL
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    shared = one(shared_weights)
    out = decode.routed_experts(x, routing, w, LIMIT, first_expert=first, shared=shared)
    ones = torch.ones(tokens, 1, device="cuda")
    rows = kernels.experts(x, shared_weights, Choices(torch.zeros_like(ones, dtype=torch.long), ones), LIMIT)
    joined = decode.routed_experts(x, routing, w, LIMIT, first_expert=first, addend=rows)
    assert rel_err(out, joined) < 1e-2
    truth = reference.experts(
        x.float(), dequantized(w), reference.route(x, routing), LIMIT, first, one(dequantized(shared_weights))
    )
    assert rel_err(out, truth) < (0.08 if fp8_weights else 1e-2)
    assert not decode.tickets(x.device).any()


def test_the_folded_step_replays_in_a_cuda_graph(model):
    routing, routed, shared_weights = model
    w, shared = fp8(routed), one(fp8(shared_weights))
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    eager = decode.routed_experts(x, routing, w, LIMIT, shared=shared)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.routed_experts(x, routing, w, LIMIT, shared=shared)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, decode.routed_experts(x, routing, w, LIMIT, shared=shared))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("fp8_weights", [False, True], ids=["bf16", "fp8"])
def test_the_moe_layer_folds_at_decode_and_keeps_the_mlp_for_prefill(fp8_weights):
    """`MoE` on the GPU: a decode step folds (its shared MLP never runs) and gives the output of the MLP's
    addend path within the routed step's tolerances (bf16 1e-2; FP8: the fold quantises the shared
    expert's activations to e4m3, the MLP's w8a16 GEMMs do not: 0.08); a prefill-sized step runs the MLP."""
    config = ModelConfig(
        hidden_size=HIDDEN, moe_intermediate_size=INTER, n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K,
        num_hidden_layers=1, layer_types=["linear_attention"], mlp_layer_types=["sparse"],
        indexer_types=["full"], swiglu_limit=LIMIT,
    )  # fmt: skip
    torch.manual_seed(1)
    moe = MoE(config).cuda().bfloat16().requires_grad_(False)
    for p in moe.parameters():
        torch.nn.init.normal_(p, std=p.shape[-1] ** -0.5)
    moe.gate.e_score_correction_bias = torch.zeros(EXPERTS, device="cuda")
    if fp8_weights:
        moe.experts = FP8Experts.from_experts(moe.experts)
        for linear in (moe.shared_experts.gate_up_proj, moe.shared_experts.down_proj):
            weight, scale = quantize_fp8_blocks(linear.weight)
            linear.to_fp8_()
            linear.weight.data.copy_(weight)
            linear.weight_scale_inv.copy_(scale)
    mlp_runs = []
    moe.shared_experts.register_forward_hook(lambda *_: mlp_runs.append(1))
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    assert moe_ops.shared_refusal(x, TOP_K, moe.experts.weights, moe.shared_expert()) is None
    out = moe(x)
    assert not mlp_runs
    apart = moe.routed(x, addend=moe.shared_experts(x))
    assert rel_err(out, apart) < (0.08 if fp8_weights else 1e-2)
    moe(torch.randn(64, HIDDEN, device="cuda").bfloat16())  # 512 pairs: the general path
    assert len(mlp_runs) == 2
