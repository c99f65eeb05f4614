"""Seeded sampling on the GPU: the counter-based noise is the CPU's (int64 wrapping arithmetic on CUDA
too), and seeded sampled requests give plain decoding's tokens under DFlash and MTP speculation with
the adaptive policy, through the decode and verify CUDA graphs, alone and in a batch.

fp32 weights, but not fp32-exact forwards: Triton's fp32 dots run in TF32 (inputs rounded to 2^-11
relative) in some kernels, the verify forward's multi-token kernels are not the decode step's, and the
model's discrete choices (routed experts, the indexer's pools, the top-p nucleus's edge) can turn such a
difference into a larger one, so a pick can flip between the engines. The test allows one flipped
prompt and checks that every pick of both engines is sampling, not numerics: the model's vocabulary is
20 tokens, so the top 20 logprobs a request gets are its forward's whole raw distribution, and at
every output position each engine's pick must be the Gumbel-max pick of that distribution processed as
`hylo.sampling` processes it (temperature, then top-p) under the noise of (seed, position). A wrong
noise (another position's, another seed's), a verify step that reported one forward row's logprobs and
picked from another, or an acceptance against the unprocessed distribution fails that at once.
(The first version listed 20 of 160 tokens: a pick whose rival was unlisted, or at the nucleus's edge,
could not be checked, and the H100's DFlash flips were of that kind.)"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_prompt
from dflash_reference import write_dflash_checkpoint
from hf_reference import tiny_text_config
from test_sampling_schedule import OTHERS as SCHEDULE_OTHERS
from test_sampling_schedule import SEEDED
from test_speculative_cuda import BLOCK, HIDDEN, cache_fraction, flags

from hylo import LLM, SamplingParams
from hylo.sampling import SampleRow, target_distribution
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


# a vocabulary the top-20 logprobs cover: each position's whole raw distribution comes back
VOCAB = 20
PROMPTS = [random_prompt(n, VOCAB, seed=600 + n) for n in (5, 13, 21)]
# the others in the batch (test_sampling_schedule's parameters): unseeded, greedy, other temperatures
OTHERS = [
    (random_prompt(n, VOCAB, seed=i + 1), params)
    for i, (n, (_, params)) in enumerate(zip((9, 30, 3), SCHEDULE_OTHERS, strict=True))
]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """(a config-only target directory of a `VOCAB`-token model, its weights `load_format="dummy"`'s,
    a DFlash draft for it)."""
    target = tmp_path_factory.mktemp("target")
    text = {"model_type": "glm5_next_text", **tiny_text_config(4, 8, vocab_size=VOCAB)}
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


# the seeded requests with every token's logprob (the top 20 of a 20-token vocabulary)
LOGGED = [s.model_copy(update={"logprobs": VOCAB}) for s in SEEDED]

# fp32 logprobs of O(10) carry ~1e-6 of rounding, the noise's log 2 ulps, the engine's fp32 softmax and
# cumulative sum a few ulps: a score or a nucleus mass recomputed here in fp64 is good to ~1e-5
ROUNDING = 1e-4


def gumbel_max_picks(logprobs: dict[int, float], params: SamplingParams, position: int) -> set[int]:
    """The tokens `hylo.sampling` may pick at `position` from a forward's raw distribution
    `logprobs` (every token's) under the noise of (params.seed, position): the Gumbel-max pick of the
    tempered top-p distribution, and any token within `ROUNDING` of it, or of the pick with the top-p
    threshold moved by `ROUNDING` (a token at the nucleus's edge)."""
    assert sorted(logprobs) == list(range(VOCAB)), "a position's logprobs are not the whole distribution"
    logits = torch.tensor([logprobs[t] for t in range(VOCAB)], dtype=torch.float64)[None]
    noise = exponential_noise(torch.tensor([as_int64(params.seed)]), torch.tensor([position]), VOCAB)[0]
    picks = set()
    for top_p in (params.top_p - ROUNDING, params.top_p, min(1.0, params.top_p + ROUNDING)):
        row = SampleRow(params.model_copy(update={"top_p": top_p}), [], [], params.seed, [])
        scores = (target_distribution(logits, [row])[1][0] / noise.double()).log()
        picks |= set(torch.nonzero(scores >= scores.max() - ROUNDING)[:, 0].tolist())
    return picks


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


def assert_gumbel_max_picks(outputs: list, engine: str) -> None:
    """Every pick of `outputs` (the seeded prompts' completions) is sampling from its own forward."""
    for i, (prompt, params, out) in enumerate(zip(PROMPTS, LOGGED, outputs, strict=True)):
        for k, (token, logprobs) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
            picks = gumbel_max_picks(logprobs, params, len(prompt) + k)
            assert token in picks, (
                f"{engine}: prompt {i}, output token {k}: picked {token}, Gumbel-max {picks}"
            )


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
    for name, outputs in (("plain", expected_alone), ("plain, batched", expected_batched),
                          (algorithm, got_alone), (f"{algorithm}, batched", got_batched)):  # fmt: skip
        assert_gumbel_max_picks(outputs, name)
    flipped = {
        i
        for got in (got_alone, got_batched)
        for i, (want, out) in enumerate(zip(expected_alone, got, strict=True))
        if out.token_ids != want.token_ids
    }
    assert len(flipped) <= 1, f"{len(flipped)} of {len(PROMPTS)} prompts left plain decoding's tokens"
