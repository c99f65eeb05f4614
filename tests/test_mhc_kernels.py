"""mHC Triton kernels against the torch reference, under the Triton interpreter on the CPU.

Small shapes (hidden 64-96, several token blocks, hidden sizes that the splits and chunks do not divide),
a small plan with several splits and chunks, and the default decode and prefill plans;
fp32 streams, where both sides are exact up to rounding order, and fp16 streams with an fp32 `fn`
(the split-`fn` projection). bf16 is checked at real shapes on the GPU by
`benchmarks/kernels/mhc_moe.py`: the interpreter's bf16 `tl.dot` is not trustworthy and its fp32 → bf16
casts truncate where the GPU rounds to nearest.
No program waits on another, so running them one after another (as the interpreter does) checks all
there is to check.
"""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import dataclasses  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import Caches, random_prompt  # noqa: E402

import hylo.ops.mhc as mhc_ops  # noqa: E402
from hylo.config import ModelConfig  # noqa: E402
from hylo.forward_batch import ForwardBatch  # noqa: E402
from hylo.models import demo  # noqa: E402
from hylo.models.glm5_next import Glm5NextForCausalLM  # noqa: E402
from hylo.models.random_init import randomize  # noqa: E402
from hylo.ops.mhc import BlockNorm, HCParams, PendingPost, kernels, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

RMS_EPS, HC_EPS, ITERS = 1e-6, 1e-6, 20
# two projection splits, two finishing chunks and tokens per finishing program over several blocks
SMALL = kernels.SplitPlan(
    split=32, block_m=16, block_k=16, collapse_tokens=4, collapse_chunk=32, collapse_k=16
)
PLANS = {
    "small": SMALL,
    "whole rows": dataclasses.replace(SMALL, collapse_chunk=64, collapse_k=64),
    "decode": kernels.DECODE_PLAN,
    "prefill": kernels.PREFILL_PLAN,
}


def hc_case(tokens: int, hidden: int, seed: int, dtype=torch.float32, iters: int = ITERS):
    """Streams, an out, hyper-connection parameters and the previous block's (post, comb)."""
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, 4, hidden, generator=g).to(dtype)
    out = torch.randn(tokens, hidden, generator=g).to(dtype)
    fn = torch.randn(24, 4 * hidden, generator=g) * (4 * hidden) ** -0.5
    base = torch.randn(24, generator=g)
    scale = torch.rand(3, generator=g) + 0.5
    post = 2 * torch.rand(tokens, 4, generator=g)
    comb = torch.rand(tokens, 4, 4, generator=g)
    return streams, out, HCParams(fn, base, scale, RMS_EPS, HC_EPS, iters), post, comb


def assert_pre_close(got, ref, tol):
    for name, a, b in zip(("post", "comb", "block input"), got, ref, strict=True):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        torch.testing.assert_close(a.float(), b.float(), **tol, msg=lambda m, name=name: f"{name}: {m}")


FP32 = {"rtol": 1e-5, "atol": 1e-5}
FP16 = {"rtol": 2e-3, "atol": 2e-3}  # one fp16 rounding of the block input


# The Sinkhorn loop is the costliest part of a finishing program under the interpreter, and the decode plan
# runs one per token: its 17-token case takes two iterations (the loop body still runs), its one-token case
# the real twenty. 17 tokens: the fewest that fill a 16-token block and start another.
@pytest.mark.parametrize(
    ("tokens", "hidden", "plan", "iters"),
    [
        (1, 64, "small", ITERS),  # decode: one token
        # two token blocks, the last partial; splits and chunks that do not divide hidden
        (17, 96, "small", ITERS),
        (1, 64, "decode", ITERS),
        (17, 96, "decode", 2),  # two projection token blocks, 17 one-token finishing programs
        (17, 96, "prefill", ITERS),  # four tokens per finishing program, the last group partial
    ],
)
def test_pre_matches_reference(tokens, hidden, plan, iters):
    streams, _, params, _, _ = hc_case(tokens, hidden, seed=tokens, iters=iters)
    got = kernels.mhc_pre(streams, params, plan=PLANS[plan])
    assert_pre_close(got, reference.mhc_pre(streams, params), FP32)


def test_default_plan_by_token_count():
    assert kernels.default_plan(kernels.PREFILL_PLAN_FROM - 1) == kernels.DECODE_PLAN
    assert kernels.default_plan(kernels.PREFILL_PLAN_FROM) == kernels.PREFILL_PLAN


def test_pre_fp16_streams_with_fp32_fn():
    """fn keeps its fp32 precision: projected as two fp16 halves, the logits match to fp32 level."""
    # two finishing token groups, the last partial; two Sinkhorn iterations (the loop is not what is checked)
    streams, _, params, _, _ = hc_case(5, 64, seed=3, dtype=torch.float16, iters=2)
    post, comb, x = kernels.mhc_pre(streams, params, plan=SMALL)
    ref_post, ref_comb, ref_x = reference.mhc_pre(streams, params)
    torch.testing.assert_close(post, ref_post, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(comb, ref_comb, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(x.float(), ref_x.float(), **FP16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_post_is_the_exact_mix_rounded_once(dtype):
    """New streams: the exact mix (fp64, with post and comb cast to the streams' dtype as the
    reference casts them) rounded once; torch rounds three times (product, matmul, sum)."""
    streams, out, _, post, comb = hc_case(19, 96, seed=5, dtype=dtype)
    got = kernels.mhc_post(out, streams, post, comb, block_m=16, block_k=64)
    ref = reference.mhc_post(out, streams, post, comb)
    mixed = comb.to(dtype).double().transpose(-1, -2) @ streams.double()
    exact = post.to(dtype).double()[..., None] * out.double()[:, None, :] + mixed
    assert got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, **FP32)
    else:
        assert (got == exact.to(dtype)).double().mean() > 0.999
        assert (got.double() - exact).abs().max() <= (ref.double() - exact).abs().max()


@pytest.fixture
def kernels_on_cpu(monkeypatch):
    """The dispatcher sends CPU tensors to the kernels (under the interpreter)."""
    monkeypatch.setattr(mhc_ops, "_use_kernels", lambda op, streams, norm=None, rows=None: True)
    return monkeypatch


def block_norm(hidden: int, seed: int, dtype=torch.float32) -> BlockNorm:
    g = torch.Generator().manual_seed(seed)
    return BlockNorm((1 + 0.5 * torch.randn(hidden, generator=g)).to(dtype), 1e-5)


@pytest.mark.parametrize(
    ("tokens", "prefill_plan_from", "whole_rows_max"),
    [(1, kernels.PREFILL_PLAN_FROM, kernels.WHOLE_ROWS_MAX), (19, 1, kernels.WHOLE_ROWS_MAX), (19, 1, 64)],
)
def test_enter_matches_reference(kernels_on_cpu, tokens, prefill_plan_from, whole_rows_max):
    """The dispatcher's enter through the kernels, on the decode plan (1 token: post and norm fused), the
    prefill entry's plan (post mixed by the projection, the norm fused into whole-row finishing programs)
    and, for rows wider than those take, the prefill plan (post and norm launched apart), against post, pre
    and RMSNorm of the reference."""
    kernels_on_cpu.setattr(kernels, "PREFILL_PLAN_FROM", prefill_plan_from)
    kernels_on_cpu.setattr(kernels, "WHOLE_ROWS_MAX", whole_rows_max)
    streams, out, params, post, comb = hc_case(tokens, 96, seed=7)
    pending, norm = PendingPost(out, post, comb), block_norm(96, seed=7)
    got = mhc_ops.mhc_enter(streams, params, pending, norm)
    ref = reference.mhc_enter(streams, params, pending, norm)
    torch.testing.assert_close(got.streams, ref.streams, **FP32)
    assert_pre_close(got[1:], ref[1:], FP32)


def test_entry_plan_fuses_the_norm_of_a_prefill_entry_in_whole_rows():
    """A prefill entry with its block's norm finishes whole rows (one token a program, the norm fused);
    without the norm, below PREFILL_PLAN_FROM tokens or past WHOLE_ROWS_MAX dims, the default plan."""
    start = kernels.PREFILL_PLAN_FROM
    plan = kernels.entry_plan(start, 4096, with_norm=True)
    assert (plan.collapse_tokens, plan.collapse_chunk, plan.collapse_k) == (1, 4096, 4096)
    assert kernels.norm_fusable(plan, 4096) and plan.split == kernels.PREFILL_PLAN.split
    assert kernels.entry_plan(start, 96, with_norm=True).collapse_k == 128
    assert kernels.entry_plan(start, 4096, with_norm=False) == kernels.PREFILL_PLAN
    assert kernels.entry_plan(start, 6144, with_norm=True) == kernels.PREFILL_PLAN
    assert kernels.entry_plan(start - 1, 4096, with_norm=True) == kernels.DECODE_PLAN
    assert not plan.fuse_post  # no pending post: the projection reads the streams as they are


def test_a_prefill_entry_with_a_pending_post_mixes_it_in_the_projection():
    """With a pending post the whole-row entry plan also fuses the post, in 32-dim projection steps; the
    default and decode plans are unchanged by it."""
    start = kernels.PREFILL_PLAN_FROM
    plan = kernels.entry_plan(start, 4096, with_norm=True, with_post=True)
    assert plan.fuse_post and plan.block_k == kernels.POST_FUSED_BLOCK_K and kernels.norm_fusable(plan, 4096)
    assert kernels.entry_plan(start, 4096, with_norm=False, with_post=True) == kernels.PREFILL_PLAN
    assert kernels.entry_plan(start - 1, 4096, with_norm=True, with_post=True) == kernels.DECODE_PLAN


@pytest.mark.parametrize(("plan", "hidden"), [("decode", 96), ("whole rows", 48), ("small", 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fused_enter_is_post_pre_and_norm_launched_apart(plan, hidden, dtype):
    """The fused launches against post, pre and `ops.norm`'s kernel launched one after another: the new
    streams, post and comb bit for bit (the same operations in the same order); the normalised input up to
    the order of its fp32 sum of squares, which moves the statistic by a few fp32 steps (≤ 1e-6 relative)
    and so a rounding of the fp16 result by at most one step (2^-10 relative). "decode" (one token per
    finishing program) and "whole rows" (four, rows narrower than the tile) hold whole rows in their
    finishing programs (norm fused); "small" does not (norm launched after pre). Two Sinkhorn iterations:
    both sides run the same loop (against the reference: test_pre_matches_reference)."""
    fused = PLANS[plan]
    streams, out, params, post, comb = hc_case(5, hidden, seed=hidden, dtype=dtype, iters=2)
    params = dataclasses.replace(params, fn=params.fn.to(dtype))
    norm = block_norm(hidden, seed=1, dtype=dtype)
    got = kernels.mhc_enter(streams, params, PendingPost(out, post, comb), norm, plan=fused)
    new = kernels.mhc_post(out, streams, post, comb)
    apart = dataclasses.replace(fused, fuse_post=False)
    assert torch.equal(got.streams, new)
    *post_comb, x = kernels.mhc_pre(new, params, plan=apart)
    assert all(map(torch.equal, got[1:3], post_comb))
    from hylo.ops.norm import kernels as norm_kernels

    expected = norm_kernels.rms_norm(x, norm.weight, norm.eps)
    assert got.block_input.dtype == expected.dtype == dtype
    step = 2**-10 if dtype == torch.float16 else 1e-6
    torch.testing.assert_close(got.block_input, expected, rtol=step, atol=step)


# hidden 512 is wider than the prefill plan's finishing steps (256 dims: its rows would fit one, and the norm
# would be fused); the other plans take 64 (the small plan's 16-dim steps still chunk it, the decode plan's
# hold it whole): the launches depend on those comparisons alone, the interpreter's time on the programs.
@pytest.mark.parametrize(
    ("plan", "hidden", "launches"), [("decode", 64, 2), ("small", 64, 3), ("prefill", 512, 4)]
)
def test_launches_of_enter(monkeypatch, plan, hidden, launches):
    """Post, pre and the norm: two launches where the plan fuses them all (decode), one more for the norm
    where the finishing programs hold chunks of rows (small), and one more for post where the plan does
    not fuse it (prefill). The norm's dispatcher is made to launch its kernel on these CPU tensors."""
    from triton.runtime.interpreter import InterpretedFunction

    import hylo.ops.norm as norm_ops

    monkeypatch.setattr(norm_ops, "use_kernel", lambda op, x, verify=None: True)
    names, run = [], InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    # two Sinkhorn iterations (the launches do not depend on them)
    streams, out, params, post, comb = hc_case(1, hidden, seed=3, iters=2)
    norm = block_norm(hidden, 3)
    kernels.mhc_enter(streams, params, PendingPost(out, post, comb), norm, plan=PLANS[plan])
    assert len(names) == launches, names


def test_enter_without_pending_or_norm_is_pre():
    streams, _, params, _, _ = hc_case(5, 64, seed=2, iters=2)  # both sides run the same Sinkhorn loop
    got = kernels.mhc_enter(streams, params, plan=SMALL)
    assert got.streams is streams or torch.equal(got.streams, streams)
    assert all(map(torch.equal, got[1:], kernels.mhc_pre(streams, params, plan=SMALL)))


def test_repeated_launches_give_the_same_bits():
    """Every finishing program sums the partials in the same order, whatever the plan or the timing:
    a second launch repeats the first bit for bit, and plans with the same projection splits agree.
    Five tokens: two token groups of four under SMALL, five of one regrouped."""
    streams, _, params, _, _ = hc_case(5, 64, seed=11, iters=2)
    first = kernels.mhc_pre(streams, params, plan=SMALL)
    second = kernels.mhc_pre(streams, params, plan=SMALL)
    assert all(map(torch.equal, first, second))
    # 64 / 32 = the same two splits as SMALL, other token groups and chunks in the finishing launch
    regrouped = dataclasses.replace(SMALL, collapse_tokens=1, collapse_chunk=64, collapse_k=64)
    assert all(map(torch.equal, first, kernels.mhc_pre(streams, params, plan=regrouped)))


def test_bad_inputs_name_the_tensor():
    streams, out, params, post, comb = hc_case(3, 64, seed=13)
    with pytest.raises(ValueError, match="streams"):
        kernels.mhc_pre(streams[:, :3], params)
    with pytest.raises(ValueError, match="fn"):
        kernels.mhc_pre(streams, dataclasses.replace(params, fn=params.fn[:, :-1]))
    with pytest.raises(ValueError, match="comb"):
        kernels.mhc_post(out, streams, post, comb[:2])
    with pytest.raises(ValueError, match="out"):
        kernels.mhc_post(out.half(), streams, post, comb)
    with pytest.raises(ValueError, match="out"):
        kernels.mhc_enter(streams, params, PendingPost(out[:2], post, comb))
    with pytest.raises(ValueError, match=r"norm\.weight"):
        kernels.mhc_enter(streams, params, norm=BlockNorm(torch.ones(63), 1e-5))
    with pytest.raises(ValueError, match="block_k"):
        kernels.mhc_pre(streams, params, plan=kernels.SplitPlan(split=32, block_k=24))
    with pytest.raises(ValueError, match="collapse_k"):
        kernels.mhc_pre(streams, params, plan=kernels.SplitPlan(collapse_chunk=256, collapse_k=512))


@pytest.fixture(scope="module")
def tiny_model():
    """One layer at hidden 64 with random weights in trained-model ranges: its two hyper-connections are
    the model's mHC paths (the first entered without a pending post, the second with the attention's, the
    last post as the streams' mean); a second layer would enter as the second does, at the interpreter's
    cost of a layer's programs."""
    text = demo._TEXT_CONFIG | dict(
        vocab_size=96,
        pad_token_id=0,
        hidden_size=64,
        num_hidden_layers=1,
        layer_types=["linear_attention"],
        mlp_layer_types=["dense"],
        indexer_types=["full"],
        hc_sinkhorn_iters=3,  # the interpreter is slow; 20 iterations are checked op by op above
    )
    model = Glm5NextForCausalLM(ModelConfig.from_dict({"model_type": "glm5_next", "text_config": text}))
    randomize(model, torch.Generator().manual_seed(0))
    return model


@pytest.mark.parametrize("prefill_plan_from", [kernels.PREFILL_PLAN_FROM, 1])
def test_model_with_kernels_matches_reference_path(tiny_model, monkeypatch, prefill_plan_from):
    """The model with the kernels (19 tokens on the decode plan, then on the prefill plan) against the
    reference path. 19 tokens: the decode plan's projection mixes the pending post into two token blocks
    (the only test where a second block does)."""
    ids = random_prompt(19, tiny_model.config.vocab_size, seed=19)

    def run():
        caches = Caches(tiny_model)
        m = caches.manager
        batch = ForwardBatch.build(
            [caches.chunk(0, ids, 0)], m.table.table, m.tokens, m.states, m.kpool, all_logits=True
        )
        return tiny_model(batch).logits

    ref = run()
    monkeypatch.setattr(mhc_ops, "_use_kernels", lambda op, streams, norm=None, rows=None: True)
    monkeypatch.setattr(kernels, "PREFILL_PLAN_FROM", prefill_plan_from)
    torch.testing.assert_close(run(), ref, rtol=1e-4, atol=1e-4)
