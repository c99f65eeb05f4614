"""MTP prefill chunks through the prefill graphs' padded batches on the CPU (plain calls of the
fixed-shape path the GPU replays): the MTP proposer observes a padded chunk inside the graph and writes
the MTP entries an eager observe writes (prompts of one token, a few, several chunks, a chunk resumed
after a cached prefix), and engines with the graphs give the eager engine's tokens and drafts, every
prefill chunk of more than one token taken by the graphs."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from mtp_checkpoint import write_mtp_target
from test_mtp import VOCAB
from test_prefix_cache import assert_all_returned, run
from tolerance import assert_fp32_close, model_accumulation_terms

from hylo import LLM, SamplingParams
from hylo.engine.cuda_graph import DRAFT
from hylo.engine.prefill_graph import PrefillGraphs, prefill_graph_refusal
from hylo.engine.route import Path
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.models.loader import load_model
from hylo.speculative.mtp import MTPProposer
from hylo.speculative.proposer import ProposerCaches, StepCommit

PAGE, MAX_LEN, SLOTS, STEPS = 16, 96, 2, 3
ENTRIES = ("latent", "index_key", "index_gate")
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    """A target with an MTP layer (test_mtp's kind) over the 4-layer mix of every layer kind (two KDA
    layers; test_mtp's own has 6) and 3 Sinkhorn iterations of its mHC weights (the model's 20 are
    checked in test_mhc_kernels and test_hf_parity): what a padded observe writes and which chunks the
    graphs take depend on neither."""
    return write_mtp_target(tmp_path_factory.mktemp("mtp"), "each-kind", hc_sinkhorn_iters=3)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32, progress=False)


def mtp_parts(path, target) -> tuple[CacheManager, MTPProposer]:
    """Caches with a scratch slot, every slot backed, and an MTP-3 proposer over them."""
    plan = MemoryPlan(SLOTS * MAX_LEN // PAGE, PAGE, SLOTS, MAX_LEN, 0, 0, True)
    caches = CacheManager(target.config, plan, torch.float32, "cpu")
    for _ in range(SLOTS):
        slot = caches.acquire_slot()
        assert caches.grow(slot, [], MAX_LEN)
    build = MTPProposer.load(path, target, num_steps=STEPS)
    table = caches.table.table
    drafts = torch.zeros(table.shape[0], STEPS, dtype=torch.long)
    pools = [spec.allocate(caches.num_token_slots, "cpu") for spec in build.specs]
    return caches, build.build(ProposerCaches(table, drafts, pools))


def eager_prefill(target, caches: CacheManager, proposer: MTPProposer, chunk: SequenceChunk) -> torch.Tensor:
    """The chunk's forward and the proposer's observe of it, as an eager prefill step runs them; its
    features."""
    c = caches
    batch = ForwardBatch.build([chunk], c.table.table, c.tokens, c.states, c.kpool)
    out = target(batch, proposer.capture_layers)
    counts = torch.tensor([len(chunk.token_ids)], dtype=torch.int32)
    proposer.observe(batch, StepCommit(counts, out.logits.argmax(-1), torch.arange(1), out.features))
    return out.features


# (prompt length, its chunks' lengths, tokens of a cached prefix before them)
CASES = [(1, [1], 0), (5, [5], 0), (70, [32, 32, 6], 0), (33, [13], 20)]


@pytest.mark.parametrize(("length", "chunks", "cached"), CASES, ids=["1", "5", "32+32+6", "20-cached+13"])
def test_padded_observe_writes_the_eager_observes_mtp_entries(target_dir, target, length, chunks, cached):
    """Chunks through the prefill graphs (the proposer observing inside) against eager steps: the MTP
    entries at positions 0 .. n-2 of the request's row (n = its committed tokens), the k-pools they
    complete and `last_hidden` agree, and the graphs wrote no other slot than the row's position n-1 and
    the scratch page. A cached prefix is prefilled eagerly in both, then `last_hidden` is dropped and
    restored by `resume` from the prefix's last features, as a prefix-cache hit does."""
    prompt = random_prompt(length, VOCAB, seed=500 + length)
    (eager_caches, eager), (graph_caches, proposer) = (mtp_parts(target_dir, target) for _ in range(2))
    assert prefill_graph_refusal(target, proposer) is None
    graphs = PrefillGraphs(target, graph_caches, 32, capture=False, proposer=proposer)
    assert graphs.observes
    row = 1
    for caches, mtp in ((eager_caches, eager), (graph_caches, proposer)):
        if cached:
            features = eager_prefill(target, caches, mtp, SequenceChunk(prompt[:cached], 0, row, row, False))
            mtp.last_hidden.zero_()
            mtp.resume(row, features[cached - 1])
    start = cached
    for n in chunks:
        chunk = SequenceChunk(prompt[start : start + n], start, row, row)
        eager_prefill(target, eager_caches, eager, chunk)
        batch, _ = graphs.run([chunk])
        assert batch.input_ids.shape[0] == graphs.bank.bucket_for(n)
        start += n
    assert start == length

    terms = model_accumulation_terms(target.config) + model_accumulation_terms(proposer.layer.config)
    table = eager_caches.table.table
    slots = table[row, : length - 1].long()  # entries 0 .. n-2
    kpool = proposer.layer.config.index_kpool
    pools = table[row, : (length - 1) // kpool * kpool : kpool].long() // kpool  # complete in them
    mine, theirs = proposer.cache, eager.cache
    for name in ENTRIES:
        assert_fp32_close(getattr(mine, name)[:, slots], getattr(theirs, name)[:, slots], terms, name)
    assert_fp32_close(mine.pooled_key[:, pools], theirs.pooled_key[:, pools], terms, "pooled_key")
    assert_fp32_close(
        proposer.last_hidden[row], eager.last_hidden[row], model_accumulation_terms(target.config), "h"
    )
    written = torch.zeros(mine.latent.shape[1], dtype=torch.bool)
    written[table[row, :length].long()] = True
    written[table[eager_caches.scratch_slot, 0].long() + torch.arange(PAGE)] = True
    for name in ENTRIES:
        assert torch.equal(getattr(mine, name)[:, ~written], getattr(theirs, name)[:, ~written]), name


def waves() -> list[list[list[int]]]:
    """A prompt of one token (a decode graph takes it), one of a few, one of three chunks; then one
    that hits the three-chunk prompt's snapshot at 64 and prefills 10 tokens from there."""
    shared = random_prompt(80, VOCAB, seed=90)
    first = [random_prompt(1, VOCAB, seed=91), random_prompt(5, VOCAB, seed=92), shared]
    return [first, [shared[:64] + random_prompt(10, VOCAB, seed=93)]]


def make_llm(path, prefill_graphs: bool, adaptive: bool) -> LLM:
    """MTP-3, one request at a time (each prefill chunk alone in its step), chunks of at most 32
    tokens, prefix-cache snapshots every 32; the fixed-shape steps on, prefill graphs when asked."""
    return LLM(
        str(path), device="cpu", dtype="float32", page_size=PAGE, prefix_snapshot_interval=32,
        context_length=256, max_memory_gb=0.25, max_running_requests=1, cuda_graph_max_bs=1,
        chunked_prefill_size=32, idle_prefill_size=32,
        cuda_graph_max_prefill_tokens=32 if prefill_graphs else 0,
        speculative_algorithm="MTP", speculative_num_steps=STEPS, speculative_adaptive=adaptive,
        decode_graphs=True,
    )  # fmt: skip


def recording_first_entries(llm: LLM) -> dict[tuple[int, ...], dict[str, torch.Tensor]]:
    """Record, by prompt, each request's MTP entries 0 .. n-2 (and the pooled keys they complete) once
    its prefill is done (n = its prompt's length, at least 2): after the step that read its first
    token, the entries its prompt's observes wrote, which no later step rewrites."""
    engine, recorded = llm.engine, {}
    proposer, step = engine.proposer, engine.step
    table, kpool = engine.caches.table.table, proposer.layer.config.index_kpool

    def recording():
        outputs = step()
        for out in outputs:
            r, n = out.request, len(out.request.prompt_ids)
            prompt = tuple(r.prompt_ids)
            if len(r.output_ids) == 1 and n >= 2 and prompt not in recorded and r.slot is not None:
                slots = table[r.slot, : n - 1].long()
                pools = table[r.slot, : (n - 1) // kpool * kpool : kpool].long() // kpool
                entries = {name: getattr(proposer.cache, name)[:, slots].clone() for name in ENTRIES}
                recorded[prompt] = entries | {"pooled_key": proposer.cache.pooled_key[:, pools].clone()}
        return outputs

    engine.step = recording
    return recorded


@pytest.mark.parametrize("adaptive", [False, True], ids=["verify-always", "adaptive"])
def test_mtp_engines_with_prefill_graphs_give_the_eager_outputs(target_dir, adaptive):
    """The prefill graphs take every MTP prefill chunk of more than one token (the prefix-cache hit's
    included, resumed at 64), the tokens are the eager engine's, and with every step verifying the
    drafts and the MTP entries each request has when it first drafts are the eager engine's too (the
    adaptive policy times its steps: its choices, and so its drafts, vary from run to run)."""
    eager = make_llm(target_dir, False, adaptive)
    llm = make_llm(target_dir, True, adaptive)
    engine = llm.engine
    assert eager.engine.runner.prefill_graphs is None
    assert prefill_graph_refusal(engine.model, engine.proposer) is None
    graphs = engine.runner.prefill_graphs
    assert graphs is not None and graphs.observes and graphs.buckets == [16, 32]
    runs, replay = [], graphs.run

    def running(seqs):
        runs.append(len(seqs[0].token_ids))
        return replay(seqs)

    graphs.run = running
    want_entries, got_entries = recording_first_entries(eager), recording_first_entries(llm)
    ref, ref_drafts = run(eager, waves(), GREEDY)
    outs, drafts = run(llm, waves(), GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == [o.outputs[0].token_ids for o in ref]
    assert runs == [5, 32, 32, 16, 10], runs
    assert engine.caches.prefix.stats.hit_tokens == 64
    if not adaptive:
        # a prompt the graphs prefilled gets its first drafts from the step after it (its first
        # token's decode step: the replay drafts nothing, `Request.undrafted`), the eager engine's
        # from its first verify block, whose one MTP forward also writes placeholder entries past
        # the anchor (rewritten before they are read, `observe_and_propose`): those first drafts
        # differ; from the next verify step on both engines draft alike
        common = {k for k in drafts.keys() & ref_drafts.keys() if len(k[1]) > 2}
        assert len(common) >= 9 and {k: drafts[k] for k in common} == {k: ref_drafts[k] for k in common}
        assert got_entries.keys() == want_entries.keys() and len(got_entries) == 3
        terms = model_accumulation_terms(engine.model.config)
        terms += model_accumulation_terms(engine.proposer.layer.config)
        for prompt, entries in got_entries.items():
            for name, got in entries.items():
                assert_fp32_close(got, want_entries[prompt][name], terms, f"{len(prompt)} tokens: {name}")
    assert_all_returned(engine)


def test_a_prompt_prefilled_in_the_graphs_decodes_its_anchor_and_drafts_then_verifies_full_blocks(
    target_dir,
):
    """A prefill-graph replay drafts nothing (`Request.undrafted`): the request's next step decodes its
    anchor alone, read at once and drafting (not launched ahead with a deferred observe, which would
    leave its first verify block with another request's drafts), and its next verifies a full block."""
    llm = make_llm(target_dir, True, False)
    engine, launched = llm.engine, []
    launch = engine.runner.launch

    def recording(chunks, route):
        launched.append((route, [(ch.request.request_id, ch.num_tokens, ch.verify) for ch in chunks]))
        return launch(chunks, route)

    engine.runner.launch = recording
    llm.generate(prompt_token_ids=waves()[0][1:], sampling_params=GREEDY, use_tqdm=False)
    by_request: dict[str, list] = {}
    for route, chunks in launched:
        for rid, n, verify in chunks:
            by_request.setdefault(rid, []).append((route, n, verify))
    checked = 0
    for steps in by_request.values():
        for k, (route, _, _) in enumerate(steps[:-2]):
            if route.path is not Path.PREFILL_GRAPH or steps[k + 1][0].path is Path.PREFILL_GRAPH:
                continue  # (a prompt's middle chunk)
            (after, n, verify), (then, m, verifies) = steps[k + 1], steps[k + 2]
            assert (n, verify) == (1, False) and not after.ahead
            assert after.draft or after.variant == DRAFT
            assert verifies and m == 1 + STEPS and then.path is Path.VERIFY_GRAPH
            checked += 1
    assert checked == 2  # the 5-token prompt and the 80-token one (three chunks)
