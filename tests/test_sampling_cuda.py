"""Seeded sampling on the GPU: the counter-based noise is the CPU's (int64 wrapping arithmetic on CUDA
too), and seeded sampled requests give plain decoding's tokens under DFlash and MTP speculation with
the adaptive policy, through the decode and verify CUDA graphs, alone and in a batch.

fp32 weights, but not fp32-exact forwards: Triton's fp32 dots run in TF32 (inputs rounded to 2^-11
relative) in some kernels, the verify forward's multi-token kernels are not the decode step's, and the
model's discrete choices (routed experts, the indexer's pools) can turn such a difference into a larger
one. A pick can then flip between the engines (on an H100: one of the three DFlash prompts, at its 18th
token, with plain decoding's noisy margin 0.35, and plain decoding's token not even among the
speculative forward's top 20: more than TF32 rounding explains, an expert or pool choice that flipped
or a defect of a GPU verify path, not yet told apart). The test allows one flipped prompt and checks
that the flip is numerics, not sampling: both engines return the logprobs of the forward that picked
each token, and at the first differing token each engine's pick must be the Gumbel-max pick of its
own logits under the same noise (seed, position): its noisy margin over the other engine's pick is
>= 0. A wrong noise (another position's, another seed's) fails that at once: under it the
speculative pick is not the argmax of its logits plus the right noise."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_reference import write_dflash_checkpoint
from hf_reference import tiny_text_config
from test_sampling_schedule import OTHERS, PROMPTS, SEEDED
from test_speculative_cuda import BLOCK, HIDDEN, VOCAB, cache_fraction, flags

from hylo import LLM, SamplingParams
from hylo.sampling_noise import as_int64, exponential_noise, mix64

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def test_noise_on_the_gpu_is_the_cpus():
    """The hash bit for bit; the noise within 2 ulps relative (the same exact uniforms through CUDA's
    and the CPU's fp32 log, each correct to an ulp), at the full vocabulary's width."""
    values = torch.tensor([0, 1, -1, 2**63 - 1, -(2**63), 0x0123456789ABCDEF, -0x0123456789ABCDEF])
    assert torch.equal(mix64(values.cuda()).cpu(), mix64(values))
    seeds = torch.tensor([as_int64(s) for s in range(2**64 - 32, 2**64)] + list(range(32)))
    positions = torch.arange(64) * 977
    on_gpu = exponential_noise(seeds.cuda(), positions.cuda(), 154880).cpu()
    torch.testing.assert_close(on_gpu, exponential_noise(seeds, positions, 154880), rtol=2 * 2.0**-23, atol=0)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(a config-only target directory, its weights `load_format="dummy"`'s, a DFlash draft for it)."""
    target = tmp_path_factory.mktemp("target")
    text = {"model_type": "glm5_next_text", **tiny_text_config(4, 8)}
    (target / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    draft = write_dflash_checkpoint(
        tmp_path_factory.mktemp("draft"), HIDDEN, VOCAB, [0, 2, 4], seed=5, block_size=BLOCK
    )
    return target, draft


def make_llm(path, **kwargs) -> LLM:
    return LLM(
        str(path), device="cuda", dtype="float32", load_format="dummy", page_size=16, context_length=256,
        max_running_requests=8, cuda_graph_max_bs=8, mem_fraction_static=cache_fraction(), **kwargs,
    )  # fmt: skip


# the seeded requests with their top 20 logprobs (the most a request may ask for; VOCAB is 160)
LOGGED = [s.model_copy(update={"logprobs": 20}) for s in SEEDED]


# fp32 logprobs of O(10) carry ~1e-6 of rounding, the noise's log 2 ulps: a margin's recomputation is
# good to ~1e-5; a wrong noise moves it by a Gumbel spread (~1.3)
ROUNDING = 1e-4


def seeded_outputs(llm: LLM) -> tuple[list, list]:
    """(alone, batched): each seeded prompt's completion (tokens and logprobs) run alone, and in a
    batch with `OTHERS`."""
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0].outputs[0]
        for p, s in zip(PROMPTS, LOGGED, strict=True)
    ]
    prompts, params = [p for p, _ in OTHERS] + PROMPTS, [s for _, s in OTHERS] + LOGGED
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return alone, [o.outputs[0] for o in batched[len(OTHERS) :]]


def pick_margin(
    logprobs: dict[int, float], params: SamplingParams, position: int, pick: int, other: int
) -> float:
    """log(p(pick)/E(pick)) - log(p(other)/E(other)), with p the tempered top-p distribution of
    `logprobs` (one forward's raw top logprobs at a sampled position, its pick among them) and E the
    noise of (seed, `position`): the Gumbel-max margin by which the forward's pick beats `other`
    (`hylo.sampling`). Exact where `other` is listed; where it is not, its logprob is at most the
    smallest listed, which bounds the margin from below, and where the listed tokens already hold
    the top-p nucleus `other` is outside it and never picked (an infinite margin)."""
    noise = exponential_noise(torch.tensor([as_int64(params.seed)]), torch.tensor([position]), VOCAB)[0]
    other_logprob = logprobs.get(other)
    if other_logprob is None:  # below the n-th largest (the pick may be listed past the top n)
        top = sorted(logprobs.values(), reverse=True)[: params.logprobs]
        if torch.tensor(top[:-1]).exp().sum() >= params.top_p:  # the nucleus ends within the top n - 1
            return float("inf")
        other_logprob = top[-1]
    scores = (logprobs[pick] - other_logprob) / params.temperature
    return scores - float(noise[pick].log()) + float(noise[other].log())


@pytest.mark.parametrize("algorithm", ["dflash", "mtp"])
def test_seeded_sampling_through_the_graphs_gives_plain_decodings_tokens(models, algorithm):
    path, draft = models
    plain = make_llm(path)
    spec = make_llm(
        path, target=plain.engine.model, **{**flags(algorithm, draft), "speculative_adaptive": True}
    )
    assert spec.engine.runner.verify_graphs is not None and plain.engine.runner.graphs is not None
    replayed, run = [], spec.engine.runner.verify_graphs.run
    spec.engine.runner.verify_graphs.run = lambda seqs, *rest: replayed.append(len(seqs)) or run(seqs, *rest)
    expected_alone, expected_batched = seeded_outputs(plain)
    assert [o.token_ids for o in expected_alone] == [o.token_ids for o in expected_batched]
    got_alone, got_batched = seeded_outputs(spec)
    assert replayed, "no verify step went through the graphs"
    flipped = set()
    for got in (got_alone, got_batched):
        for i, (prompt, params, want, out) in enumerate(
            zip(PROMPTS, LOGGED, expected_alone, got, strict=True)
        ):
            assert len(out.token_ids) == len(want.token_ids)
            pairs = enumerate(zip(want.token_ids, out.token_ids, strict=True))
            k = next((k for k, (a, b) in pairs if a != b), None)
            if k is None:
                continue
            flipped.add(i)
            a, b, position = want.token_ids[k], out.token_ids[k], len(prompt) + k
            # each engine picked the Gumbel-max token of its own forward's logits under the same noise
            # (up to ROUNDING: the margins are recomputed here from rounded logprobs)
            assert pick_margin(want.logprobs[k], params, position, a, b) >= -ROUNDING, (i, k)
            assert pick_margin(out.logprobs[k], params, position, b, a) >= -ROUNDING, (i, k)
    assert len(flipped) <= 1, f"{len(flipped)} of {len(PROMPTS)} prompts left plain decoding's tokens"
