"""A rank of expert parallelism on the GPU: the compiled MoE kernels (the three-launch decode path and
the general path, bf16 and FP8, TMA included) computing only the pairs of the rank's experts, against
the torch reference, the whole step and the other ranks. Run this file on its own process (the
interpreter test modules switch Triton to the interpreter for the whole process)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops import moe as moe_ops
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.moe import decode, kernels, reference
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert
from hylo.ops.moe.routing import align

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

EXPERTS, RANKS, TOP_K, HIDDEN, INTER, LIMIT = 64, 8, 8, 1024, 512, 7.0
LOCAL = EXPERTS // RANKS


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative error; 0 where both are zero (a rank none of whose experts a token chose)."""
    diff, norm = float((out.double() - ref.double()).norm()), float(ref.double().norm())
    return diff / norm if norm else diff


@pytest.fixture(scope="module")
def model():
    gen = torch.Generator(device="cuda").manual_seed(0)
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


def rank_weights(model, rank: int | None, fp8: bool):
    """(gate_up, down, scales, first_expert) of `rank`, or of every expert for None."""
    _, gate_up, down, (gq, gs, dq, ds) = model
    mine = slice(None) if rank is None else slice(rank * LOCAL, (rank + 1) * LOCAL)
    first = None if rank is None else rank * LOCAL
    if fp8:
        return gq[mine], dq[mine], (gs[mine], ds[mine]), first
    return gate_up[mine], down[mine], None, first


# 1 and 8 tokens take the three-launch path, 100 the general one with 16-row blocks, 3000 the 64-row
# blocks (TMA for FP8)
@pytest.mark.parametrize("tokens", [1, 8, 100, 3000])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_ranks_pairs_only(model, tokens, fp8):
    routing = model[0]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    choices = reference.route(x, routing)
    ids, weights = choices
    parts = []
    for rank in range(RANKS):
        gate_up, down, scales, first = rank_weights(model, rank, fp8)
        with torch.inference_mode():
            out = moe_ops.routed_experts(x, routing, gate_up, down, LIMIT, scales, first)
        if fp8:  # the same rows as the whole step's, with the other ranks' pairs weighted 0
            local = (ids >= first) & (ids < first + LOCAL)
            gq, gs, dq, ds = model[3]
            whole = kernels.experts(
                x, ExpertWeights(gq, dq, (gs, ds)), Choices(ids, weights.where(local, 0)), LIMIT
            )
            assert rel_err(out, whole) < 1e-2
            expected = reference.experts(
                x.float(), ExpertWeights(gate_up, down, scales), choices, LIMIT, first
            )
            assert rel_err(out, expected) < 0.08
        else:
            plain = ExpertWeights(gate_up.float(), down.float())
            expected = reference.experts(x.float(), plain, choices, LIMIT, first)
            assert rel_err(out, expected) < 1e-2
        parts.append(out.float())
    gate_up, down, scales, _ = rank_weights(model, None, fp8)
    with torch.inference_mode():
        whole = moe_ops.routed_experts(x, routing, gate_up, down, LIMIT, scales)
    assert rel_err(sum(parts), whole) < 1e-2


def test_the_decode_path_of_a_rank_replays_in_a_cuda_graph(model):
    routing = model[0]
    gate_up, down, scales, first = rank_weights(model, 3, True)
    w = ExpertWeights(gate_up, down, scales)
    x = torch.randn(4, HIDDEN, device="cuda").bfloat16()
    eager = decode.routed_experts(x, routing, w, LIMIT, first_expert=first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode.routed_experts(x, routing, w, LIMIT, first_expert=first)
    x.copy_(torch.randn_like(x))
    graph.replay()
    torch.testing.assert_close(out, decode.routed_experts(x, routing, w, LIMIT, first_expert=first))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("first", [None, 0, 24])
@pytest.mark.parametrize("tokens", [1, 4, 8])
def test_the_prologue_places_as_align_does(model, tokens, first):
    """The three-launch path's alignment has the general one's blocks, past the real count too (a block
    left with a stale expert makes the GEMMs read outside the weights). At 64 experts and 64 pairs,
    placing from the routing's registers left stale blocks and dropped a rank's pairs."""
    routing = model[0]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    local = EXPERTS if first is None else LOCAL
    ids, _, layout, _, _ = decode.prologue(x, routing, 16, False, first_expert=first, num_experts=local)
    general = align(ids, local, 16, first)
    assert torch.equal(layout.block_expert, general.block_expert)
    assert torch.equal(layout.block_rows, general.block_rows)


@pytest.mark.parametrize("tokens", [1, 8, 100])  # the three-launch path, then the general one
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_shared_experts_addend_is_the_add_after_the_step(model, tokens, fp8):
    """bf16 on the GPU: the addend the three-launch step adds in its combine (the shared expert's
    output) gives bit for bit the step's output plus it, rounded to nearest even as torch's add is; a
    rank's step too. (The CPU test runs fp32: the interpreter rounds to bf16 otherwise.)"""
    routing = model[0]
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    addend = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    for rank in (None, 3):
        gate_up, down, scales, first = rank_weights(model, rank, fp8)
        alone = moe_ops.routed_experts(x, routing, gate_up, down, LIMIT, scales, first)
        joined = moe_ops.routed_experts(x, routing, gate_up, down, LIMIT, scales, first, addend)
        assert torch.equal(joined, alone + addend), (rank, tokens)


@pytest.mark.parametrize("tokens", [1, 8])
@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_a_ranks_slice_of_the_shared_expert_joins_its_launches(model, tokens, fp8):
    """A rank's tensor slice of the shared expert (intermediate 128 beside the routed experts' 512), in
    the rank's three launches: within the bf16 rounding of its rows of the step with the slice's output
    as the addend (the same GEMMs; the joined step rounds the slice's rows once, the addend step its
    sum and the addend's add: a bf16 ulp on a few elements), on a rank whose one token splits its
    gate|up K."""
    routing = model[0]
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    width = 128
    gate_up = (torch.randn(2 * width, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5).bfloat16()
    down = (torch.randn(HIDDEN, width, generator=gen, device="cuda") * width**-0.5).bfloat16()
    if fp8:
        (gq, gs), (dq, ds) = quantize_fp8_blocks(gate_up), quantize_fp8_blocks(down)
        shared = SharedExpert(gq, dq, (gs, ds))
    else:
        shared = SharedExpert(gate_up, down)
    x = torch.randn(tokens, HIDDEN, device="cuda").bfloat16()
    for rank in (None, 3):
        w_gate_up, w_down, scales, first = rank_weights(model, rank, fp8)
        w = ExpertWeights(w_gate_up, w_down, scales)
        assert kernels.shared_refusal(w, shared) is None
        rows = reference.shared_expert(x, shared, LIMIT)
        joined = decode.routed_experts(x, routing, w, LIMIT, first_expert=first, shared=shared)
        apart = decode.routed_experts(x, routing, w, LIMIT, first_expert=first, addend=rows.to(x.dtype))
        assert rel_err(joined, apart) < (0.1 if fp8 else 1e-2), (rank, tokens)
        plain = ExpertWeights(*(t.float() for t in rank_weights(model, rank, False)[:2]))
        truth = reference.experts(
            x.float(), plain,
            reference.route(x, routing), LIMIT, first, SharedExpert(gate_up.float(), down.float()),
        )  # fmt: skip
        assert rel_err(joined, truth) < (0.1 if fp8 else 1e-2), (rank, tokens)
