"""Seeded sampling on the GPU: the counter-based noise is the CPU's (int64 wrapping arithmetic on CUDA
too), and seeded sampled requests give plain decoding's tokens under DFlash and MTP speculation with
the adaptive policy, through the decode and verify CUDA graphs, alone and in a batch. fp32 weights:
the plain and verify forwards then agree to ~1e-6, so a pick's Gumbel-max flips between them with a
probability of that order (bf16's ~1e-2 would flip a few tokens in a hundred)."""

from __future__ import annotations

import json

import pytest
import torch
from dflash_reference import write_dflash_checkpoint
from hf_reference import tiny_text_config
from test_sampling_schedule import OTHERS, PROMPTS, SEEDED
from test_speculative_cuda import BLOCK, HIDDEN, VOCAB, cache_fraction, flags

from hylo import LLM
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
    assert got_alone == expected_alone
    assert got_batched == expected_alone
    assert replayed, "no verify step went through the graphs"
