"""Prefill chunks through the prefill graphs' padded batches on the CPU (plain calls of the fixed-shape
path the GPU replays): the padded metadata describes the real tokens as an eager batch does, padding
reaches only the scratch page, and engines with the graphs give the eager engine's tokens and
logprobs, prefix-cache hits, chunked prompts and DFlash included."""

from __future__ import annotations

import pytest
import torch
from conftest import random_prompt
from hf_reference import tiny_text_config, write_hf_checkpoint
from test_prefix_cache import assert_all_returned, assert_same, run
from test_spec import draft  # noqa: F401 (a fixture: the DFlash draft)

from hylo import LLM
from hylo.config import EngineConfig
from hylo.engine.prefill_graph import PrefillGraphs, prefill_buckets
from hylo.forward_batch import ForwardBatch, SequenceChunk, uniform_metadata
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.models.loader import load_model
from hylo.sampling import SamplingParams
from hylo.speculative.proposer import Proposer
from hylo.speculative.verify import VerifyShape

PAGE, MAX_LEN, SLOTS = 16, 96, 4
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # the 4-layer mix of every layer kind (two KDA layers) and 3 Sinkhorn iterations of the mHC weights
    # (the model's 20 are checked in test_mhc_kernels and test_hf_parity): what a padded chunk writes
    # and where its padding goes depend on neither the depth nor that loop
    config = tiny_text_config(4, 8, "each-kind", hc_sinkhorn_iters=3)
    return write_hf_checkpoint(tmp_path_factory.mktemp("prefill-graphs"), config, seed=29)


@pytest.fixture(scope="module")
def model(target):
    return load_model(target, dtype=torch.float32, progress=False)


def caches_for(model) -> CacheManager:
    plan = MemoryPlan(SLOTS * MAX_LEN // PAGE, PAGE, SLOTS, MAX_LEN, 0, 0, True)
    caches = CacheManager(model.config, plan, torch.float32, "cpu")
    for _ in range(SLOTS):
        slot = caches.acquire_slot()
        assert caches.grow(slot, [], MAX_LEN)
    return caches


def test_prefill_buckets():
    assert prefill_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert prefill_buckets(100) == [16, 32, 64, 100]
    assert prefill_buckets(16) == [16] and prefill_buckets(5) == [5]
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        prefill_buckets(0)


@pytest.mark.parametrize(("prefix", "n", "width"), [(0, 1, 16), (0, 13, 16), (21, 30, 32), (33, 63, 64)])
def test_padded_metadata_describes_the_real_tokens(model, prefix, n, width):
    """The real tokens' positions, slots and pools are the eager batch's; padding takes the last
    position and the scratch row's first slot, and completes no pool."""
    caches = caches_for(model)
    c, row = caches, 2
    eager = ForwardBatch.build(
        [SequenceChunk([0] * n, prefix, row, row)], c.table.table, c.tokens, c.states, c.kpool
    )
    meta = uniform_metadata(
        torch.tensor([prefix]), torch.tensor([row]), width, c.table.table, c.kpool, c.scratch_slot,
        torch.tensor([n]),
    )  # fmt: skip
    assert torch.equal(meta["positions"][:n], eager.positions)
    assert torch.equal(meta["positions"][n:], torch.full((width - n,), prefix + n - 1))
    assert torch.equal(meta["new_slots"][:n], eager.new_slots)
    assert (meta["new_slots"][n:] == c.table.table[c.scratch_slot, 0]).all()
    pools = eager.pool_table.shape[1]
    assert torch.equal(meta["pool_table"][:, :pools], eager.pool_table)
    assert (meta["pool_table"][:, pools:] == -1).all()
    completed = set(eager.completed_pools.tolist())
    filler = int(c.table.table[c.scratch_slot, 0]) // c.kpool
    assert set(meta["completed_pools"].tolist()) - {filler} == completed
    with pytest.raises(ValueError, match="lengths: padding tokens write the filler row"):
        uniform_metadata(
            torch.tensor([prefix]),
            torch.tensor([row]),
            width,
            c.table.table,
            c.kpool,
            None,
            torch.tensor([n]),
        )


def test_prefill_graphs_take_one_plain_chunk(model):
    graphs = PrefillGraphs(model, caches_for(model), 40, capture=False)
    assert graphs.buckets == [16, 32, 40] and not graphs.bank.graphs
    assert graphs.accepts([SequenceChunk([1] * 40, 5, 0, 0)])
    assert graphs.accepts([SequenceChunk([1] * 7, 0, 0, 0, sample=False, snapshots=[(7, 0)])])
    rejected = [
        [SequenceChunk([1] * 41, 0, 0, 0)],  # above the largest bucket
        [SequenceChunk([1] * 3, 0, 0, 0)] * 2,  # two sequences
        [SequenceChunk([1] * 3, 4, 0, 0, verify=True)],
        [SequenceChunk([1] * 3, 0, 0, 0, score=True)],  # prompt logprobs need every position's logits
        [SequenceChunk([1] * 8, 0, 0, 0, snapshots=[(4, 0)])],  # a snapshot inside the chunk
    ]
    for seqs in rejected:
        assert not graphs.accepts(seqs)
        with pytest.raises(ValueError, match="seqs: a prefill graph takes one chunk of 1 to 40 tokens"):
            graphs.run(seqs)

    class HostDrafter(Proposer):
        verify_shape = VerifyShape(3)

        def propose(self, batch, commit):
            pass

    with pytest.raises(
        ValueError, match=r"prefill graphs: the proposer \(HostDrafter\) does not observe padded"
    ):
        PrefillGraphs(model, caches_for(model), 40, capture=False, proposer=HostDrafter())


def test_prefill_graphs_run_one_chunk_as_the_eager_forward(model):
    """A padded chunk after a cached prefix: the last token's logits, the KDA states and the attention
    caches of the real tokens equal the eager forward's; the padding wrote only the scratch page."""
    prompt = random_prompt(45, model.config.vocab_size, seed=3)
    eager_caches, graph_caches = caches_for(model), caches_for(model)
    row = 1

    def forward(caches, chunk):
        c = caches
        return model(ForwardBatch.build([chunk], c.table.table, c.tokens, c.states, c.kpool)).logits

    for caches in (eager_caches, graph_caches):  # the cached prefix, eagerly
        forward(caches, SequenceChunk(prompt[:20], 0, row, row))
    want = forward(eager_caches, SequenceChunk(prompt[20:], 20, row, row))
    graphs = PrefillGraphs(model, graph_caches, 32, capture=False)
    batch, forward = graphs.run([SequenceChunk(prompt[20:], 20, row, row)])
    got = forward.logits
    assert batch.input_ids.shape[0] == 32 and got.shape == want.shape
    torch.testing.assert_close(got, want, rtol=0, atol=1e-4)  # fp32, 32 rows against 25: last bits
    e, g = eager_caches, graph_caches
    torch.testing.assert_close(g.states.recurrent[:, row], e.states.recurrent[:, row], rtol=0, atol=1e-5)
    torch.testing.assert_close(g.states.conv[:, row], e.states.conv[:, row], rtol=0, atol=1e-5)
    slots = e.table.table[row, :45].long()
    torch.testing.assert_close(g.tokens.latent[:, slots], e.tokens.latent[:, slots], rtol=0, atol=1e-5)
    scratch_page = e.table.table[e.scratch_slot, 0].long() + torch.arange(PAGE)
    untouched = torch.ones(g.tokens.latent.shape[1], dtype=torch.bool)
    untouched[slots] = False
    untouched[scratch_page] = False
    assert torch.equal(g.tokens.latent[:, untouched], e.tokens.latent[:, untouched])


def long_waves() -> list[list[list[int]]]:
    """Two waves over a shared 200-token prefix (as `test_prefix_cache.waves`, at a page of 64): first
    prefills whose snapshots fall inside them, then hits that compute the rest."""
    shared = random_prompt(200, 160, seed=11)
    a = shared + random_prompt(30, 160, seed=12)
    first = [a, random_prompt(100, 160, seed=13)]
    second = [a, shared[:130] + random_prompt(9, 160, seed=15), a + random_prompt(40, 160, seed=16)]
    return [first, second]


def make_llm(path, **kwargs) -> LLM:
    return LLM(
        str(path), device="cpu", dtype="float32", page_size=64, prefix_snapshot_interval=128,
        context_length=512,
        speculative_adaptive=False, max_memory_gb=0.25, max_running_requests=1, cuda_graph_max_bs=1,
        cuda_graph_max_prefill_tokens=256, **kwargs,
    )  # fmt: skip


@pytest.mark.parametrize(
    "settings",
    [
        dict(),
        dict(chunked_prefill_size=24),  # chunks without a sample, and snapshots inside chunks: eager
        dict(algorithm="DFLASH"),
    ],
    ids=["one-at-a-time", "chunks-of-24", "dflash"],
)
def test_engines_with_prefill_graphs_give_the_eager_outputs(target, draft, settings):  # noqa: F811
    """One request running at a time (each prefill chunk alone in its step), the prefix cache on: the
    graphs' engine gives the eager engine's tokens and logprobs (and drafts), took every prefill
    through the graphs (snapshots inside chunks included), and returns every page and snapshot."""
    settings = dict(settings)
    if settings.pop("algorithm", None):
        settings.update(speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft))
        # `run` reads the proposer's drafts after each step: the schedule that reads every step (a
        # verify step launched ahead would have drafted again by then)
        settings.update(disable_overlap_schedule=True)
    ref, ref_drafts = run(make_llm(target, **settings), long_waves(), GREEDY)
    llm = make_llm(target, decode_graphs=True, **settings)
    graphs = llm.engine.runner.prefill_graphs
    assert graphs is not None and graphs.buckets == [16, 32, 64, 128, 256]
    decisions, runs, accepts, replay = [], [], graphs.accepts, graphs.run

    def deciding(seqs):
        decisions.append(accepts(seqs))
        return decisions[-1]

    def running(seqs):
        runs.append(len(seqs[0].token_ids))
        return replay(seqs)

    graphs.accepts, graphs.run = deciding, running
    outs, drafts = run(llm, long_waves(), GREEDY)
    assert_same(ref, outs)
    if "speculative_algorithm" in settings:
        # the drafts after every later step (a prefill graph's replay drafts nothing: the next step
        # verifies the anchor alone, and the eager engine drafts after its prefill)
        common = drafts.keys() & ref_drafts.keys()
        assert len(common) >= 15 and {k: drafts[k] for k in common} == {k: ref_drafts[k] for k in common}
    if "chunked_prefill_size" in settings:  # snapshots off the KDA chunks' boundaries: eager
        assert runs and not all(decisions)
    else:  # (a run checks its chunk again)
        assert all(decisions) and len(runs) == 5 and len(decisions) == 2 * len(runs)
    assert_all_returned(llm.engine)


def test_prefill_graph_flag():
    assert EngineConfig(model="m").cuda_graph_max_prefill_tokens == 1024
    with pytest.raises(ValueError, match="cuda_graph_max_prefill_tokens must be an int >= 0, got -1"):
        EngineConfig(model="m", cuda_graph_max_prefill_tokens=-1)
