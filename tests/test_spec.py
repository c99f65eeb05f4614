"""Speculative decoding: acceptance, rollback/commit of every cache, losslessness, the DFlash draft."""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from conftest import random_prompt, run_every_kth
from dflash_reference import write_dflash_checkpoint
from hf_reference import tiny_text_config, write_hf_checkpoint
from tolerance import assert_fp32_close, draft_accumulation_terms, model_accumulation_terms

from hylo import LLM, SamplingParams
from hylo.engine.request import Request
from hylo.layers.linear import unfused_state_dict
from hylo.models.dflash import DFlashConfig, DFlashDraftModel
from hylo.models.loader import load_flat
from hylo.speculative.proposer import Proposer, write_drafts
from hylo.speculative.verify import VerifyShape

GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
BLOCK = 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # the 4-layer mix of every layer kind (two KDA layers) and 3 Sinkhorn iterations of the mHC weights
    # (the model's 20 are checked in test_mhc_kernels and test_hf_parity): what a verify step commits
    # depends on neither the depth nor that loop, which was ~20% of each CPU step
    config = tiny_text_config(4, 8, "each-kind", hc_sinkhorn_iters=3)
    return write_hf_checkpoint(tmp_path_factory.mktemp("target"), config, seed=21)


def make_llm(path, **kwargs) -> LLM:
    """Every decode step verifies (the adaptive policy off): the tests count verify steps."""
    kwargs.setdefault("speculative_adaptive", False)
    return LLM(str(path), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25, **kwargs)


class Scripted(Proposer):
    """Proposes the target's own greedy continuation, corrupting the drafts for chosen output
    positions, so how many drafts each verify step accepts is known in advance. It drafts on the
    host, after the step's read (`needs_host`), from the tokens the step adds."""

    def __init__(self, truth: dict[tuple[int, ...], list[int]], wrong: set[int], k: int):
        self.truth, self.wrong, self.verify_shape = truth, wrong, VerifyShape(k + 1)
        self.accepted_expected: list[int] = []

    def propose(self, batch, commit):
        rows, drafts = [], []
        for c in commit.host:
            if not c.new_tokens:
                continue
            r = c.request
            n = len(r.output_ids) + len(c.new_tokens)  # the step's tokens are not appended yet
            truth = self.truth[tuple(r.prompt_ids)][n : n + self.verify_shape.drafts]
            d = [(t + 1) % 160 if n + j in self.wrong else t for j, t in enumerate(truth)]
            budget = min(self.verify_shape.drafts, r.params.max_tokens - n - 1)
            if budget > 0:  # the next step verifies this many of them
                self.accepted_expected.append(next((j for j in range(budget) if n + j in self.wrong), budget))
            rows.append(r.slot)
            drafts.append(d)
        write_drafts(self.drafts, rows, drafts)


def cache_view(engine, request_slot: int, length: int) -> dict[str, torch.Tensor]:
    """Every cache entry of a sequence's first `length` positions, independent of slot placement."""
    c = engine.caches
    slots = c.table.table[request_slot, :length].long()
    pools = slots[: length - length % c.kpool : c.kpool] // c.kpool
    return {
        "conv": c.states.conv[:, request_slot].clone(),
        "S": c.states.recurrent[:, request_slot].clone(),
        "latent": c.tokens.latent[:, slots].clone(),
        "keys": c.tokens.index_key[:, slots].clone(),
        "gates": c.tokens.index_gate[:, slots].clone(),
        "pooled": c.tokens.pooled_key[:, pools].clone(),
    }


@pytest.fixture(scope="module")
def plain_decoding(target) -> tuple[list[int], list[int], dict[int, dict[str, torch.Tensor]]]:
    """(prompt, its greedy output, the caches after every position) of plain decoding, read every
    step: what each scripted run below must commit (one run for them all; each compares clones)."""
    prompt = random_prompt(29, 160, seed=4)
    plain = make_llm(target, disable_overlap_schedule=True)
    reference: dict[int, dict[str, torch.Tensor]] = {}
    (request,) = plain.engine.add_request("p", prompt, GREEDY)
    while plain.engine.has_unfinished():
        plain.engine.step()
        if request.slot is not None:
            reference[request.num_computed] = cache_view(plain.engine, request.slot, request.num_computed)
    return prompt, request.output_ids, reference


@pytest.mark.parametrize(
    "wrong",
    [
        set(),
        {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19},
        {1, 5, 6, 11},
        {2},
        {3, 9, 15},
    ],
)
def test_scripted_drafts_commit_exactly_what_plain_decoding_computes(target, plain_decoding, wrong):
    prompt, output_ids, reference = plain_decoding
    proposer = Scripted({tuple(prompt): output_ids}, wrong, BLOCK - 1)
    spec = make_llm(target, proposer=proposer)
    (req,) = spec.engine.add_request("s", prompt, GREEDY)
    terms = model_accumulation_terms(spec.engine.model.config)
    accepted = []
    while spec.engine.has_unfinished():
        spec.engine.step()
        if req.metrics.spec_verify_steps > len(accepted):
            accepted.append(req.metrics.spec_accepted_tokens - sum(accepted))
        if req.slot is not None and req.num_computed > len(prompt):
            got = cache_view(spec.engine, req.slot, req.num_computed)
            for name, value in reference[req.num_computed].items():
                assert_fp32_close(got[name], value, terms, msg=f"{name} at length {req.num_computed}")
    assert req.output_ids == output_ids
    assert accepted == proposer.accepted_expected
    if not wrong:
        assert max(accepted) == BLOCK - 1
    assert req.metrics.mean_acceptance_length == 1 + sum(accepted) / len(accepted)


def test_stop_inside_an_accepted_block_ends_at_the_right_token(target):
    prompt = random_prompt(17, 160, seed=8)
    (ref,) = make_llm(target).generate(prompt_token_ids=[prompt], sampling_params=GREEDY, use_tqdm=False)
    stop = ref.token_ids[6]
    proposer = Scripted({tuple(prompt): ref.token_ids}, set(), BLOCK - 1)
    params = GREEDY.model_copy(update={"stop_token_ids": [stop]})
    (out,) = make_llm(target, proposer=proposer).generate(
        prompt_token_ids=[prompt], sampling_params=params, use_tqdm=False
    )
    assert out.token_ids == ref.token_ids[: ref.token_ids.index(stop) + 1] and out.finish_reason == "stop"
    short = GREEDY.model_copy(update={"max_tokens": 5})
    (cut,) = make_llm(target, proposer=proposer).generate(
        prompt_token_ids=[prompt], sampling_params=short, use_tqdm=False
    )
    assert cut.token_ids == ref.token_ids[:5] and cut.finish_reason == "length"


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    return write_dflash_checkpoint(
        tmp_path_factory.mktemp("draft"), 64, 160, [0, 1, 2], seed=5, block_size=BLOCK
    )


def test_dflash_greedy_is_lossless_on_a_batch_of_16(target, draft):
    prompts = [
        random_prompt(n, 160, seed=300 + n)
        for n in (3, 9, 17, 25, 33, 41, 5, 12, 20, 28, 36, 44, 7, 15, 23, 31)
    ]
    plain = make_llm(target).generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    spec_llm = make_llm(target, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    spec = spec_llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY, use_tqdm=False)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert all(o.metrics.spec_verify_steps > 0 for o in spec)


def naive_dflash(model: DFlashDraftModel, features, block_embeds, start):
    """The format description, written plainly: context = hidden_norm(fc(features)) for positions
    0..start-1; each layer: q from the normed block, k/v from [context; normed block] with k_norm and
    RoPE, non-causal attention (sliding layers: keys within the window), residual, SwiGLU MLP."""
    c = model.config
    t = unfused_state_dict(model)  # the checkpoint's tensors, each projection on its own
    ctx = model.hidden_norm(model.fc(features))
    x = block_embeds
    positions = torch.arange(start + x.shape[0])
    q_pos = positions[start:]
    for i, layer in enumerate(model.layers):
        attn, p = layer.self_attn, f"layers.{i}.self_attn."
        h = layer.input_layernorm(x)
        both = torch.cat([ctx, h])
        k = attn.k_norm((both @ t[p + "k_proj.weight"].T).view(-1, c.num_key_value_heads, c.head_dim))
        v = (both @ t[p + "v_proj.weight"].T).view(-1, c.num_key_value_heads, c.head_dim)
        q = attn.q_norm((h @ t[p + "q_proj.weight"].T).view(-1, c.num_attention_heads, c.head_dim))

        def rotate(t, pos):
            inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
            ang = pos[:, None].float() * inv
            cos, sin = torch.cat([ang.cos()] * 2, -1)[:, None], torch.cat([ang.sin()] * 2, -1)[:, None]
            half = c.head_dim // 2
            return t * cos + torch.cat([-t[..., half:], t[..., :half]], -1) * sin

        q, k = rotate(q, q_pos), rotate(k, positions)
        rep = c.num_attention_heads // c.num_key_value_heads
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        out = []
        for qi, p in enumerate(q_pos):
            keys = [
                j
                for j in range(len(positions))
                if c.layer_types[i] != "sliding_attention" or positions[j] > p - c.sliding_window
            ]
            s = torch.einsum("hd,khd->hk", q[qi], k[keys]) * c.head_dim**-0.5
            out.append(torch.einsum("hk,khd->hd", s.softmax(-1), v[keys]))
        x = x + attn.o_proj(torch.stack(out).flatten(1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return model.norm(x)


def test_dflash_draft_forward_matches_plain_reimplementation(draft):
    c = DFlashConfig.from_dir(draft)
    model = DFlashDraftModel(c)
    load_flat(model, draft)
    gen = torch.Generator().manual_seed(0)
    start = 11
    features = torch.randn(start, 3 * 64, generator=gen)
    block = torch.randn(BLOCK, 64, generator=gen)
    expected = naive_dflash(model, features, block, start)
    ctx_pos = torch.arange(start)
    ctx_kv = [(k[None], v[None]) for k, v in model.context_kv(features, ctx_pos)]
    got = model(
        block[None],
        (start + torch.arange(BLOCK))[None],
        ctx_kv,
        ctx_pos[None],
        torch.ones(1, start, dtype=torch.bool),
    )[0]
    assert_fp32_close(got, expected, draft_accumulation_terms(c))


@contextlib.contextmanager
def dflash_server(target, draft):
    """A TestClient of the server app over a DFlash engine (static draft length) of the tiny target."""
    from fastapi.testclient import TestClient

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.server.api import build_app
    from hylo.server.async_engine import AsyncEngine

    config = EngineConfig(
        model=str(target),
        device="cpu",
        dtype="float32",
        page_size=16,
        max_memory_gb=0.25,
        speculative_adaptive=False,
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(draft),
    )
    engine = AsyncEngine(Engine(config))
    engine.start()
    try:
        yield TestClient(build_app(engine, "tiny"))
    finally:
        engine.shutdown()


def test_server_reports_acceptance_length(target, draft):
    with dflash_server(target, draft) as client:
        body = {"prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        assert client.post("/v1/completions", json=body).json()["usage"]["completion_tokens"] == 12
        tau = client.get("/server_info").json()["avg_spec_accept_length"]
        assert 1 <= tau <= BLOCK
        assert "hylo_spec_acceptance_length_bucket" in client.get("/metrics").text


class ModeChain(Proposer):
    """Drafts, after a request's output so far, the chain of most likely next tokens the test computed
    (`modes`: output prefix -> its most likely next token), on the host: drafts fixed by the committed
    prefix, each accepted with its probability."""

    def __init__(self):
        self.modes: dict[tuple[int, ...], int] = {}
        self.verify_shape = VerifyShape(BLOCK)

    def propose(self, batch, commit):
        rows, drafts = [], []
        for c in commit.host:
            if c.new_tokens:
                chain = [*c.request.output_ids, *c.new_tokens]  # the step's tokens are not appended yet
                while tuple(chain) in self.modes and len(chain) < len(c.request.output_ids) + BLOCK:
                    chain.append(self.modes[tuple(chain)])
                rows.append(c.request.slot)
                drafts.append(chain[len(c.request.output_ids) + len(c.new_tokens) :])
        write_drafts(self.drafts, rows, drafts)


def test_sampling_is_lossless_end_to_end(tmp_path):
    """6000 sampled runs of 3 tokens (temperature 0.7, top-k 12, top-p 0.9; vocab 16; seeds drawn at
    arrival) verifying drafts of the most likely continuation: the tokens follow the target's
    processed distribution computed from its logits (chi-square at ALPHA on each position's marginal
    and on the joint of the first two), and the drafts are kept as often as their probability says
    (z-bound at ALPHA). The distribution of each pick is tested at the op level with far more rows
    (tests/test_sampling.py); here it is the engine's part: each request's own seed, each position's
    own noise, the verify block conditioned on the accepted drafts."""
    from conftest import Caches
    from test_sampling import ALPHA, Z_BOUND, chi_square_p_value, reference_distribution

    vocab, runs, prompt = 16, 6000, [3, 5, 7, 9, 11]
    # the 4-layer mix with every kind (6 layers' forwards of 6000 requests were half of this test's
    # time); seed 4: seeds 2 and 3 put a top-p boundary within rounding of 0.9, which the reference refuses
    config = tiny_text_config(4, 8, "each-kind", vocab_size=vocab, hc_sinkhorn_iters=3)
    target = write_hf_checkpoint(tmp_path / "t", config, seed=4)
    proposer = ModeChain()
    llm = LLM(str(target), device="cpu", dtype="float32", page_size=16, context_length=16,
              max_running_requests=runs, max_memory_gb=1.0, proposer=proposer,
              speculative_adaptive=False, seed=11)  # fmt: skip
    params = SamplingParams(temperature=0.7, top_k=12, top_p=0.9, max_tokens=3, ignore_eos=True)
    model = llm.engine.model
    seqs = (
        [prompt]
        + [[*prompt, a] for a in range(vocab)]
        + [[*prompt, a, b] for a in range(vocab) for b in range(vocab)]
    )
    caches = Caches(model, num_seqs=len(seqs), per_seq=16)
    logits = caches.forward(model, [caches.chunk(i, s, 0) for i, s in enumerate(seqs)], False)
    probs = torch.stack([reference_distribution(row, params, prompt, []) for row in logits])
    p1, p2, p3 = probs[0], probs[1 : 1 + vocab], probs[1 + vocab :].view(vocab, vocab, vocab)
    proposer.modes = {(a,): int(p2[a].argmax()) for a in range(vocab)}
    proposer.modes |= {(a, b): int(p3[a, b].argmax()) for a in range(vocab) for b in range(vocab)}

    outs = llm.generate(prompt_token_ids=[prompt] * runs, sampling_params=params, use_tqdm=False)
    samples = torch.tensor([o.token_ids for o in outs])
    joint12 = p1[:, None] * p2
    joint = joint12[..., None] * p3
    expected = {"t1": p1, "t2": joint12.sum(0), "t3": joint.sum((0, 1)), "t1t2": joint12.flatten()}
    observed = {
        "t1": torch.bincount(samples[:, 0], minlength=vocab),
        "t2": torch.bincount(samples[:, 1], minlength=vocab),
        "t3": torch.bincount(samples[:, 2], minlength=vocab),
        "t1t2": torch.bincount(samples[:, 0] * vocab + samples[:, 1], minlength=vocab * vocab),
    }
    for name, p in expected.items():
        assert chi_square_p_value(observed[name], p * runs) > ALPHA, name
    # after the first token t1 (the prefill's pick) a request has one draft left to verify, the
    # mode after t1: kept with probability p2[t1, mode]
    kept_probability = p2[samples[:, 0], p2.argmax(-1)[samples[:, 0]]]
    kept = sum(o.metrics.spec_accepted_tokens for o in outs)
    mean, variance = float(kept_probability.sum()), float((kept_probability * (1 - kept_probability)).sum())
    assert abs(kept - mean) < Z_BOUND * math.sqrt(variance), (kept, mean)


class Oracle(Proposer):
    """Drafts the target's own greedy tokens from `truth [table rows, positions]` (corrupted where the
    test wants rejections) from device tensors alone, so it drafts inside a verify graph too."""

    needs_host = False

    def __init__(self, truth: torch.Tensor, k: int):
        self.truth, self.verify_shape = truth, VerifyShape(k + 1)

    def propose(self, batch, commit):
        seqs = commit.sampling
        rows = batch.state_slots[seqs]
        after_anchor = batch.positions[batch.pad_index[seqs, 0]] + commit.counts[seqs] + 1
        columns = (after_anchor[:, None] + torch.arange(self.verify_shape.drafts)).clamp(
            max=self.truth.shape[1] - 1
        )
        self.drafts[rows] = self.truth[rows[:, None], columns]


def _truth(engine, prompts, params) -> torch.Tensor:
    """Each request's prompt and output from `engine`, by table row (slots are handed out lowest
    first, in arrival order), positions `[table rows, context]`."""
    done = _run(engine, prompts, params)
    truth = torch.zeros(
        engine.config.max_running_requests + 1, engine.config.context_length, dtype=torch.long
    )
    for slot, request in enumerate(done):
        sequence = [*request.prompt_ids, *request.output_ids]
        truth[slot, : len(sequence)] = torch.tensor(sequence)
    return truth


def _run(engine, prompts, params) -> list[Request]:
    done = [
        engine.add_request(str(i), prompt, p)[0]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    return done


def test_sampled_verify_steps_through_the_graphs_match_eager_steps(target):
    """Sampled, logit-biased, `min_tokens` and logprob rows verify through the fixed-shape batches
    (CPU: plain calls of the static batches, the path CUDA graphs replay), with acceptance run
    between the two graphs: the same tokens and logprobs as eager verify steps, requests with seeds of
    their own and seeds drawn at arrival alike, drafts accepted and rejected."""
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    config = EngineConfig(
        model=str(target), device="cpu", dtype="float32", page_size=16, context_length=96,
        max_memory_gb=0.25, max_running_requests=4, cuda_graph_max_bs=4, speculative_adaptive=False,
        seed=7,
    )  # fmt: skip
    prompts = [random_prompt(n, 160, seed=50 + n) for n in (21, 8, 14, 11)]
    params = [
        SamplingParams(temperature=0.6, top_p=0.9, seed=3, max_tokens=18, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=6, logprobs=2, max_tokens=15, ignore_eos=True),
        SamplingParams(temperature=0, logit_bias={5: 2.0, 9: -3.0}, max_tokens=16),
        SamplingParams(temperature=0.5, min_p=0.05, min_tokens=9, stop_token_ids=[1, 2], max_tokens=17),
    ]
    # drafts from a plain engine's sampled run: right until the speculative run's draws part from it
    truth = _truth(Engine(config), prompts, params)
    replays = []
    with_graphs = Engine(config, proposer=Oracle(truth, BLOCK - 1), decode_graphs=True)
    run = with_graphs.runner.verify_graphs.run
    with_graphs.runner.verify_graphs.run = lambda seqs, *rest: replays.append(len(seqs)) or run(seqs, *rest)
    got = _run(with_graphs, prompts, params)
    expected = _run(Engine(config, proposer=Oracle(truth, BLOCK - 1)), prompts, params)
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    assert sum(replays) >= 3 * len(prompts), replays  # the sampled steps went through the graphs
    accepted = sum(r.metrics.spec_accepted_tokens for r in got)
    assert 0 < accepted < sum(r.metrics.spec_verify_steps for r in got) * (BLOCK - 1)
    for mine, theirs in zip(got[1].logprobs, expected[1].logprobs, strict=True):
        assert mine.keys() == theirs.keys()
        assert torch.allclose(
            torch.tensor(list(mine.values())), torch.tensor(list(theirs.values())), atol=1e-5
        )


@pytest.mark.parametrize(("every", "tokens"), [(5, 20), (45, 40)])
def test_deferred_observes_leave_the_draft_caches_of_observing_every_step(
    target, draft, every, tokens, monkeypatch
):
    """Plain graph steps that draft nothing (a policy verifying every 5th step, or every 45th: past
    the deferred ring's positions) leave their observes for later: the DFlash draft's context K/V
    then equal those of an engine that observes every step (but for the positions a request still
    deferred when it finished, which nothing reads), and the outputs are the same."""
    import hylo.engine.cuda_graph as cuda_graph

    ring = 32
    monkeypatch.setattr(cuda_graph, "MAX_DEFERRED_TOKENS", ring)  # a ring the test fills
    prompts = [random_prompt(n, 160, seed=70 + n) for n in (13, 6, 22)]
    params = GREEDY.model_copy(update={"max_tokens": tokens})
    runs = []
    for defer in (True, False):
        # a 128-token context (every sequence here is at most 22 + 40 tokens and a block): the
        # fixed-shape batches are as wide as the request table, which the model's 1M context (capped
        # by the cache) made every page, each graph step's indexer scoring them all
        llm = make_llm(
            target, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
            speculative_num_draft_tokens=BLOCK, decode_graphs=True, max_running_requests=4,
            cuda_graph_max_bs=4, context_length=128,
        )  # fmt: skip
        outputs, caught_up, never = run_every_kth(llm, prompts, params, every, defer)
        runs.append(([o.token_ids for o in outputs], caught_up, never, llm.engine))
    (deferred, caught_up, never, engine), (observed, none, _, observing) = runs
    assert deferred == observed and not none
    assert max(caught_up) == (every - 2 if every < ring else ring), caught_up
    proposer, reference = engine.proposer, observing.proposer
    assert engine.runner.graphs.deferred_tokens == ring
    rows = torch.arange(proposer.drafts.shape[0]) != engine.caches.scratch_slot  # not filler blocks' drafts
    assert torch.equal(proposer.drafts[rows], reference.drafts[rows])  # made in the graph and eagerly
    seen = torch.ones(proposer.k_cache.shape[1], dtype=torch.bool)
    seen[never] = False
    seen[engine.caches.table.table[engine.caches.scratch_slot].long()] = False  # filler blocks' page
    terms = draft_accumulation_terms(proposer.draft.config)
    assert_fp32_close(proposer.k_cache[:, seen], reference.k_cache[:, seen], terms)
    assert_fp32_close(proposer.v_cache[:, seen], reference.v_cache[:, seen], terms)


@pytest.mark.parametrize("overlap", [False, True], ids=["reading", "overlapped"])
def test_verify_graphs_commit_what_plain_decoding_computes(target, overlap):
    """Greedy speculative steps through the fixed-shape verify batches (CPU: plain calls of the static
    batches, the path CUDA graphs replay) give the plain engine's tokens, with drafts accepted, rejected
    and cut short by the token limit (blocks padded to the graphs' width); every page and slot comes
    back. With the overlap schedule most verify steps are launched before the one ahead of them is
    read, their blocks starting where its commit left them on the device (a whole block each: what
    a request commits past its limit is dropped with it), and the tokens are the same."""
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine

    config = EngineConfig(
        model=str(target), device="cpu", dtype="float32", page_size=16, context_length=96,
        max_memory_gb=0.25, max_running_requests=4, cuda_graph_max_bs=4, speculative_adaptive=False,
        disable_overlap_schedule=not overlap,
    )  # fmt: skip
    prompts = [random_prompt(n, 160, seed=40 + n) for n in (29, 6, 17)]
    params = [GREEDY.model_copy(update={"max_tokens": n}) for n in (20, 13, 9)]
    plain = Engine(config)
    expected = []
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        expected.append(plain.add_request(str(i), prompt, p)[0])
    while plain.has_unfinished():
        plain.step()

    truth = torch.zeros(config.max_running_requests + 1, 96, dtype=torch.long)
    for slot, request in enumerate(expected):  # slots are handed out lowest first, in arrival order
        sequence = [*request.prompt_ids, *request.output_ids]
        for j in (2, 3, 7):  # drafts for these output positions are wrong
            sequence[len(request.prompt_ids) + j] = (sequence[len(request.prompt_ids) + j] + 1) % 160
        truth[slot, : len(sequence)] = torch.tensor(sequence)
    engine = Engine(config, proposer=Oracle(truth, BLOCK - 1), decode_graphs=True)
    graphs = engine.runner.verify_graphs
    # plain decode steps replay decode graphs that run the proposer's observe inside
    assert graphs is not None and graphs.buckets == [1, 2, 4] and engine.runner.graphs.observes
    replays, verify_steps, mixed = [], [], []
    run = graphs.run
    graphs.run = lambda seqs, *rest: replays.append(len(seqs)) or run(seqs, *rest)
    launch, launched, after_commit = engine.runner.launch, [], []

    def launching(chunks, route):
        if route.ahead:  # launched before the step ahead of it is read
            launched.append(len(chunks))
            mixed.append(any(ch.num_tokens == 1 for ch in chunks))
            after_commit.append(all(ch.request.verifying for ch in chunks))
        elif any(ch.verify for ch in chunks):  # read at once
            verify_steps.append(len(chunks))
            mixed.append(any(ch.num_tokens == 1 for ch in chunks))
        return launch(chunks, route)

    engine.runner.launch = launching
    free = (engine.caches.num_available_pages, engine.caches.slots.num_free)
    got = [
        engine.add_request(str(i), prompt, p)[0]
        for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
    ]
    while engine.has_unfinished():
        engine.step()
    assert [r.output_ids for r in got] == [r.output_ids for r in expected]
    # 3 requests verify in the bucket of 4 (a filler block on the scratch slot); a request one token
    # from its limit verifies a block without drafts beside the others (read every step: the blocks
    # launched ahead are whole); every verify step replays
    assert replays.count(3) >= 3 and sorted(replays) == sorted(verify_steps + launched)
    assert any(mixed) or overlap
    assert bool(launched) == overlap and sum(after_commit) >= (3 if overlap else 0)
    assert all(r.verifying == 0 and r.in_flight == 0 for r in got)
    assert all(r.metrics.spec_accepted_tokens > 0 for r in got)
    assert (engine.caches.num_available_pages, engine.caches.slots.num_free) == free
