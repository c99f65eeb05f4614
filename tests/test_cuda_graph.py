"""Fixed-shape decode (the batches CUDA graphs replay) on the CPU: padded batches in batch-size buckets
give the eager path's logits and caches, the scratch slot absorbs the padding, and the engine generates
the same tokens with it."""

from __future__ import annotations

import argparse
import dataclasses

import pytest
import torch
from conftest import random_prompt
from hf_reference import tiny_text_config, write_hf_checkpoint
from tolerance import assert_fp32_close, model_accumulation_terms

from hylo.config import EngineConfig
from hylo.engine.cuda_graph import DecodeGraphs, batch_size_buckets
from hylo.engine.engine import Engine
from hylo.engine.runner import ModelRunner
from hylo.forward_batch import FixedShape, ForwardBatch, Packed, SequenceChunk, Uniform
from hylo.memory.manager import CacheManager, MemoryPlan, target_cache_specs
from hylo.models.loader import load_model
from hylo.sampling import SamplingParams
from hylo.speculative.proposer import Proposer
from hylo.speculative.verify import VerifyShape

PAGE, MAX_LEN, SLOTS = 16, 64, 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_hf_checkpoint(tmp_path_factory.mktemp("graphs"), tiny_text_config(4, 8), seed=5)


@pytest.fixture(scope="module")
def model(checkpoint):
    return load_model(checkpoint, dtype=torch.float32, progress=False)


def caches_for(model, scratch: bool = True) -> CacheManager:
    plan = MemoryPlan(SLOTS * MAX_LEN // PAGE, PAGE, SLOTS, MAX_LEN, 0, 0, scratch)
    return CacheManager(model.config, plan, torch.float32, "cpu")


def admit(caches: CacheManager, count: int) -> list[int]:
    slots = [caches.acquire_slot() for _ in range(count)]
    for slot in slots:
        assert caches.grow(slot, [], MAX_LEN)
    return slots


def build(caches: CacheManager, chunks, **kwargs) -> ForwardBatch:
    c = caches
    return ForwardBatch.build(chunks, c.table.table, c.tokens, c.states, c.kpool, **kwargs)


def test_batch_size_buckets():
    assert batch_size_buckets(1) == [1]
    assert batch_size_buckets(3) == [1, 2, 3]
    assert batch_size_buckets(8) == [1, 2, 4, 8]
    assert batch_size_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_size_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_size_buckets(0)


def test_scratch_slot_and_page_are_never_handed_out(model):
    caches = caches_for(model)
    plan = caches.plan
    assert caches.scratch_slot == plan.num_slots == caches.states.num_slots - 1
    assert caches.tokens.num_slots == (plan.num_pages + 1) * PAGE
    assert caches.table.table[caches.scratch_slot, 0] == plan.num_pages * PAGE
    slots = [caches.acquire_slot() for _ in range(plan.num_slots)]
    assert caches.acquire_slot() is None and caches.scratch_slot not in slots
    assert caches.pages.alloc(plan.num_pages + 1) is None
    assert plan.num_pages not in caches.pages.alloc(plan.num_pages)
    config, budget = model.config, 2**22
    specs = target_cache_specs(config, torch.float32)
    plain = MemoryPlan.from_budget(specs, budget, PAGE, 4, MAX_LEN)
    reserved = MemoryPlan.from_budget(specs, budget, PAGE, 4, MAX_LEN, scratch=True)
    paid = plain.bytes_per_slot + plain.bytes_per_token * PAGE
    assert reserved.num_pages == int(
        (budget - paid - 4 * plain.bytes_per_slot) // (PAGE * plain.bytes_per_token)
    )


def test_fixed_shape_batch_pads_onto_the_scratch_slot(model):
    caches = caches_for(model)
    a, b = admit(caches, 2)
    chunks = [SequenceChunk([7], 11, a, a), SequenceChunk([9], 30, b, b)]  # b completes pool 7
    width = MAX_LEN // caches.kpool
    eager, fixed = (
        build(caches, chunks),
        build(caches, chunks, fixed=FixedShape(4, width, caches.scratch_slot)),
    )
    scratch_token = caches.plan.num_pages * PAGE
    assert fixed.input_ids.tolist() == [7, 9, 0, 0] and fixed.positions.tolist() == [11, 30, 0, 0]
    assert fixed.state_slots.tolist() == [a, b, caches.scratch_slot, caches.scratch_slot]
    assert fixed.new_slots[2:].tolist() == [scratch_token] * 2
    assert fixed.extend_lens == [1] * 4 and fixed.logits_index.tolist() == [0, 1, 2, 3]
    assert fixed.pool_table.shape == (4, eager.pool_table.shape[1])  # the batch's width, not the table's
    assert torch.equal(fixed.pool_table[:2], eager.pool_table) and (fixed.pool_table[2:] == -1).all()
    assert fixed.completed_pools.tolist() == [*eager.completed_pools.tolist(), *[scratch_token // 4] * 3]
    with pytest.raises(ValueError, match="chunks: 2 sequences, the fixed shape holds 1"):
        build(caches, chunks, fixed=FixedShape(1, width, caches.scratch_slot))
    with pytest.raises(ValueError, match=r"fixed\.pool_width: 4 pools, a sequence has 7"):
        build(caches, chunks, fixed=FixedShape(4, 4, caches.scratch_slot))


def test_decode_graphs_take_plain_decode_steps_only(model):
    with pytest.raises(ValueError, match="caches: fixed-shape decode batches need a scratch slot"):
        DecodeGraphs(model, caches_for(model, scratch=False), 4, capture=False)
    caches = caches_for(model)
    graphs = DecodeGraphs(model, caches, 3, capture=False)
    assert graphs.buckets == [1, 2, 3] and not graphs.bank.graphs
    one = SequenceChunk([5], 3, 0, 0)
    assert graphs.accepts([one] * 3)
    rejected = [
        [one] * 4,  # above the largest bucket
        [SequenceChunk([5, 6], 3, 0, 0)],  # prefill
        [SequenceChunk([5], 3, 0, 0, sample=False)],  # one prompt token of a longer prompt
        [SequenceChunk([5], 3, 0, 0, verify=True)],
    ]
    for seqs in rejected:
        assert not graphs.accepts(seqs)
        with pytest.raises(ValueError, match="seqs: a fixed-shape decode takes up to 3"):
            graphs.run(seqs)

    class Drafter(Proposer):
        verify_shape = VerifyShape(3)

        def propose(self, batch, commit):
            pass

    with pytest.raises(
        ValueError, match="graphs: graphs serve an engine with a proposer only when captured with it"
    ):
        ModelRunner(model, caches, 0, Drafter(), graphs)


def test_padded_decode_matches_eager_and_the_scratch_slot_absorbs_the_padding(model):
    """Same prompts and tokens through eager batches (caches `ref`) and through the bucketed fixed-shape
    path (caches `fix`): batch sizes between buckets, pools completing along the way."""
    ref, fix = caches_for(model), caches_for(model)
    graphs = DecodeGraphs(model, fix, 8, capture=False)
    # padded batches are other shapes than the eager ones: equal up to fp32 reordering, not bit for bit
    terms = model_accumulation_terms(model.config)
    slots = admit(ref, 7)
    assert admit(fix, 7) == slots
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(3, 24, (7,), generator=gen).tolist()
    prompts = [random_prompt(n, model.config.vocab_size, seed=i) for i, n in enumerate(lengths)]
    prefill = [SequenceChunk(p, 0, s, s) for p, s in zip(prompts, slots, strict=True)]
    for caches in (ref, fix):
        model(build(caches, prefill))
    for step, batch_size in enumerate([3, 5, 7, 6, 1, 7]):
        tokens = torch.randint(0, model.config.vocab_size, (batch_size,), generator=gen).tolist()
        seqs = [SequenceChunk([t], lengths[i], slots[i], slots[i]) for i, t in enumerate(tokens)]
        eager = build(ref, seqs)
        expected = model(eager).logits
        batch, forward = graphs.run(seqs)
        logits = forward.logits
        bucket = next(b for b in graphs.buckets if b >= batch_size)
        assert len(batch.extend_lens) == bucket and batch is graphs.bank.static[bucket]
        assert_fp32_close(logits, expected, terms, msg=f"step {step}, batch of {batch_size}")
        # the step's pools, then -1: also where an earlier, wider step wrote into the same rows
        static, width = batch.pool_table[:batch_size], eager.pool_table.shape[1]
        assert torch.equal(static[:, :width], eager.pool_table) and (static[:, width:] == -1).all()
        for i in range(batch_size):
            lengths[i] += 1

    scratch, page = fix.scratch_slot, fix.plan.num_pages
    real_tokens = slice(0, page * PAGE)
    for name in ("conv", "recurrent"):
        ours, theirs = getattr(fix.states, name), getattr(ref.states, name)
        assert_fp32_close(ours[:, :scratch], theirs[:, :scratch], terms, msg=name)
        assert (theirs[:, scratch] == 0).all() and (ours[:, scratch] != 0).any(), f"scratch {name}"
    for name in ("latent", "index_key", "index_gate"):
        ours, theirs = getattr(fix.tokens, name), getattr(ref.tokens, name)
        assert_fp32_close(ours[:, real_tokens], theirs[:, real_tokens], terms, msg=name)
        assert (ours[:, page * PAGE] != 0).any() and (theirs[:, page * PAGE] == 0).all(), f"scratch {name}"
    pools = page * PAGE // fix.kpool
    assert_fp32_close(fix.tokens.pooled_key[:, :pools], ref.tokens.pooled_key[:, :pools], terms, msg="pooled")
    assert (fix.tokens.pooled_key[:, :pools] != 0).any()


def test_a_verify_graphs_static_batch_plans_its_kda_blocks_on_its_own_slots(model):
    """A fixed-shape verify batch is `Uniform`, and its KDA plan's blocks read the batch's own state
    slots tensor, which each step's upload rewrites in place: a replay verifies and commits the
    step's slots, not the capture's."""
    caches = caches_for(model)
    pool_width = caches.table.table.shape[1] // caches.kpool
    fixed = FixedShape(3, pool_width, caches.scratch_slot, tokens_per_seq=4, kpool=caches.kpool)
    batch = build(caches, [], fixed=fixed)
    assert batch.layout == Uniform(4) and batch.verify_seqs == [0, 1, 2]
    plan = batch.kda.verify()
    assert plan.block_slots is batch.state_slots and plan.other_slots.numel() == 0
    batch.state_slots.copy_(torch.tensor([2, 1, 0]))
    assert batch.kda.verify().block_slots.tolist() == [2, 1, 0]


def test_a_verify_graphs_kda_layer_reads_its_blocks_as_views(model, monkeypatch):
    """A fixed-shape verify batch's blocks are its packed tokens in order (`VerifyPlan.whole_batch`):
    the KDA layer verifies views of its projections and returns the blocks' outputs as they are, no
    gather or scatter of tokens around the verify op, with the outputs of the general path (gathers
    by the block tables) up to the order of fp32 sums."""
    from torch.utils._python_dispatch import TorchDispatchMode

    import hylo.layers.kda as kda_layer

    class IndexOps(TorchDispatchMode):
        """Index ops the layer runs itself (the verify op's own, the reference's slot reads, are not its)."""

        def __init__(self):
            super().__init__()
            self.seen, self.inside_verify = [], 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not self.inside_verify and func.__name__.split(".")[0] in ("index", "index_put_"):
                self.seen.append(func.__name__)
            return func(*args, **(kwargs or {}))

    index_ops, verify = IndexOps(), kda_layer.kda_ops.verify

    def counted_verify(*args, **kwargs):
        index_ops.inside_verify += 1
        try:
            return verify(*args, **kwargs)
        finally:
            index_ops.inside_verify -= 1

    monkeypatch.setattr(kda_layer.kda_ops, "verify", counted_verify)
    caches = caches_for(model)
    pool_width = caches.table.table.shape[1] // caches.kpool
    fixed = FixedShape(3, pool_width, caches.scratch_slot, tokens_per_seq=4, kpool=caches.kpool)
    batch = build(caches, [], fixed=fixed)
    batch.state_slots.copy_(torch.tensor(admit(caches, 3)))
    assert batch.kda.verify().whole_batch
    kda = next(layer.self_attn for layer in model.layers if layer.is_linear)
    x = torch.randn(12, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode(), index_ops:
        out, _ = kda(x, batch)
    assert index_ops.seen == []
    batch.kda._verify = dataclasses.replace(batch.kda.verify(), whole_batch=False)
    with torch.inference_mode(), index_ops:
        gathered, _ = kda(x, batch)
    assert len(index_ops.seen) == 7  # the general path: five inputs and the outputs gathered, one scatter
    # the CPU reference's products over strided views and over gathered copies may sum in other orders:
    # one layer's reductions over its widest input (the hidden size)
    assert_fp32_close(out, gathered, model.config.hidden_size, msg="views against gathers")


def test_static_pool_table_is_reset_where_a_wider_step_wrote(model):
    """A step's pools fill the first columns of the static pool table and -1 the rest: columns that an
    earlier, wider step wrote into the same rows go back to -1."""
    caches = caches_for(model)
    graphs = DecodeGraphs(model, caches, 2, capture=False)
    kpool = caches.kpool
    short, long_ = admit(caches, 2)

    def step(*seqs: tuple[int, int]) -> None:
        chunks = [SequenceChunk([3], length, slot, slot) for slot, length in seqs]
        eager = build(caches, chunks)
        batch, _ = graphs.run(chunks)
        static, width = batch.pool_table[: len(chunks)], eager.pool_table.shape[1]
        assert torch.equal(static[:, :width], eager.pool_table) and (static[:, width:] == -1).all()

    step((short, kpool), (long_, 3 * kpool))  # rows 0, 1: 1 and 3 pools
    step((short, kpool))  # bucket 1 = row 0 of the same memory
    step((short, kpool), (short, 2 * kpool))  # row 1 had 3 pools


def test_engine_with_decode_graphs_generates_the_plain_engines_tokens(checkpoint):
    """Greedy generation through fixed-shape decode batches (CPU: plain calls on the static batches)
    equals the plain engine's; batches above the largest bucket fall back to eager steps."""
    config = EngineConfig(
        model=str(checkpoint), device="cpu", dtype="float32", page_size=16, context_length=128,
        max_memory_gb=0.02, max_running_requests=8, cuda_graph_max_bs=4,
    )  # fmt: skip
    prompts = [random_prompt(n, 160, seed=200 + i) for i, n in enumerate([37, 5, 13, 1, 22, 9])]

    def generate(engine: Engine) -> dict[str, list[int]]:
        for i, prompt in enumerate(prompts):
            params = SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
            engine.add_request(str(i), prompt, params)
        tokens: dict[str, list[int]] = {}
        while engine.has_unfinished():
            for out in engine.step():
                tokens.setdefault(out.request.request_id, []).extend(out.new_token_ids)
        return tokens

    plain = Engine(config)
    assert plain.runner.graphs is None and not plain.plan.scratch
    expected = generate(plain)

    engine = Engine(config, decode_graphs=True)
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.buckets == [1, 2, 4]
    decisions: list[tuple[int, bool]] = []
    accepts = graphs.accepts

    def recording(seqs):
        decisions.append((len(seqs), accepts(seqs)))
        return decisions[-1][1]

    graphs.accepts = recording
    free = (engine.caches.num_available_pages, engine.caches.slots.num_free)
    assert generate(engine) == expected
    assert (6, False) in decisions and {(4, True), (3, True), (1, True)} <= set(decisions)
    assert (engine.caches.num_available_pages, engine.caches.slots.num_free) == free


def test_cuda_graph_flags():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    defaults = EngineConfig.from_cli(parser.parse_args([]))
    assert defaults.disable_cuda_graph is False and defaults.cuda_graph_max_bs is None
    config = EngineConfig.from_cli(parser.parse_args(["--disable-cuda-graph", "--cuda-graph-max-bs", "16"]))
    assert config.disable_cuda_graph is True and config.cuda_graph_max_bs == 16
    with pytest.raises(ValueError, match="cuda_graph_max_bs must be >= 1"):
        EngineConfig(cuda_graph_max_bs=0)
    with pytest.raises(ValueError, match="disable_cuda_graph must be a bool"):
        EngineConfig(disable_cuda_graph="yes")


@pytest.mark.parametrize("width", [1, 3, 4, 6])
@pytest.mark.parametrize("num_seqs", [1, 3])
def test_device_built_batch_is_the_host_built_one(model, num_seqs, width):
    """`ForwardBatch.uniform` (what a graph builds inside its capture) against `ForwardBatch.build` of
    the same sequences: every tensor equal and dense (kernels index them as dense rows; a stride-0
    view for one sequence crashed the GPU's top-k kernel), the pool table as wide as the request
    table with -1 past the host one's columns, and the completed pools the host's, a candidate that
    does not complete replaced by the sequence's pool at its prefix."""
    caches = caches_for(model, scratch=False)
    slots = admit(caches, num_seqs)
    prefixes = [5, 12, 30][:num_seqs]
    chunks = [SequenceChunk([0] * width, p, s, s, sample=False) for p, s in zip(prefixes, slots, strict=True)]
    host = build(caches, chunks, all_logits=True)
    c, kpool, table = caches, caches.kpool, caches.table.table
    rows = torch.tensor(slots)
    dev = ForwardBatch.uniform(torch.tensor(prefixes), rows, width, table, c.tokens, c.states, kpool)
    for name in ("input_ids", "positions", "token_seq", "token_rows", "new_slots", "state_slots", "pad_index",
                 "pad_valid", "logits_index"):  # fmt: skip
        got, expected = getattr(dev, name), getattr(host, name)
        assert torch.equal(got, expected) and got.is_contiguous(), name
    columns = host.pool_table.shape[1]
    assert dev.pool_table.shape == (num_seqs, table.shape[1] // kpool) and dev.pool_table.is_contiguous()
    assert torch.equal(dev.pool_table[:, :columns], host.pool_table)
    assert bool((dev.pool_table[:, columns:] == -1).all())
    expected = []
    for p, s in zip(prefixes, slots, strict=True):
        for k in range(-(-width // kpool)):
            pool = p // kpool + k if p // kpool + k < (p + width) // kpool else p // kpool
            expected.append(int(table[s, pool * kpool]) // kpool)
    assert dev.completed_pools.tolist() == expected
    completing = {int(table[s, q * kpool]) // kpool for p, s in zip(prefixes, slots, strict=True)
                  for q in range(p // kpool, (p + width) // kpool)}  # fmt: skip
    assert set(host.completed_pools.tolist()) == completing <= set(expected)
    assert dev.layout == Uniform(width) and host.layout == Packed()
