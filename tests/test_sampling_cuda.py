"""Seeded sampling on the GPU: the counter-based noise is the CPU's (int64 wrapping arithmetic on CUDA
too), and seeded sampled requests give plain decoding's tokens under DFlash and MTP speculation with
the adaptive policy, through the decode and verify CUDA graphs, alone and in a batch.

fp32 weights, but not fp32-exact forwards: Triton's fp32 dots run in TF32 (inputs rounded to 2^-11
relative) in some kernels, and the verify forward's multi-token kernels are not the decode step's, so
the two forwards' logits differ by ~1e-3. A pick then flips between them only where two tokens' noisy
scores lie that close (on an H100: one of the six DFlash outputs, at its 18th token). The test allows
one such flip and checks that it is one: at the first token where a speculative output leaves plain
decoding's, the two tokens' noisy scores under the plain engine must be within `NEAR_TIE`, where a
wrong noise (another position's, another seed's) would put them a Gumbel spread apart (~1.3)."""

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


def seeded_tokens(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    alone = [
        llm.generate(prompt_token_ids=[p], sampling_params=s, use_tqdm=False)[0].token_ids
        for p, s in zip(PROMPTS, SEEDED, strict=True)
    ]
    prompts, params = [p for p, _ in OTHERS] + PROMPTS, [s for _, s in OTHERS] + SEEDED
    batched = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    return alone, [o.token_ids for o in batched[len(OTHERS) :]]


# |log score difference| that TF32 rounding can explain: logits here are O(1-10) and differ by ~1e-3
# relative between the forwards, times 1/T = 1.25; 0.05 leaves a margin of 4x over ~1e-2.
NEAR_TIE = 0.05


def raw_logprob(llm: LLM, prefix: list[int], token: int) -> float:
    """log p(token | prefix) of `llm`'s raw distribution (scored as a prompt)."""
    score = SamplingParams(max_tokens=0, prompt_logprobs=0)
    (scored,) = llm.generate(prompt_token_ids=[[*prefix, token]], sampling_params=score, use_tqdm=False)
    return scored.prompt_logprobs[-1][token]


def noisy_score_gap(
    llm: LLM, prompt: list[int], params: SamplingParams, output: list[int], k: int, other: int
) -> float:
    """log(p(a)/E(a)) - log(p(b)/E(b)) at output position k under `llm`, a = output[k] (its pick) and
    b = `other`: the Gumbel-max margin by which a won (`hylo.sampling`), with p the tempered
    distribution (both tokens in its top-p nucleus) and E the noise of (seed, len(prompt) + k)."""
    prefix, a = prompt + output[:k], output[k]
    noise = exponential_noise(torch.tensor([as_int64(params.seed)]), torch.tensor([len(prefix)]), VOCAB)[0]
    tempered = (raw_logprob(llm, prefix, a) - raw_logprob(llm, prefix, other)) / params.temperature
    return tempered - float(noise[a].log()) + float(noise[other].log())


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
    expected_alone, expected_batched = seeded_tokens(plain)
    assert expected_alone == expected_batched
    got_alone, got_batched = seeded_tokens(spec)
    assert replayed, "no verify step went through the graphs"
    flips = []
    for got in (got_alone, got_batched):
        for prompt, params, want, out in zip(PROMPTS, SEEDED, expected_alone, got, strict=True):
            assert len(out) == len(want)
            k = next((i for i, (a, b) in enumerate(zip(want, out, strict=True)) if a != b), None)
            if k is not None:
                flips.append(noisy_score_gap(plain, prompt, params, want, k, out[k]))
    # >= 0: plain decoding picked its token by that margin (a check of the margin's computation)
    assert all(0 <= gap < NEAR_TIE for gap in flips), flips
    assert len(flips) <= 1, f"{len(flips)} of {2 * len(PROMPTS)} outputs left plain decoding's: {flips}"
