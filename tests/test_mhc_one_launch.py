"""mHC's entry in one launch (`SplitPlan.one_launch_tokens`): the projection launch's last program of each
token block finishes the block (ticket counters, `ops.tickets`), against the same plan in two launches,
under the Triton interpreter (its programs run one after another, so the last program to take its ticket
is the last to run: the test sees the ticket logic, not its memory ordering, which the GPU tests do).

Both paths run `_finish` on the same partials in the same order, so the new streams, post and comb are the
same bits; the normalised block input differs at most by the order of its fp32 sum of squares (the
one-launch program reduces a tile of next_power_of_2(hidden) dims, the finishing launch one of
`collapse_k`): ≤ 1e-6 relative in fp32.
"""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops.mhc import BlockNorm, HCParams, PendingPost, kernels  # noqa: E402
from hylo.ops.tickets import tickets  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def case(tokens: int, hidden: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, 4, hidden, generator=g)
    pending = PendingPost(
        torch.randn(tokens, hidden, generator=g), 2 * torch.rand(tokens, 4, generator=g),
        torch.rand(tokens, 4, 4, generator=g),
    )  # fmt: skip
    hc = HCParams(
        torch.randn(24, 4 * hidden, generator=g) * (4 * hidden) ** -0.5, torch.randn(24, generator=g),
        torch.rand(3, generator=g) + 0.5, 1e-6, 1e-6, 20,
    )  # fmt: skip
    norm = BlockNorm(1 + 0.5 * torch.randn(hidden, generator=g), 1e-5)
    return streams, hc, pending, norm


# a small decode-like plan: two projection splits per token block, whole rows in the finishing launch
PLAN = kernels.SplitPlan(split=32, block_m=16, block_k=16, collapse_chunk=128, collapse_k=128)


@pytest.mark.parametrize(
    ("tokens", "hidden", "with_pending"),
    [
        (1, 64, True),  # decode: one token, the pending post mixed in, the norm fused
        (1, 96, False),  # hidden 96: a 128-wide row tile, masked; pre alone
        (19, 64, True),  # two token blocks (two tickets), the second partial; tokens serial in each
    ],
)
def test_one_launch_enter_is_the_two_launch_enter(tokens, hidden, with_pending):
    streams, hc, pending, norm = case(tokens, hidden, seed=tokens + hidden)
    pending = pending if with_pending else None
    one = kernels.mhc_enter(
        streams, hc, pending, norm, plan=dataclasses.replace(PLAN, one_launch_tokens=tokens)
    )
    two = kernels.mhc_enter(streams, hc, pending, norm, plan=PLAN)
    assert torch.equal(one.streams, two.streams)
    assert torch.equal(one.post, two.post)
    assert torch.equal(one.comb, two.comb)
    torch.testing.assert_close(one.block_input, two.block_input, rtol=1e-6, atol=1e-6)
    assert not tickets(streams.device).any()  # the last program of each block put its counter back


def test_one_launch_enter_repeats_bit_for_bit():
    """A second call finds the counters at zero and gives the same bits (what a graph replay relies on)."""
    streams, hc, pending, norm = case(1, 64, seed=5)
    plan = dataclasses.replace(PLAN, one_launch_tokens=1)
    first = kernels.mhc_enter(streams, hc, pending, norm, plan=plan)
    second = kernels.mhc_enter(streams, hc, pending, norm, plan=plan)
    assert all(map(torch.equal, first, second))


def test_one_launch_tokens_beyond_the_counters_are_refused():
    streams, hc, _, _ = case(1, 64, seed=1)
    plan = dataclasses.replace(PLAN, one_launch_tokens=16 * 256 + 1)
    with pytest.raises(ValueError, match="one_launch_tokens must be within"):
        kernels.mhc_enter(streams, hc, plan=plan)
