"""The two-launch MoE step (`hylo.ops.moe.fused`) compiled on the GPU: against the general path, bit
for bit across runs and graph replays, at expert parallelism, and taken by the dispatcher. Run this
file in its own process (the interpreter test modules switch Triton to the interpreter for the whole
process).

Tolerances: the two paths quantise x and h alike (FP8) and differ in the order of fp32 sums and in the
general path's rounding of each of the k rows to bf16 before its sum: ≤ k bf16 half-ulps, < 1e-2
relative. Against the torch reference on dequantised weights, FP8 adds the e4m3 activations (< 0.08, as
test_moe_expert_parallel_cuda.py)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops import moe as moe_ops
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.moe import decode, fused, kernels, reference
from hylo.ops.moe.reference import Routing

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

EXPERTS, TOP_K, HIDDEN, INTER, LIMIT = 64, 8, 2048, 1024, 7.0


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; 0 where both are zero (a rank none of whose experts a token chose)."""
    diff, norm = float((out.double() - ref.double()).norm()), float(ref.double().norm())
    return diff / norm if norm else diff


@pytest.fixture(scope="module")
def model():
    gen = torch.Generator(device="cuda").manual_seed(1)
    routing = Routing(
        (torch.randn(EXPERTS, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).bfloat16(),
        torch.randn(EXPERTS, generator=gen, device="cuda") * 0.1,
        TOP_K, 1, 1, True, 2.5,
    )  # fmt: skip
    gate_up = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5
    ).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") * INTER**-0.5).bfloat16()
    return routing, gate_up, down, (*quantize_fp8_blocks(gate_up), *quantize_fp8_blocks(down))


def weights_of(model, fp8: bool, span=slice(None)):
    """(gate_up, down, scales) of the experts `span`."""
    _, gate_up, down, (gq, gs, dq, ds) = model
    return (gq[span], dq[span], (gs[span], ds[span])) if fp8 else (gate_up[span], down[span], None)


@pytest.mark.parametrize("tokens", [1, 5, 16, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_matches_the_general_path_and_repeats_bitwise(model, tokens, fp8):
    routing = model[0]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    gate_up, down, scales = weights_of(model, fp8)
    out = fused.routed_experts(x, routing, gate_up, down, LIMIT, scales)
    ids, weights = reference.route(x, *routing)
    if fp8:
        general = kernels.experts_fp8(x, gate_up, scales[0], down, scales[1], ids, weights, LIMIT)
        expected = reference.experts_fp8(x.float(), gate_up, scales[0], down, scales[1], ids, weights, LIMIT)
        assert rel_err(out, expected) < 0.08
    else:
        general = kernels.experts(x, gate_up, down, ids, weights, LIMIT)
    assert rel_err(out, general) < 1e-2
    assert not decode.tickets(x.device).any()
    for _ in range(3):
        assert torch.equal(fused.routed_experts(x, routing, gate_up, down, LIMIT, scales), out)
    with torch.inference_mode():
        assert torch.equal(moe_ops.routed_experts(x, routing, gate_up, down, LIMIT, scales), out)


@pytest.mark.parametrize("tokens", [1, 8, 64])
def test_a_graph_replays_new_inputs_as_eager_steps_do(model, tokens):
    routing = model[0]
    gate_up, down, scales = weights_of(model, True)
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    eager = fused.routed_experts(x, routing, gate_up, down, LIMIT, scales)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused.routed_experts(x, routing, gate_up, down, LIMIT, scales)
    for seed in range(3):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).bfloat16())
        graph.replay()
        assert torch.equal(out, fused.routed_experts(x, routing, gate_up, down, LIMIT, scales))
    assert not torch.equal(out, eager)
    assert not decode.tickets(x.device).any()


@pytest.mark.parametrize("tokens", [1, 8, 64])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_expert_parallel_ranks_add_up_to_the_whole_step(model, tokens, fp8):
    routing, ranks = model[0], 8
    local = EXPERTS // ranks
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    ids, weights = reference.route(x, *routing)
    parts = []
    for rank in range(ranks):
        first = rank * local
        gate_up, down, scales = weights_of(model, fp8, slice(first, first + local))
        part = fused.routed_experts(x, routing, gate_up, down, LIMIT, scales, first)
        none_here = ((ids < first) | (ids >= first + local)).all(1)
        assert not part[none_here].any()
        if fp8:
            general = kernels.experts_fp8(
                x, gate_up, scales[0], down, scales[1], ids, weights, LIMIT, first_expert=first
            )
        else:
            general = kernels.experts(x, gate_up, down, ids, weights, LIMIT, first_expert=first)
        assert rel_err(part, general) < 1e-2
        parts.append(part.float())
    gate_up, down, scales = weights_of(model, fp8)
    assert rel_err(sum(parts), fused.routed_experts(x, routing, gate_up, down, LIMIT, scales)) < 1e-2
