"""The engine end to end on the CPU: batching, chunking, preemption, sampling, validation, abort."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from fastapi.testclient import TestClient
from hf_reference import hf_model, tiny_text_config, write_hf_checkpoint

from hylo import LLM, SamplingParams
from hylo.config import ModelConfig
from hylo.memory.kv import TokenCache
from hylo.memory.state import StateCache
from hylo.sampling import sample
from hylo.server.api import build_app
from hylo.server.async_engine import AsyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LENGTHS = [37, 5, 70, 13, 1, 22, 48, 9, 64, 31, 2, 17, 55, 40, 8, 26]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    # The 4-layer mix with every kind (hf_reference 'each-kind') and 3 Sinkhorn iterations of the mHC
    # weights (the real model's 20 are checked op by op in test_mhc_kernels, and the model's at the
    # default in test_hf_parity): each CPU step here is its layers' forwards, and batching, chunking and
    # preemption depend on neither the depth nor that loop's length
    config = tiny_text_config(4, 8, "each-kind", hc_sinkhorn_iters=3)
    return write_hf_checkpoint(tmp_path_factory.mktemp("engine"), config, seed=3)


@pytest.fixture(scope="module")
def prompts():
    return [random_prompt(n, 160, seed=1000 + i) for i, n in enumerate(LENGTHS)]


def make_llm(checkpoint, **kwargs) -> LLM:
    # a 0.25 GB cache (room for every prompt here at once) unless a test sets its own: the default plan's
    # ~2 GB of pools took ~1 s to allocate per engine
    kwargs.setdefault("max_memory_gb", 0.25)
    return LLM(model=str(checkpoint), device="cpu", dtype="float32", page_size=16, **kwargs)


@pytest.fixture(scope="module")
def reference(checkpoint, prompts):
    """Greedy tokens of every prompt from the engine with default settings."""
    outs = make_llm(checkpoint).generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    return [o.token_ids for o in outs]


def test_batch_of_16_matches_hf_greedy_decoding(checkpoint, prompts, reference):
    """Each prompt's tokens are HF's greedy decoding of it: HF's argmax after the prompt and our tokens
    before each position is our token there, so by induction `generate(do_sample=False)` would give
    exactly ours. One HF forward a prompt reads every position (24 decode steps a prompt took ~17 s
    of this file's ~80 here)."""
    import transformers

    transformers.logging.set_verbosity_error()
    hf = hf_model(checkpoint)
    for prompt, ours in zip(prompts, reference, strict=True):
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours[:-1]]), use_cache=False).logits[0, len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == ours


# Prompts of 37, 70, 1, 64 and 17 tokens: for the settings that cost a CPU step per token (one token of
# prefill a step, one request at a time) the boundaries they meet are those all 16 meet (chunks that end
# mid-page, on a page end, a one-token prompt, requests that wait for the one running), in a third of the
# steps (21 s -> 8 s here, alone).
FEW = [0, 2, 4, 8, 11]


@pytest.mark.parametrize(
    ("settings", "which"),
    [
        (dict(chunked_prefill_size=1), FEW),
        (dict(chunked_prefill_size=7), range(len(LENGTHS))),
        (dict(chunked_prefill_size=64), range(len(LENGTHS))),
        (dict(max_running_requests=1), FEW),
        (dict(max_running_requests=16), range(len(LENGTHS))),
    ],
)
def test_outputs_do_not_depend_on_chunking_or_concurrency(checkpoint, prompts, reference, settings, which):
    outs = make_llm(checkpoint, **settings).generate(
        prompt_token_ids=[prompts[i] for i in which], sampling_params=GREEDY, use_tqdm=False
    )
    assert [o.token_ids for o in outs] == [reference[i] for i in which]
    assert all(o.finish_reason == "length" for o in outs)


def test_preemption_keeps_outputs_and_loses_nothing(checkpoint, prompts, reference):
    config = ModelConfig.from_dir(checkpoint)
    token_bytes = TokenCache.bytes_per_token(config, torch.float32)
    slot_bytes = StateCache.bytes_per_slot(config, torch.float32)
    # room for 4 request slots and ~200 tokens: far less than 16 prompts of up to 70 + 24 tokens
    budget = 4 * (slot_bytes + 4 * 256) + 200 * token_bytes
    llm = make_llm(checkpoint, max_memory_gb=budget / 2**30, max_running_requests=4, context_length=256)
    assert llm.engine.plan.max_total_num_tokens < 4 * (70 + 24)
    pages, slots = llm.engine.caches.num_available_pages, llm.engine.caches.slots.num_free
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == reference
    assert (llm.engine.caches.num_available_pages, llm.engine.caches.slots.num_free) == (pages, slots)


def test_seeded_sampling_is_reproducible_across_batches(checkpoint, prompts):
    llm = make_llm(checkpoint)
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=7, max_tokens=16, ignore_eos=True)
    alone = llm.generate(prompt_token_ids=[prompts[0]], sampling_params=params, use_tqdm=False)[0]
    mixed = [SamplingParams(temperature=1.0, max_tokens=5 + i, ignore_eos=True) for i in range(5)]
    batch = llm.generate(
        prompt_token_ids=[prompts[3], prompts[0], *prompts[5:9]],
        sampling_params=[mixed[0], params, *mixed[1:]],
        use_tqdm=False,
    )
    assert batch[1].token_ids == alone.token_ids
    other_seed = llm.generate(
        prompt_token_ids=[prompts[0]], sampling_params=params.model_copy(update={"seed": 8}), use_tqdm=False
    )[0]
    assert other_seed.token_ids != alone.token_ids


def test_n_logprobs_and_greedy_truncations(checkpoint, prompts):
    llm = make_llm(checkpoint)
    out = llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=SamplingParams(
            n=3, temperature=1.0, seed=1, max_tokens=12, ignore_eos=True, logprobs=3
        ),
    )[0]
    assert len(out.outputs) == 3 and len({tuple(c.token_ids) for c in out.outputs}) == 3
    for completion in out.outputs:
        assert len(completion.logprobs) == 12
        for token, entry in zip(completion.token_ids, completion.logprobs, strict=True):
            assert token in entry and 3 <= len(entry) <= 4 and all(v <= 0 for v in entry.values())
    greedy = llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=GREEDY.model_copy(update={"logprobs": 2}),
    )[0]
    for token, entry in zip(greedy.token_ids, greedy.logprobs, strict=True):
        assert entry[token] == max(entry.values())
    # logprobs=0: the picked token's own logprob alone (no top list), same tokens
    own = llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=GREEDY.model_copy(update={"logprobs": 0}),
    )[0]
    assert own.token_ids == greedy.token_ids
    assert [list(e) for e in own.logprobs] == [[t] for t in own.token_ids]
    # top_p=5e-324 rounds to 0 in fp32: the most likely token must still stay. One batch (each
    # truncation is decided row by row; its sort and its min-p mask run on every row, neutral where a
    # row does not ask for it): a generate call each cost ~1 s here
    truncations = (dict(top_k=1), dict(top_p=1e-6), dict(top_p=5e-324), dict(min_p=1.0))
    truncated = llm.generate(
        prompt_token_ids=[prompts[0]] * len(truncations),
        use_tqdm=False,
        sampling_params=[GREEDY.model_copy(update=dict(temperature=1.5, **t)) for t in truncations],
    )
    for truncation, same in zip(truncations, truncated, strict=True):
        assert same.token_ids == greedy.token_ids, truncation


def test_parameters_past_fp32_range_sample_from_the_allowed_tokens():
    """A temperature or repetition penalty beyond fp32's range (valid floats: the schema allows them)
    is the largest fp32 value there, not inf, whose -inf / inf and 0 · inf made NaN probabilities and
    token 0 for a constrained request (found by the server fuzz test): the row samples among the
    tokens its constraint allows; a penalty below fp32's range, not 0, keeps the logits finite."""
    from hylo.sampling import SampleRow, SamplingBatch, target_distribution

    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(2))
    logits[:, 12] = 0.0  # a zero logit among the seen tokens: 0 · inf
    allowed = torch.zeros(2, 40, dtype=torch.bool)
    allowed[:, 10:20] = True
    rows = [
        SampleRow(
            SamplingParams(temperature=1.58e308, top_p=0.6, repetition_penalty=9.2e307),
            [12, 13],
            [],
            0,
            [],
        ),
        SampleRow(SamplingParams(temperature=0.7, repetition_penalty=1e-320), [12, 14], [], 0, []),
    ]
    _, probs = target_distribution(logits, rows, allowed)
    assert not probs.isnan().any() and (probs[~allowed] == 0).all() and (probs.sum(-1) > 0).all()
    picked = sample(logits, SamplingBatch(rows, allowed), torch.tensor([2, 2])).tokens
    assert all(allowed[i, t] for i, t in enumerate(picked.tolist()))


def test_stop_token_ids_and_min_tokens(checkpoint, prompts, reference):
    llm = make_llm(checkpoint)
    stop_at = reference[0][3]
    first = reference[0].index(stop_at)
    out = llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=GREEDY.model_copy(update={"stop_token_ids": [stop_at]}),
    )[0]
    assert out.finish_reason == "stop" and out.token_ids == reference[0][: first + 1]
    delayed = llm.generate(
        prompt_token_ids=[prompts[0]],
        use_tqdm=False,
        sampling_params=GREEDY.model_copy(update={"stop_token_ids": [stop_at], "min_tokens": first + 2}),
    )[0]
    assert stop_at not in delayed.token_ids[: first + 1] and len(delayed.token_ids) >= first + 2


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        (dict(prompt_token_ids=[[5, 6], []]), "prompt"),
        (dict(prompt_token_ids=[[5, 6], [3] * 300]), "context length"),
        (dict(prompt_token_ids=[[5, 6], [3, 160]]), "vocabulary"),
        (dict(prompt_token_ids=[[5, 6], [3, -1]]), "token id -1 is outside the vocabulary"),
        (dict(prompt_token_ids=[[5, 6], [3, 2**70]]), "token ids must be integers"),
        (dict(prompt_token_ids=[[5, 6], [3, 4.0]]), "token ids must be integers"),
    ],
)
def test_bad_prompts_are_rejected_before_any_work(checkpoint, kwargs, field):
    llm = make_llm(checkpoint, context_length=256)
    with pytest.raises(ValueError, match=field) as err:
        llm.generate(sampling_params=GREEDY, use_tqdm=False, **kwargs)
    assert "prompt 1" in str(err.value)
    assert not llm.engine.has_unfinished()


def test_a_checked_prompt_is_not_checked_again(checkpoint, monkeypatch):
    """generate checks every prompt before queueing any, then queues each: one pass over each prompt's
    ids, not two; a prompt checked by another engine, or for other params, is checked again."""
    import hylo.engine.engine as engine_module

    passes = []
    check = engine_module.checked_token_ids

    def counted(field, ids, vocab):
        passes.append(field)
        return check(field, ids, vocab)

    monkeypatch.setattr(engine_module, "checked_token_ids", counted)
    llm = make_llm(checkpoint, context_length=256)
    llm.generate(prompt_token_ids=[[5, 6, 7], [8, 9]], sampling_params=GREEDY, use_tqdm=False)
    assert passes.count("prompt") == 2
    engine, other = llm.engine, make_llm(checkpoint, context_length=256).engine
    checked = engine.validate_prompt([5, 6, 7], GREEDY)
    assert engine.validate_prompt(checked, GREEDY) is checked
    passes.clear()
    assert other.validate_prompt(checked, GREEDY).ids == [5, 6, 7]
    assert engine.validate_prompt(checked, GREEDY.model_copy()).ids == [5, 6, 7]
    assert passes.count("prompt") == 2
    with pytest.raises(ValueError, match="stop_token_ids"):  # other params can fail where these passed
        engine.validate_prompt(checked, GREEDY.model_copy(update={"stop_token_ids": [10**6]}))
    passes.clear()  # served: each prompt of a request checked before any is queued, and only then
    served = AsyncEngine(engine)
    served.start()
    try:
        body = {"prompt": [[5, 6, 7], [8, 9]], "max_tokens": 2, "temperature": 0}
        reply = TestClient(build_app(served, "m")).post("/v1/completions", json=body).json()
        assert len(reply["choices"]) == 2
    finally:
        served.shutdown()
    assert passes.count("prompt") == 2


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(bogus=1), "bogus"),
        (dict(top_p=0), "top_p"),
        (dict(temperature=-1), "temperature"),
    ],
)
def test_bad_sampling_fields_name_the_field(params, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**params)


def test_abort_frees_pages_and_slot(checkpoint, prompts):
    llm = make_llm(checkpoint)
    engine = llm.engine
    start = (engine.caches.num_available_pages, engine.caches.slots.num_free)
    for i, prompt in enumerate(prompts[:4]):
        engine.add_request(f"r{i}", prompt, GREEDY)
    for _ in range(3):
        engine.step()
    assert engine.caches.pages.num_free < start[0]
    aborted = engine.abort("r2")
    assert aborted.finish_reason == "abort" and aborted.slot is None
    while engine.has_unfinished():
        engine.step()
    assert (engine.caches.num_available_pages, engine.caches.slots.num_free) == start
    waiting = engine.add_request("w", prompts[0], GREEDY)[0]
    assert engine.abort("w") is waiting and not engine.has_unfinished()


def test_request_that_can_never_fit_is_rejected_at_admission(checkpoint):
    config = ModelConfig.from_dir(checkpoint)
    budget = 2 * (
        StateCache.bytes_per_slot(config, torch.float32) + 4 * 256
    ) + 100 * TokenCache.bytes_per_token(config, torch.float32)
    llm = make_llm(checkpoint, max_memory_gb=budget / 2**30, max_running_requests=2, context_length=256)
    assert llm.engine.plan.max_total_num_tokens < 100
    too_big = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
    with pytest.raises(ValueError, match="can never fit"):
        llm.generate(prompt_token_ids=[[5] * 50], sampling_params=too_big, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_fp8_indexer_cache(checkpoint, prompts, reference):
    llm = make_llm(checkpoint, indexer_dtype="fp8")
    tokens = llm.engine.caches.tokens
    assert tokens.pooled_key.dtype == torch.float8_e4m3fn and tokens.pooled_key_scale is not None
    config = ModelConfig.from_dir(checkpoint)
    fp8_bytes = TokenCache.bytes_per_token(config, torch.float32, torch.float8_e4m3fn)
    assert llm.engine.plan.bytes_per_token == fp8_bytes < TokenCache.bytes_per_token(config, torch.float32)
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert all(len(o.token_ids) == GREEDY.max_tokens for o in outs)
    # FP8 pool scores may reorder near-equal pools (and this tiny random model amplifies any change),
    # so compare the first token, chosen right after the prefill
    same = sum(o.token_ids[0] == ref[0] for o, ref in zip(outs, reference, strict=True))
    assert same >= len(prompts) * 2 // 3, same


def test_prompt_logprobs_equal_a_whole_prompt_forward(checkpoint, prompts):
    """Prompt logprobs of prompts prefilled in chunks of 7, batched with other requests' decode steps,
    against one forward over each whole prompt: every position's own token and its top 3; with
    `max_tokens` 0 the prompt is scored and nothing generated."""
    from conftest import Caches
    from tolerance import assert_fp32_close, model_accumulation_terms

    from hylo.forward_batch import ForwardBatch
    from hylo.models.loader import load_model

    llm = make_llm(checkpoint, chunked_prefill_size=7)
    scored = prompts[:6]
    params = [
        SamplingParams(temperature=0, max_tokens=0 if i % 2 else 5, ignore_eos=True, prompt_logprobs=3)
        for i in range(len(scored))
    ]
    outs = llm.generate(prompt_token_ids=scored, sampling_params=params, use_tqdm=False)
    model = load_model(checkpoint, dtype=torch.float32, progress=False)
    terms = model_accumulation_terms(model.config)
    for i, (prompt, out) in enumerate(zip(scored, outs, strict=True)):
        assert len(out.token_ids) == (0 if i % 2 else 5)
        assert out.finish_reason == "length" and out.prompt_logprobs[0] is None
        assert len(out.prompt_logprobs) == len(prompt)
        if len(prompt) == 1:
            continue
        caches = Caches(model, num_seqs=1, per_seq=128)
        m = caches.manager
        batch = ForwardBatch.build([caches.chunk(0, prompt, 0)], m.table.table, m.tokens, m.states, m.kpool,
                                   all_logits=True)  # fmt: skip
        expected = torch.log_softmax(model(batch).logits.float(), dim=-1)[:-1]
        own = torch.tensor([entry[t] for entry, t in zip(out.prompt_logprobs[1:], prompt[1:], strict=True)])
        assert_fp32_close(own, expected.gather(1, torch.tensor(prompt[1:])[:, None])[:, 0], terms)
        for q, entry in enumerate(out.prompt_logprobs[1:]):
            top = expected[q].topk(3)
            assert len(entry) in (3, 4) and prompt[q + 1] in entry
            got = sorted((v for t, v in entry.items() if t != prompt[q + 1] or t in top.indices.tolist()),
                         reverse=True)[:3]  # fmt: skip
            assert_fp32_close(torch.tensor(got), top.values, terms, msg=f"prompt {i} position {q + 1}")
    assert all(o.prompt_logprobs is None for o in llm.generate(prompt_token_ids=scored[:1], use_tqdm=False))
    with pytest.raises(ValueError, match="max_tokens 0 generates nothing"):
        SamplingParams(max_tokens=0)


def test_prompt_scoring_chunks_are_capped(checkpoint, prompts, monkeypatch):
    """A chunk that scores its prompt returns logits for every token, so the scheduler caps it
    (`MAX_SCORED_CHUNK_TOKENS`); other prompts keep the whole prefill budget, and the tokens and
    prompt logprobs do not depend on the cap."""
    import hylo.engine.scheduler as scheduler

    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, prompt_logprobs=1)
    pair = [prompts[2], prompts[8]]  # 70 and 64 tokens
    uncapped = make_llm(checkpoint, chunked_prefill_size=96).generate(
        prompt_token_ids=pair, sampling_params=[params, GREEDY], use_tqdm=False
    )
    monkeypatch.setattr(scheduler, "MAX_SCORED_CHUNK_TOKENS", 8)
    llm = make_llm(checkpoint, chunked_prefill_size=96)
    sizes: dict[str, list[int]] = {}
    launch = llm.engine.runner.launch

    def recording(chunks, *rest):
        for ch in chunks:
            if not ch.request.output_ids:
                sizes.setdefault(ch.request.request_id, []).append(ch.num_tokens)
        return launch(chunks, *rest)

    llm.engine.runner.launch = recording
    capped = llm.generate(prompt_token_ids=pair, sampling_params=[params, GREEDY], use_tqdm=False)
    scored, plain = (sizes[o.request_id] for o in capped)
    assert max(scored) == 8 and sum(scored) == len(pair[0]) and plain == [len(pair[1])]
    assert [o.token_ids for o in capped] == [o.token_ids for o in uncapped]
    from tolerance import assert_fp32_close, model_accumulation_terms

    terms = model_accumulation_terms(llm.engine.model.config)
    # each prompt token's own logprob (the top-1 beside it could swap on a near tie across orders)
    own = [(e[t], u[t]) for e, u, t in zip(capped[0].prompt_logprobs[1:], uncapped[0].prompt_logprobs[1:],
                                           pair[0][1:], strict=True)]  # fmt: skip
    assert_fp32_close(torch.tensor([g for g, _ in own]), torch.tensor([u for _, u in own]), terms)


def test_steps_while_no_request_decodes_take_the_idle_budget(checkpoint, prompts, reference):
    """With `idle_prefill_size`, a prompt prefilled while no request decodes goes in steps of up to that
    many tokens, and one that arrives while another decodes in `chunked_prefill_size` chunks, so that
    the decoding request never waits on a longer step; the tokens are the default engine's."""
    llm = make_llm(checkpoint, chunked_prefill_size=16, idle_prefill_size=64)
    engine = llm.engine
    sizes: dict[str, list[int]] = {}
    launch = engine.runner.launch

    def recording(chunks, *rest):
        for ch in chunks:
            if not ch.request.output_ids:
                sizes.setdefault(ch.request.request_id, []).append(ch.num_tokens)
        return launch(chunks, *rest)

    engine.runner.launch = recording
    (alone,) = engine.add_request("alone", prompts[2], GREEDY)  # 70 tokens, nothing else running
    while not alone.output_ids:
        engine.step()
    (beside,) = engine.add_request("beside", prompts[13], GREEDY)  # 40 tokens while "alone" decodes
    while engine.has_unfinished():
        engine.step()
    assert sizes == {"alone": [64, 6], "beside": [16, 16, 8]}
    assert [alone.output_ids, beside.output_ids] == [reference[2], reference[13]]


def test_an_engine_without_an_idle_budget_prefills_twice_the_chunk_while_nothing_decodes(checkpoint):
    engine = make_llm(checkpoint, chunked_prefill_size=16).engine
    assert (engine.scheduler.prefill_budget, engine.scheduler.idle_prefill_budget) == (16, 32)


def test_the_idle_budget_sets_the_longest_step_and_is_never_below_the_chunk_size():
    from hylo.config import EngineConfig

    assert EngineConfig(chunked_prefill_size=64).longest_prefill_step == 128  # by default twice the chunk
    assert EngineConfig(chunked_prefill_size=64, idle_prefill_size=256).longest_prefill_step == 256
    with pytest.raises(
        ValueError, match=r"idle_prefill_size \(32\) must be at least chunked_prefill_size \(64\)"
    ):
        EngineConfig(chunked_prefill_size=64, idle_prefill_size=32)


def test_model_of_linear_layers_only_decodes_as_hf(tmp_path):
    """A model with no attention layer keeps nothing per token: the memory plan sizes its (free) pages
    from the slots instead of dividing the budget by zero bytes a token, and decoding is HF's."""
    import transformers

    transformers.logging.set_verbosity_error()
    mix = dict(
        layer_types=["linear_attention"] * 2, indexer_types=["full"] * 2, mlp_layer_types=["dense", "sparse"]
    )
    config = tiny_text_config(4, 8, hc_sinkhorn_iters=3) | mix | {"num_hidden_layers": 2}
    checkpoint = write_hf_checkpoint(tmp_path, config, seed=5)
    llm = make_llm(checkpoint)
    assert llm.engine.caches.plan.bytes_per_token == 0 and llm.engine.caches.plan.max_len > 0
    prompts = [random_prompt(n, 160, seed=50 + n) for n in (9, 30)]
    outs = llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    hf = hf_model(checkpoint)
    for prompt, out in zip(prompts, outs, strict=True):
        ours = out.token_ids
        with torch.no_grad():
            logits = hf(torch.tensor([prompt + ours[:-1]]), use_cache=False).logits[0, len(prompt) - 1 :]
        assert logits.argmax(-1).tolist() == ours
