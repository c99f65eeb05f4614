"""hylo's GLM-5.3-Flash against the `transformers` 5.23 reference on tiny random checkpoints."""

from __future__ import annotations

import pytest
import torch
from conftest import Caches, random_prompt
from tolerance import model_accumulation_terms, relative_tolerance

from hylo import LLM, SamplingParams
from hylo.forward_batch import ForwardBatch

PROMPT_LENS = (37, 70, 13)  # none a multiple of 4 or 16; all far beyond the top-k on the long ones


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """The worst row's max difference relative to that row's scale."""
    return ((a - b).abs().amax(-1) / b.abs().amax(-1)).max().item()


def reordering(model) -> float:
    """hylo against itself over other batch shapes: the same arithmetic in another order."""
    return relative_tolerance(model_accumulation_terms(model.config))


def test_indexer_drops_tokens(models):
    model, _ = models
    c = model.config
    assert max(PROMPT_LENS) > c.index_topk + c.index_kpool, "selection must really drop tokens"


@pytest.mark.parametrize("length", PROMPT_LENS)
def test_prefill_logits_match_hf(models, length):
    model, hf = models
    ids = random_prompt(length, model.config.vocab_size, seed=length)
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor([ids])).logits[0]
    caches = Caches(model)
    ours = caches.forward(model, [caches.chunk(0, ids, 0)])
    # HF computes other arithmetic (attention without the absorbed kv_b, KDA step by step), not only
    # another order: a fixed bound a few times the reordering one
    assert rel_err(ours, ref) < 1e-4


def test_captured_features_are_hfs_layer_outputs_averaged_over_streams(models):
    """A forward's captured features (a drafter's target features) of every layer are the mean over the
    residual streams of HF's output of that layer (its recorded hidden states, `[B, T, streams, D]`; for the
    last layer HF records the final norm of that mean), the logits unchanged by capturing."""
    model, hf = models
    ids = random_prompt(PROMPT_LENS[0], model.config.vocab_size, seed=3)
    with torch.no_grad():
        out = hf(input_ids=torch.tensor([ids]), output_hidden_states=True)
    layers = tuple(range(model.config.num_hidden_layers))
    caches = Caches(model)
    m = caches.manager
    batch = ForwardBatch.build(
        [caches.chunk(0, ids, 0)], m.table.table, m.tokens, m.states, m.kpool, all_logits=True
    )
    captured = model(batch, layers)
    width = model.config.hidden_size
    features = captured.features.split(width, dim=-1)
    for i in layers[:-1]:
        assert rel_err(features[i], out.hidden_states[i + 1][0].mean(dim=-2)) < 1e-4, i
    with torch.no_grad():
        assert rel_err(model.norm(features[-1]), out.hidden_states[-1][0]) < 1e-4
    assert rel_err(captured.logits, out.logits[0]) < 1e-4


def test_greedy_generation_matches_hf(models, tiny_checkpoint):
    """The engine's greedy tokens (a batched prefill, then decode steps) are HF's greedy tokens: each is
    HF's argmax at its position given the prompt and the tokens before it. One HF forward over the whole
    sequence gives every position's logits (the model is causal), where `generate` ran a forward a token."""
    model, hf = models
    prompts = [random_prompt(n, model.config.vocab_size, seed=100 + n) for n in PROMPT_LENS]
    llm = LLM(str(tiny_checkpoint), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    ours = [
        o.token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    ]
    for prompt, tokens in zip(prompts, ours, strict=True):
        assert len(tokens) == 32
        with torch.no_grad():
            ref = hf(input_ids=torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
        assert tokens == ref.argmax(-1).tolist()


@pytest.mark.parametrize("chunk", [1, 5, 64])
def test_chunked_prefill_matches_one_pass(models, chunk):
    model, _ = models
    ids = random_prompt(70, model.config.vocab_size, seed=7)
    whole_caches = Caches(model)
    whole = whole_caches.forward(model, [whole_caches.chunk(0, ids, 0)])
    caches = Caches(model)
    pieces = [
        caches.forward(model, [caches.chunk(0, ids[start : start + chunk], start)])
        for start in range(0, len(ids), chunk)
    ]
    assert rel_err(torch.cat(pieces), whole) < reordering(model)
    # the caches left behind agree too: the next token's logits are the same either way
    follow = [3]
    a = whole_caches.forward(model, [whole_caches.chunk(0, follow, len(ids))])
    b = caches.forward(model, [caches.chunk(0, follow, len(ids))])
    assert rel_err(b, a) < reordering(model)


def test_mixed_batch_matches_each_alone(models):
    model, _ = models
    vocab = model.config.vocab_size
    prompts = [random_prompt(n, vocab, seed=n) for n in (37, 1, 70, 16, 5)]
    alone = []
    for ids in prompts:
        caches = Caches(model)
        alone.append(caches.forward(model, [caches.chunk(0, ids, 0)]))
    caches = Caches(model)
    together = caches.forward(model, [caches.chunk(i, ids, 0) for i, ids in enumerate(prompts)])
    assert rel_err(together, torch.cat(alone)) < reordering(model)

    # a step mixing a decode, a continued prefill and a fresh prefill, against the same work alone
    steps = [(0, [9], 37), (2, random_prompt(11, vocab, seed=3), 70)]
    mixed = caches.forward(model, [caches.chunk(s, ids, p) for s, ids, p in steps])
    solo = []
    for seq, ids, prefix in steps:
        ref = Caches(model)
        ref.forward(model, [ref.chunk(0, prompts[seq], 0)])
        solo.append(ref.forward(model, [ref.chunk(0, ids, prefix)]))
    assert rel_err(mixed, torch.cat(solo)) < reordering(model)
