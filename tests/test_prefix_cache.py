"""The prefix cache: the page tree and its snapshots, and the engine with it on against it off."""

from __future__ import annotations

import argparse

import pytest
import torch
from conftest import random_prompt
from hf_reference import tiny_text_config, write_hf_checkpoint
from test_mtp import LAYER, MTP_LAYER_KIND, TARGET_LAYERS, mtp_extras, target_dir
from test_spec import draft  # noqa: F401 (a fixture: the DFlash draft)

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig, ModelConfig
from hylo.layers.kda import KDAAttention
from hylo.memory.kv import TokenCache
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.memory.state import StateCache

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
PAGE, INTERVAL = 16, 32


# 3 Sinkhorn iterations of the targets' mHC weights (the model's 20 are checked in test_mhc_kernels and
# test_hf_parity): that loop was ~20% of each CPU step, and what a hit resumes from does not depend on it
SINKHORN_ITERS = 3


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    config = tiny_text_config(4, 8, hc_sinkhorn_iters=SINKHORN_ITERS)
    return write_hf_checkpoint(tmp_path_factory.mktemp("prefix"), config, seed=23)


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """test_mtp's target with an MTP layer (`test_mtp.checkpoints`), at `SINKHORN_ITERS`."""
    root = tmp_path_factory.mktemp("mtp")
    config = tiny_text_config(4, 8, num_hidden_layers=TARGET_LAYERS + 1, hc_sinkhorn_iters=SINKHORN_ITERS)
    for key, kind in MTP_LAYER_KIND.items():
        config[key] = [*config[key], kind]
    hf = write_hf_checkpoint(root / "hf", config, seed=31)
    return target_dir(hf, root / "target", {LAYER + k: v for k, v in mtp_extras(seed=7).items()})


def waves() -> list[list[list[int]]]:
    """Two waves of prompts over a shared 70-token prefix: the second shares all of it (a longer
    tail, one prompt sent again, one that extends an earlier prompt) or part of it with the first."""
    shared = random_prompt(70, 160, seed=1)
    a = shared + random_prompt(10, 160, seed=2)
    first = [a, random_prompt(45, 160, seed=3)]
    second = [
        shared + random_prompt(25, 160, seed=4),
        a,
        shared[:40] + random_prompt(9, 160, seed=5),
        a + random_prompt(30, 160, seed=6),
    ]
    return [first, second]


def make_llm(path, cache: bool, **kwargs) -> LLM:
    kwargs.setdefault("speculative_adaptive", False)
    kwargs.setdefault("max_memory_gb", 0.25)
    kwargs.setdefault("prefix_snapshot_interval", INTERVAL)
    kwargs.setdefault("page_size", PAGE)
    return LLM(str(path), device="cpu", dtype="float32", disable_radix_cache=not cache, **kwargs)


def run(llm: LLM, prompt_waves, params) -> tuple[list, dict]:
    """Outputs of the waves, one `generate` each, and every draft made after a sampled token, by
    (prompt, tokens so far): drafts follow from the tokens alone when the proposer's caches are right."""
    engine, drafts = llm.engine, {}
    step = engine.step

    def recording_step():
        outputs = step()
        proposer = engine.proposer
        for out in outputs:
            r = out.request
            # (none after a prefill-graph replay: `Request.undrafted`)
            if proposer is not None and out.new_token_ids and not out.finished and not r.undrafted:
                drafts[(tuple(r.prompt_ids), tuple(r.output_ids))] = proposer.drafts[r.slot].tolist()
        return outputs

    engine.step = recording_step
    outs = [o for wave in prompt_waves for o in llm.generate(
        prompt_token_ids=wave, sampling_params=params, use_tqdm=False
    )]  # fmt: skip
    return outs, drafts


def assert_same(ref_outs, outs) -> None:
    assert [s.token_ids for o in outs for s in o.outputs] == [
        s.token_ids for o in ref_outs for s in o.outputs
    ]
    for o, ref in zip(outs, ref_outs, strict=True):
        for s, rs in zip(o.outputs, ref.outputs, strict=True):
            got = torch.tensor([list(lp.values()) for lp in s.logprobs])
            want = torch.tensor([list(lp.values()) for lp in rs.logprobs])
            # fp32 logprobs of one model over differently split prefills: last-bit differences
            torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


def assert_all_returned(engine) -> None:
    """Nothing running: every page is free or the cache's alone; after clearing it, every page and
    snapshot is free and no page has a reference left."""
    caches = engine.caches
    assert not engine.has_unfinished()
    assert caches.num_available_pages == caches.pages.size
    caches.prefix.clear()
    assert caches.pages.num_free == caches.pages.size and not any(caches.pages.refs)
    assert caches.snapshot_ids.num_free == caches.snapshot_ids.size > 0


@pytest.mark.parametrize(
    "settings",
    [dict(), dict(n=2), dict(chunked_prefill_size=24), dict(max_running_requests=2)],
    ids=["plain", "n=2", "chunks-of-24", "two-running"],
)
def test_outputs_and_logprobs_equal_with_the_cache_on_and_off(target, settings):
    settings = dict(settings)
    params = GREEDY if "n" not in settings else SamplingParams(**{**vars(GREEDY), "n": settings.pop("n")})
    ref, _ = run(make_llm(target, False, **settings), waves(), params)
    llm = make_llm(target, True, **settings)
    outs, _ = run(llm, waves(), params)
    assert_same(ref, outs)
    stats = llm.engine.caches.prefix.stats
    # the second wave resumes at 64 (three prompts) and 32 tokens, at least
    assert stats.hit_tokens >= 3 * 64 * params.n + 32
    assert_all_returned(llm.engine)


def test_snapshots_on_kda_chunk_boundaries_are_taken_in_one_call(target, monkeypatch):
    """With pages of 64 tokens every snapshot falls on a KDA chunk boundary: each layer advances a prefill
    batch in one call that takes them (never segment by segment), and the hits that resume from
    them give the uncached outputs."""
    shared = random_prompt(200, 160, seed=7)
    prompt_waves = [[shared + random_prompt(9, 160, seed=8), random_prompt(150, 160, seed=9)]]
    prompt_waves.append(
        [shared + random_prompt(30, 160, seed=10), shared[:140] + random_prompt(5, 160, seed=11)]
    )
    ref, _ = run(make_llm(target, False), prompt_waves, GREEDY)

    def no_segments(*args):
        raise AssertionError("a batch with snapshots on chunk boundaries advanced in segments")

    monkeypatch.setattr(KDAAttention, "_advance_in_segments", no_segments)
    llm = make_llm(target, True, prefix_snapshot_interval=64, page_size=64)
    outs, _ = run(llm, prompt_waves, GREEDY)
    assert_same(ref, outs)
    assert llm.engine.caches.prefix.stats.hit_tokens >= 192 + 128
    assert_all_returned(llm.engine)


@pytest.mark.parametrize("algorithm", ["DFLASH", "MTP"])
def test_speculative_decoding_resumes_with_the_proposers_caches(target, draft, mtp_target, algorithm):  # noqa: F811
    """A hit shares the proposer's caches with the target's: the drafts after every token equal those
    of a run without the cache (MTP: the entry before the resumed position is the request's own)."""
    if algorithm == "DFLASH":
        path, kwargs = target, dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    else:
        path, kwargs = mtp_target, dict(speculative_algorithm="MTP", speculative_num_steps=2)
    # prefills of 24 tokens a step: chunks that leave snapshots run beside verify blocks
    kwargs["chunked_prefill_size"] = 24
    ref, ref_drafts = run(make_llm(path, False, **kwargs), waves(), GREEDY)
    llm = make_llm(path, True, **kwargs)
    outs, drafts = run(llm, waves(), GREEDY)
    assert_same(ref, outs)
    common = drafts.keys() & ref_drafts.keys()
    assert len(common) > 40
    assert {k: drafts[k] for k in common} == {k: ref_drafts[k] for k in common}
    assert llm.engine.caches.prefix.stats.hit_tokens >= 3 * 64
    assert_all_returned(llm.engine)


def test_preemption_and_eviction_under_a_tiny_budget(target):
    """Pages for about two requests: requests are preempted and resume from their own snapshots,
    cached pages are evicted for running ones, and every output is still the uncached one."""
    prompts = [p for wave in waves() for p in wave] * 2
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    ref, _ = run(make_llm(target, False), [prompts], params)
    config = ModelConfig.from_dir(target)
    token_bytes = TokenCache.bytes_per_token(config, torch.float32)
    slot_bytes = StateCache.bytes_per_slot(config, torch.float32)
    # 4 request slots and ~300 tokens of pages in the 7/8 the snapshots leave (~2 snapshots)
    budget = (4 * (slot_bytes + 4 * 256) + 300 * token_bytes) * 8 / 7
    llm = make_llm(target, True, max_memory_gb=budget / 2**30, max_running_requests=4, context_length=256)
    assert llm.engine.plan.max_total_num_tokens < 2 * 150 and llm.engine.plan.num_snapshots >= 2
    outs, _ = run(llm, [prompts], params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    engine = llm.engine
    stats = engine.caches.prefix.stats
    assert engine.scheduler.num_preemptions > 0 and stats.evicted_pages > 0 and stats.evicted_snapshots > 0
    assert stats.hit_tokens > 0
    assert_all_returned(engine)


def test_abort_mid_prefill_and_an_entry_evicted_while_waiting(target):
    """An aborted prefill leaves only what it computed in the cache; a request whose prefix entry is
    evicted while it waits computes from the start and still completes correctly."""
    _, second = waves()
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    ref, _ = run(make_llm(target, False), [[second[3]], [second[0]]], params)
    llm = make_llm(target, True, chunked_prefill_size=40, idle_prefill_size=40, max_running_requests=1)
    engine, prefix = llm.engine, llm.engine.caches.prefix
    engine.add_request("aborted", second[3], params)
    engine.step()  # 40 of its 110 tokens: a snapshot at 32
    assert prefix.num_snapshots == 1
    engine.abort("aborted")
    (a,) = engine.add_request("a", second[3], params)
    (b,) = engine.add_request("b", second[0], params)  # waits: one request runs at a time
    engine.step()  # "a" resumes at 32
    assert prefix.stats.hit_tokens == 32
    while "a" in engine.requests:
        engine.step()
    assert prefix.match(second[0]).length == 64  # what "b" would resume from ...
    prefix.evict_pages(10**6)  # ... leaves the cache while "b" waits
    assert prefix.num_nodes == 0
    while engine.has_unfinished():
        engine.step()
    assert prefix.stats.hit_tokens == 32  # "b" found nothing
    assert [a.output_ids, b.output_ids] == [r.token_ids for r in ref]
    assert_all_returned(engine)


def tree(num_pages: int = 8, snapshots: int = 3) -> CacheManager:
    config = ModelConfig.from_dict(tiny_text_config(4, 8))
    plan = MemoryPlan(num_pages, 4, 2, 32, 1.0, 1, num_snapshots=snapshots, bytes_per_snapshot=1)
    return CacheManager(config, plan, torch.float32, "cpu", prefix_snapshot_interval=8)


def test_tree_matches_the_deepest_snapshot_short_of_the_last_token():
    caches = tree()
    prefix = caches.prefix
    pages = caches.alloc_pages(3)
    tokens = list(range(12))
    s1, s2 = prefix.alloc_snapshot(), prefix.alloc_snapshot()
    prefix.insert(tokens, pages, 4, s1)
    prefix.insert(tokens, pages, 12, s2)
    assert prefix.num_nodes == 3 and [caches.pages.refs[p] for p in pages] == [2, 2, 2]
    assert prefix.match([*tokens, 99]).length == 12 and prefix.match([*tokens, 99]).snapshot == s2
    hit = prefix.match(tokens)  # the last token must be computed: the snapshot at 4
    assert (hit.length, hit.pages, hit.snapshot) == (4, pages[:1], s1)
    assert prefix.match([0, 1, 2, 5, 9]) is None
    # the same prefix from another request keeps the tree's pages and frees the second snapshot
    other = caches.alloc_pages(1)
    s3 = prefix.alloc_snapshot()
    prefix.insert(tokens[:4], other, 4, s3)
    assert prefix.num_nodes == 3 and caches.snapshot_ids.num_free == 1 and caches.pages.refs[other[0]] == 1
    assert prefix.snapshot_positions(tokens + [99] * 8, 0, 20, 20) == [8, 16]  # 4, 12 exist; 16: the last


def test_tree_takes_a_chunks_snapshots_in_one_walk():
    """`insert_snapshots` leaves the tree one `insert` per snapshot leaves: the nodes and their pages'
    references, each snapshot at its depth, and a snapshot whose depth the tree already holds freed."""
    tokens = list(range(16))

    def published(one_walk: bool):
        caches = tree(num_pages=8, snapshots=4)
        prefix = caches.prefix
        prefix.insert(tokens[:4], caches.alloc_pages(1), 4, prefix.alloc_snapshot())  # another request's
        pages = caches.alloc_pages(4)
        taken = [(4, prefix.alloc_snapshot()), (8, prefix.alloc_snapshot()), (16, prefix.alloc_snapshot())]
        if one_walk:
            prefix.insert_snapshots(tokens, pages, taken)
        else:
            for position, sid in taken:
                prefix.insert(tokens, pages, position, sid)
        with pytest.raises(ValueError, match="position 6 is not a page boundary"):
            prefix.insert_snapshots(tokens, pages, [(6, 0)])
        nodes = sorted((n.depth, n.page, n.snapshot) for n in prefix.nodes())
        return nodes, list(caches.pages.refs), caches.snapshot_ids.num_free

    nodes, refs, free = published(one_walk=True)
    assert (nodes, refs, free) == published(one_walk=False)
    assert [snapshot is not None for _, _, snapshot in nodes] == [True, True, False, True]
    assert free == 1  # the snapshot at 4 was the other request's already


def test_tree_evicts_least_recently_used_leaves_and_prunes_unresumable_pages():
    caches = tree(num_pages=6, snapshots=2)
    prefix = caches.prefix
    a, b = list(range(8)), [0, 1, 2, 3, 7, 7, 7, 7]
    pa, pb = caches.alloc_pages(2), caches.alloc_pages(2)
    prefix.insert(a, pa, 4, prefix.alloc_snapshot())
    prefix.insert(a, pa, 8, prefix.alloc_snapshot())
    prefix.insert(b, [pa[0], pb[1]], 8, prefix.alloc_snapshot())  # evicts the oldest snapshot (at 4)
    assert prefix.stats.evicted_snapshots == 1 and prefix.num_nodes == 3
    assert prefix.num_evictable_pages() == 0  # the requests still hold every cached page
    caches.unshare([pb[1]])  # b's request finishes: its leaf is evictable, the shared root is not
    assert prefix.num_evictable_pages() == 1
    caches.unshare([*pa, pb[0]])  # the others finish: the tree alone holds its pages
    assert caches.pages.num_free == 6 - 3 and prefix.num_evictable_pages() == 3
    prefix.match([*b, 0])  # b's branch is used last
    assert prefix.evict_pages(1) == 1 and prefix.match([*a, 0]) is None and prefix.match([*b, 0]).length == 8
    assert prefix.evict_pages(5) == 2 and prefix.num_nodes == 0 and caches.pages.num_free == 6
    assert caches.snapshot_ids.num_free == 2


def test_the_memory_plan_is_the_sum_of_its_pools(target, draft):  # noqa: F811
    """Every pool (token caches, draft K/V, state slots, snapshots) is sized from one budget by its
    spec, and what the engine allocates is what the plan says."""
    llm = make_llm(target, True, speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
    engine = llm.engine
    caches, plan, proposer = engine.caches, engine.plan, engine.proposer

    def nbytes(*tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors if t is not None)

    token_bytes = nbytes(*(getattr(caches.tokens, n) for n in ("latent", "index_key", "index_gate")))
    token_bytes += nbytes(caches.tokens.pooled_key, caches.tokens.pooled_key_scale)
    draft_bytes = nbytes(proposer.k_cache, proposer.v_cache)
    slots = caches.tokens.num_slots
    assert plan.bytes_per_token * slots == pytest.approx(token_bytes + draft_bytes)
    assert draft_bytes > 0 and caches.prefix is not None and plan.num_snapshots > 0
    state_bytes = nbytes(caches.states.conv, caches.states.recurrent)
    snapshot_bytes = nbytes(caches.snapshots.conv, caches.snapshots.recurrent, caches.snapshot_features)
    assert snapshot_bytes == plan.num_snapshots * plan.bytes_per_snapshot
    allocated = token_bytes + draft_bytes + state_bytes + snapshot_bytes + nbytes(caches.table.table)
    # the plan pays a request-table row per slot at max_len; the table rounds max_len up to pages
    assert allocated == pytest.approx(plan.cache_bytes, rel=0.01)
    assert 0.1 < snapshot_bytes / 0.25 / 2**30 <= 0.125  # the snapshots' share of the budget


def test_prefix_cache_flags_and_their_errors():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    config = EngineConfig.from_cli(
        parser.parse_args(["--disable-radix-cache", "--prefix-snapshot-interval", "512"])
    )
    assert (config.disable_radix_cache, config.prefix_snapshot_interval) == (True, 512)
    defaults = EngineConfig.from_cli(parser.parse_args([]))
    assert (defaults.disable_radix_cache, defaults.prefix_snapshot_interval) == (False, 1024)
    with pytest.raises(
        ValueError, match=r"prefix_snapshot_interval \(100\) must be a multiple of page_size \(64\)"
    ):
        EngineConfig(prefix_snapshot_interval=100)
    with pytest.raises(ValueError, match="prefix_snapshot_interval must be >= 1"):
        EngineConfig(prefix_snapshot_interval=0)
    with pytest.raises(ValueError, match="disable_radix_cache must be a bool"):
        EngineConfig(disable_radix_cache="yes")
