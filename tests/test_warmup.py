"""The start-up warm-up (`hylo.engine.warmup`): its steps cover the shape classes it claims, a warm-up
runs them eagerly in the scratch slot and leaves every cache, the prefix cache and the sampling seeds as
it found them, the builder runs it where kernels compile unless `--skip-warmup`, and an engine that
warmed up serves the tokens of one that did not. The CPU compiles nothing, so the engines here warm
up only where the tests say so (`compiles_kernels` patched); a tiny MTP target (`mtp_checkpoint`) keeps
each warm-up to a few seconds."""

from __future__ import annotations

import argparse
import logging
import math

import pytest
import torch
from conftest import random_prompt
from mtp_checkpoint import write_mtp_target
from test_mtp import VOCAB

from hylo import LLM, SamplingParams
from hylo.config import EngineConfig
from hylo.engine import warmup
from hylo.engine.warmup import DECODE, LAST, MIDDLE, SCORE, VERIFY, WarmupShapes, warm_up, warmup_steps
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.ops.kda import CHUNK_TOKENS

PAGE, CONTEXT, CHUNK, RUNNING, STEPS = 16, 256, 80, 3, 2


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A target with an MTP layer over the 4-layer tiny mix with one layer of each kind (hf_reference
    'each-kind'; test_mtp's has 6) and 3 Sinkhorn iterations of its mHC weights (the model's 20 are
    checked in test_mhc_kernels and test_hf_parity; the loop was ~1/3 of each CPU forward here): the
    warm-up's steps and what it leaves depend on neither."""
    return write_mtp_target(tmp_path_factory.mktemp("mtp"), "each-kind", hc_sinkhorn_iters=3)


def make_llm(path, **kwargs) -> LLM:
    """MTP-2 with the prefix cache (snapshots every 32 tokens), prefill chunks of at most `CHUNK`
    tokens, `RUNNING` requests at once. A 20 MB cache budget still holds ~28k tokens of pages and ~200
    snapshots, far beyond `RUNNING` sequences of `CONTEXT` (0.25 GB's pools cost every engine time to
    fill with zeros, and the warm-up test to clone and compare)."""
    return LLM(
        str(path), device="cpu", dtype="float32", page_size=PAGE, prefix_snapshot_interval=32,
        context_length=CONTEXT, max_memory_gb=0.02, max_running_requests=RUNNING, chunked_prefill_size=CHUNK,
        speculative_algorithm="MTP", speculative_num_steps=STEPS, speculative_adaptive=False, **kwargs,
    )  # fmt: skip


def engine_steps(engine) -> list[warmup.WarmupStep]:
    """The steps the builder would warm `engine` up with."""
    config, mixed = engine.config, engine.scheduler.mixed_steps
    shapes = WarmupShapes.of(
        config.longest_prefill_step, engine.plan, engine.caches, engine.proposer, mixed=mixed
    )
    return warmup_steps(shapes)


def test_steps_cover_every_class_of_a_gpu_engine():
    """For a GLM-5.3-Flash-like engine (chunks of 8192, a 128K table, 256 requests, k-pool 4, MTP-3,
    snapshots): every next-power-of-two class of a step's token count up to the longest chunk has a
    member divisible by 16 and one not (from 16 up; the k-pool count likewise), every class of
    sequences + 1 up to the running limit is reached, contexts reach the table's end, and every chunk
    fits the table with the drafts' lookahead."""
    shapes = WarmupShapes(8192, 131072, 256, 4, 4, True)
    steps = warmup_steps(shapes)
    prefills = {c.tokens for s in steps if s.path == "prefill" for c in s.chunks}
    for k in range(4, 14):
        members = [n for n in prefills if 2 ** (k - 1) < n <= 2**k]
        assert any(n % 16 == 0 for n in members) and any(n % 16 for n in members), k
        assert any((n // 4) % 16 for n in members), k
    assert {1, 2, 4, 8192} <= prefills
    batches = {len(s.chunks) for s in steps if s.path == "decode batch"}
    assert {2 ** math.ceil(math.log2(b + 1)) for b in batches} == {2**k for k in range(1, 10)}
    assert {len(s.chunks) for s in steps if s.path == "mixed verify"} == batches - {1}
    ends = {c.prefix + c.tokens for s in steps if s.path.startswith("long") for c in s.chunks}
    assert max(ends) == shapes.room == 131072 - 3 and 16384 in ends
    assert all(c.prefix + c.tokens <= shapes.room for s in steps for c in s.chunks)
    (scored,) = [c for s in steps for c in s.chunks if c.kind == SCORE]
    assert scored.tokens == 1024
    snapshots = [c.snapshots for s in steps for c in s.chunks if c.snapshots]
    assert sorted(snapshots) == [(CHUNK_TOKENS, 133), (CHUNK_TOKENS + 1,)]
    assert sum(s.path == "prompt logprobs" for s in steps) == 1
    plain = warmup_steps(WarmupShapes(8192, 131072, 256, 4, None, False))
    assert not any(c.kind == VERIFY or c.snapshots for s in plain for c in s.chunks)
    assert any(s.path == "mixed" for s in plain)
    unmixed = warmup_steps(WarmupShapes(8192, 131072, 256, 4, 4, True, mixed=False))
    assert not any(s.path.startswith("mixed") for s in unmixed)  # --mixed-steps off never runs them
    assert [s for s in steps if not s.path.startswith("mixed")] == unmixed


def test_skip_warmup_is_a_flag():
    parser = argparse.ArgumentParser()
    EngineConfig.add_cli_args(parser)
    assert EngineConfig.from_cli(parser.parse_args([])).skip_warmup is False
    assert EngineConfig.from_cli(parser.parse_args(["--skip-warmup"])).skip_warmup is True
    with pytest.raises(ValueError, match="skip_warmup must be a bool"):
        EngineConfig(skip_warmup="yes")


def cache_state(engine) -> dict[str, object]:
    """Every tensor of the engine's caches and proposer, split into the scratch slot's share (its
    state slot, token page, request-table row: `scratch/...`) and the rest, and the host-side state the
    warm-up must not touch (free lists, references, the prefix tree, the sampling seeds)."""
    c, proposer = engine.caches, engine.proposer
    page = torch.arange(c.plan.num_pages * PAGE, (c.plan.num_pages + 1) * PAGE)
    not_page = torch.ones(c.num_token_slots, dtype=torch.bool)
    not_page[page] = False
    pools = torch.ones(c.num_token_slots // c.kpool, dtype=torch.bool)
    pools[page[:: c.kpool] // c.kpool] = False
    rows = torch.ones(c.table.table.shape[0], dtype=torch.bool)
    rows[c.scratch_slot] = False
    state = {}
    for owner, cache in (("tokens", c.tokens), ("mtp", proposer.cache)):
        for name in ("latent", "index_key", "index_gate"):
            t = getattr(cache, name)
            state[f"{owner}.{name}"], state[f"scratch/{owner}.{name}"] = t[:, not_page], t[:, ~not_page]
        state[f"{owner}.pooled_key"] = cache.pooled_key[:, pools]
    for name in ("conv", "recurrent"):
        t = getattr(c.states, name)
        state[f"states.{name}"], state[f"scratch/states.{name}"] = t[:, rows], t[:, ~rows]
        state[f"snapshots.{name}"] = getattr(c.snapshots, name)
    by_row = {"last_sampled": c.last_sampled, "last_committed": c.last_committed, "table": c.table.table}
    by_row |= {"drafts": proposer.drafts, "last_hidden": proposer.last_hidden}
    for name, t in by_row.items():
        state[name] = t[rows]
    state["snapshot_features"] = c.snapshot_features
    state = {k: v.clone() for k, v in state.items()}
    tree = [(key, n.page, n.depth, n.snapshot, n.last_used) for key, n in _nodes(c.prefix)]
    state |= {
        "free": (list(c.pages._free), list(c.slots._free), list(c.snapshot_ids._free)),
        "refs": list(c.pages.refs),
        "tree": tree,
        "stats": vars(c.prefix.stats).copy(),
        "seeds": engine.runner._seeds.getstate(),
    }
    return state


def _nodes(prefix):
    """The prefix tree's nodes, depth first (key, node)."""
    stack, found = list(prefix.root.children.items()), []
    while stack:
        key, node = stack.pop()
        found.append((key, node))
        stack.extend(node.children.items())
    return found


@pytest.fixture(scope="module")
def warmed(target):
    """An engine with the decode, verify and prefill graphs (plain calls on the CPU) that has served two
    prompts sharing a prefix (its prefix cache holds pages and snapshots), warmed up by hand with every
    target forward, proposer call and graph run recorded: (engine, steps, cache state before, after,
    forward batches, proposer calls, graph runs)."""
    llm = make_llm(target, decode_graphs=True, cuda_graph_max_prefill_tokens=32)
    shared = random_prompt(70, VOCAB, seed=700)
    prompts = [shared + random_prompt(9, VOCAB, seed=701), shared + random_prompt(12, VOCAB, seed=702)]
    greedy = SamplingParams(temperature=0, max_tokens=5)
    for prompt in prompts:  # the second hits the first's prefix
        llm.generate(prompt_token_ids=[prompt], sampling_params=greedy, use_tqdm=False)
    engine = llm.engine
    prefix = engine.caches.prefix
    assert prefix.stats.hit_tokens > 0 and prefix.num_snapshots > 0
    batches, calls, graph_runs = [], [], []
    model, proposer, runner = engine.model, engine.proposer, engine.runner
    forward = model.forward

    def recording(batch, *args, **kwargs):
        out = forward(batch, *args, **kwargs)
        batches.append((list(batch.extend_lens), list(batch.prefix_lens), list(batch.verify_seqs),
                        list(batch.seq_rows), dict(batch.snapshot_points), out.logits.shape[0]))  # fmt: skip
        return out

    model.forward = recording
    for name in ("observe", "propose"):
        method = getattr(proposer, name)
        setattr(proposer, name, lambda *a, _m=method, _n=name: (calls.append(_n), _m(*a))[1])
    for graphs in (runner.graphs, runner.verify_graphs, runner.prefill_graphs):
        run = graphs.run
        graphs.run = lambda *a, _r=run: (graph_runs.append(a), _r(*a))[1]
    steps = engine_steps(engine)
    before = cache_state(engine)
    seconds = warm_up(runner, engine.caches, steps, engine.model.config.vocab_size)
    after = cache_state(engine)
    del model.forward, proposer.observe, proposer.propose
    assert seconds > 0
    return engine, steps, before, after, batches, calls, graph_runs


def test_warmup_leaves_every_cache_and_the_prefix_cache_as_it_found_them(warmed):
    """Outside the scratch slot's state, page and row, every cache tensor (the target's, the MTP
    layer's, the snapshots with their features, the rows' last picks and drafts, the request table) is
    bit for bit as before, and so are the free lists, page references, the prefix tree and its
    statistics and the sampling seeds; the scratch slot's state did change (the warm-up ran there)."""
    _, _, before, after, _, _, _ = warmed
    assert before.keys() == after.keys()
    for name in before:
        if name.startswith("scratch/"):
            continue
        same = torch.equal(before[name], after[name]) if isinstance(before[name], torch.Tensor) else None
        assert same if same is not None else before[name] == after[name], name
    assert not torch.equal(before["scratch/states.recurrent"], after["scratch/states.recurrent"])


def test_warmup_runs_each_step_eagerly_in_the_scratch_slot_with_the_proposer(warmed):
    """One target forward per step, of the step's chunks (new tokens, prefixes, verify blocks, snapshot
    points, logits rows: every token of a scoring chunk, none for a middle chunk), every sequence in the
    scratch row; none through the graphs; the MTP proposer observes every step and drafts after it; the
    steps reach every path of this engine, the longest chunk and the running limit."""
    engine, steps, _, _, batches, calls, graph_runs = warmed
    scratch = engine.caches.scratch_slot
    assert len(batches) == len(steps) and not graph_runs
    for step, (extend, prefix, verify, rows, points, logits) in zip(steps, batches, strict=True):
        chunks = step.chunks
        assert extend == [c.tokens for c in chunks] and prefix == [c.prefix for c in chunks], step
        assert verify == [i for i, c in enumerate(chunks) if c.kind == VERIFY], step
        assert rows == [scratch] * len(chunks), step
        assert [[p for p, _ in points.get(i, [])] for i in range(len(chunks))] == [
            list(c.snapshots) for c in chunks
        ]
        rows_of = {LAST: 1, DECODE: 1, MIDDLE: 0}
        assert logits == sum(c.tokens if c.kind in (VERIFY, SCORE) else rows_of[c.kind] for c in chunks), step
    assert calls == ["observe", "propose"] * len(steps)
    paths = {s.path for s in steps}  # (no mixed steps: a speculative engine does not mix by default)
    assert paths == {
        "prefill", "long context", "long decode", "long verify", "decode batch", "prefill batch",
        "verify batch", "prompt logprobs", "snapshots on KDA chunk boundaries",
        "snapshot off a KDA chunk boundary",
    }  # fmt: skip
    assert max(c.tokens for s in steps for c in s.chunks) == 2 * CHUNK  # the idle budget's default
    assert max(len(s.chunks) for s in steps) == RUNNING


def counting_forwards(monkeypatch) -> list[int]:
    """Every target forward of the engines built from now on, by its token count."""
    counted, forward = [], Glm5NextForCausalLM.forward

    def counting(self, batch, *args, **kwargs):
        counted.append(len(batch.input_ids))
        return forward(self, batch, *args, **kwargs)

    monkeypatch.setattr(Glm5NextForCausalLM, "forward", counting)
    return counted


def test_the_builder_warms_up_unless_skipped_and_the_tokens_are_the_same(
    target,
    monkeypatch,
    caplog,
):
    """Where kernels compile (patched in: the CPU compiles nothing), the builder runs the warm-up's steps
    and reports its seconds beside the memory report; `--skip-warmup` and the CPU start without one, and
    say why. Both engines (no graphs: nothing reads the scratch slot) give the same tokens, logprobs and
    prompt logprobs for greedy, seeded and scoring requests and a prefix-cache hit."""
    with caplog.at_level(logging.INFO, logger="hylo"):
        make_llm(target)
        monkeypatch.setattr(warmup, "compiles_kernels", lambda device: True)
        counted = counting_forwards(monkeypatch)
        skipped = make_llm(target, skip_warmup=True)
        assert counted == []
        warmed = make_llm(target)
    steps = engine_steps(warmed.engine)
    assert counted == [sum(c.tokens for c in s.chunks) for s in steps]
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("memory: ")]
    assert [line.split("; ")[-1] for line in lines[:2]] == [
        "warm-up skipped (nothing compiles on cpu)",
        "warm-up skipped (--skip-warmup)",
    ]
    assert lines[2].endswith(f"warm-up {warmed.engine.memory_report['warmup_seconds']:.1f} s")
    assert skipped.engine.memory_report["warmup_seconds"] is None
    shared = random_prompt(40, VOCAB, seed=710)
    waves = [[shared + random_prompt(5, VOCAB, seed=711), random_prompt(3, VOCAB, seed=712)],
             [shared + random_prompt(7, VOCAB, seed=713)]]  # fmt: skip
    params = [
        SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=0.8, top_p=0.9, seed=5, max_tokens=6, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1),
    ]
    outputs = []
    for llm in (skipped, warmed):
        outs = [
            llm.generate(prompt_token_ids=w, sampling_params=p, use_tqdm=False) for w in waves for p in params
        ]
        outputs.append(
            [(s.token_ids, s.logprobs, o.prompt_logprobs) for batch in outs for o in batch for s in o.outputs]
        )
    assert outputs[0] == outputs[1]
    assert warmed.engine.caches.prefix.stats.hit_tokens > 0
