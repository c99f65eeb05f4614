"""The two-launch MoE step of a few tokens (`hylo.ops.moe.fused`) against the torch reference and the
general path, under the Triton interpreter on the CPU.

The interpreter runs a launch's programs one after another, so each (token, column tile) is summed by
the program that brings its ticket to the end, as on the GPU. As in test_moe_kernels.py, the "bf16"
experts run on fp32 here (the interpreter's bf16 `tl.dot` is wrong); the FP8 experts run on e4m3.

Tolerances: fp32 experts differ from the reference and the general path only in the order of fp32 sums
(partial rows per 128-column slice, summed per token), a few ulps of values of order 1: < 2e-6
relative. FP8 experts quantise x and h as the general path does (the same groups, the same rounding), so
they differ from it by the fp32 order too, plus, with bf16 x, the general path's rounding of each of the
k rows to bf16 before its sum (≤ k half-ulps of bf16, 2^-9 relative each).
"""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from test_moe_decode import LIMIT, Experts, random_routing  # noqa: E402
from test_moe_kernels import rel_err  # noqa: E402

from hylo.ops.moe import decode, fused, kernels, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def general(x, routing_, experts: Experts, fp8: bool, first: int | None = None, span=slice(None)):
    """The general path's kernels on the reference routing (the truth of the FP8 arithmetic)."""
    ids, weights = reference.route(x, *routing_)
    if fp8:
        weights_of = (
            experts.gate_up_q[span],
            experts.gate_up_s[span],
            experts.down_q[span],
            experts.down_s[span],
        )
        return kernels.experts_fp8(x, *weights_of, ids, weights, LIMIT, first_expert=first)
    return kernels.experts(
        x, experts.gate_up[span], experts.down[span], ids, weights, LIMIT, first_expert=first
    )


def step(x, routing_, experts: Experts, fp8: bool, first: int | None = None, span=slice(None)):
    if fp8:
        scales = (experts.gate_up_s[span], experts.down_s[span])
        return fused.routed_experts(
            x, routing_, experts.gate_up_q[span], experts.down_q[span], LIMIT, scales, first
        )
    return fused.routed_experts(x, routing_, experts.gate_up[span], experts.down[span], LIMIT, None, first)


@pytest.mark.parametrize(
    ("tokens", "hidden", "inter", "num_experts", "top_k"),
    [
        (1, 128, 256, 8, 4),  # one token: programs = k experts x 2 slices
        (5, 160, 48, 6, 4),  # D a partial column tile, I a partial slice; tokens share experts
        (24, 64, 128, 4, 3),  # an expert with more than 16 tokens: two chunks of pairs
    ],
)
def test_fp32_experts_match_the_reference(tokens, hidden, inter, num_experts, top_k):
    g = torch.Generator().manual_seed(tokens + hidden)
    x = torch.randn(tokens, hidden, generator=g)
    routing_, experts = random_routing(g, hidden, num_experts, top_k), Experts(g, hidden, inter, num_experts)
    ids, weights = reference.route(x, *routing_)
    if tokens == 24:  # the routing puts more than one chunk of pairs on some expert
        assert int(torch.bincount(ids.flatten()).max()) > fused.BLOCK_M
    out = step(x, routing_, experts, fp8=False)
    assert out.shape == x.shape and out.dtype == x.dtype
    assert rel_err(out, reference.experts(x, experts.gate_up, experts.down, ids, weights, LIMIT)) < 2e-6
    assert rel_err(out, general(x, routing_, experts, fp8=False)) < 2e-6


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-6), (torch.bfloat16, 4e-3)])
@pytest.mark.parametrize("tokens", [1, 7])
def test_fp8_experts_match_the_general_path(tokens, dtype, tolerance):
    g = torch.Generator().manual_seed(10 + tokens)
    hidden, inter, num_experts, top_k = 256, 256, 8, 4
    x = torch.randn(tokens, hidden, generator=g).to(dtype)
    routing_, experts = random_routing(g, hidden, num_experts, top_k), Experts(g, hidden, inter, num_experts)
    routing_ = routing_._replace(weight=routing_.weight.to(dtype))
    out = step(x, routing_, experts, fp8=True)
    assert out.dtype == dtype
    assert rel_err(out, general(x, routing_, experts, fp8=True)) < tolerance
    # e4m3 activations: a few percent from the reference on the original weights
    ids, weights = reference.route(x, *routing_)
    assert (
        rel_err(out, reference.experts(x.float(), experts.gate_up, experts.down, ids, weights, LIMIT)) < 0.1
    )


def test_the_largest_step_matches_the_reference():
    """`fused.MAX_PAIRS` pairs (64 tokens at top-8) over few experts: every expert shared by many tokens."""
    g = torch.Generator().manual_seed(64)
    tokens, top_k = fused.MAX_PAIRS // 8, 8
    x = torch.randn(tokens, 64, generator=g)
    routing_, experts = random_routing(g, 64, 12, top_k), Experts(g, 64, 128, 12)
    assert fused.fits(tokens, top_k, 64) and not fused.fits(tokens + 1, top_k, 64)
    ids, weights = reference.route(x, *routing_)
    out = step(x, routing_, experts, fp8=False)
    assert rel_err(out, reference.experts(x, experts.gate_up, experts.down, ids, weights, LIMIT)) < 2e-6


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
def test_an_expert_parallel_rank_computes_its_pairs_and_zeroes_the_rest(fp8):
    """Two ranks holding 6 of 12 experts each; the routing keeps every token's choices in one half (two
    groups, one kept), so every token has all its pairs on one rank and none on the other, where its row
    must be exactly zero (no program computes it). The ranks add up to the whole step."""
    g = torch.Generator().manual_seed(23)  # a routing with tokens on both halves
    tokens, hidden, inter = 6, 128, 128
    x = torch.randn(tokens, hidden, generator=g)
    routing_ = random_routing(g, hidden, 12, 3, n_group=2, topk_group=1)
    experts = Experts(g, hidden, inter, 12)
    ids, weights = reference.route(x, *routing_)
    parts = []
    for first in (0, 6):
        span = slice(first, first + 6)
        part = step(x, routing_, experts, fp8, first, span)
        mine = ((ids >= first) & (ids < first + 6)).all(1)
        none = ((ids < first) | (ids >= first + 6)).all(1)
        assert (mine | none).all() and mine.any() and none.any()
        assert not part[none].any()
        expected = general(x, routing_, experts, fp8, first, span)
        assert rel_err(part, expected) < 2e-6
        if not fp8:
            local = reference.experts(
                x, experts.gate_up[span], experts.down[span], ids, weights, LIMIT, first
            )
            assert rel_err(part, local) < 2e-6
        parts.append(part)
    assert rel_err(parts[0] + parts[1], step(x, routing_, experts, fp8)) < 2e-6


def test_a_rank_none_of_whose_experts_is_chosen_returns_zeros():
    g = torch.Generator().manual_seed(22)
    x = torch.randn(1, 64, generator=g)
    routing_, experts = random_routing(g, 64, 12, 2), Experts(g, 64, 32, 12)
    ids, _ = reference.route(x, *routing_)
    first = next(f for f in (0, 4, 8) if not ((ids >= f) & (ids < f + 4)).any())
    span = slice(first, first + 4)
    out = fused.routed_experts(x, routing_, experts.gate_up[span], experts.down[span], LIMIT, None, first)
    assert torch.equal(out, torch.zeros_like(x))


def test_tickets_are_left_zero_and_steps_repeat_bitwise():
    """Every (token, tile) counter is put back to zero by the program that sums it, so the next launch
    (or graph replay) finds them ready; the fixed-order sums make two steps bitwise equal."""
    g = torch.Generator().manual_seed(23)
    x = torch.randn(9, 128, generator=g)
    routing_, experts = random_routing(g, 128, 8, 3), Experts(g, 128, 256, 8)
    first = step(x, routing_, experts, fp8=True)
    assert not decode.tickets(x.device).any()
    assert torch.equal(first, step(x, routing_, experts, fp8=True))
    assert not decode.tickets(x.device).any()


def test_bad_inputs_are_named():
    g = torch.Generator().manual_seed(24)
    routing_, experts = random_routing(g, 64, 8, 8), Experts(g, 64, 32, 8)
    with pytest.raises(ValueError, match="x has 65 tokens, more than 64 at top-8"):
        fused.routed_experts(torch.randn(65, 64), routing_, experts.gate_up, experts.down, LIMIT)
    with pytest.raises(ValueError, match="gate_up_scale_inv"):
        scales = (experts.gate_up_s[:3], experts.down_s)
        fused.routed_experts(torch.randn(2, 64), routing_, experts.gate_up_q, experts.down_q, LIMIT, scales)
