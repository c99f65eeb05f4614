"""Tensor and expert parallelism on the CPU (gloo, 2 ranks): the same tokens and logprobs as one rank,
with and without speculative decoding; each rank reads only its slices of the checkpoint."""

from __future__ import annotations

import json
import math

import pytest
import torch
from follower_pool import FollowerPool
from safetensors import safe_open

from hylo import LLM
from hylo.config import EngineConfig, ModelConfig
from hylo.engine.engine import Engine
from hylo.layers.moe import MoE
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import build_model, checkpoint_layout, load_model, load_weights, save_checkpoint
from hylo.parallel.layout import Parallel, StandInCollectives, TokenShards
from hylo.sampling import SamplingParams
from hylo.speculative.token_map import save_token_map
from hylo.tokenizer import Tokenizer

# fp32 sums of a row-parallel projection split in two, against one: a few ulps of the logits
LOGPROB_TOLERANCE = 1e-4

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [20, 21, 22], list(range(40, 110))]


@pytest.fixture(scope="module")
def random_model(shallow_model_dir):
    """The 3-layer cut of the random test model (conftest `shallow_model_dir`): a layer of each kind,
    each split across the ranks as every layer of its kind is."""
    return shallow_model_dir


@pytest.fixture(scope="module")
def pooled_ranks():
    """Rank 1 of every TP=2 engine here runs in one process, started once (tests/follower_pool.py), as
    a spawned worker would: a worker's start-up (~4 s of CPU importing torch and hylo) cost more than
    the small engine it served. The real worker processes are test_tensor_parallel_server's."""
    with FollowerPool(1) as pool, pytest.MonkeyPatch.context() as monkeypatch:
        pool.patch(monkeypatch)
        yield


def _generate(model, prompts, params, **engine_args):
    # a 0.25 GB cache: the default plan's ~2 GB of pools took ~1 s an engine and a rank to allocate
    engine_args.setdefault("max_memory_gb", 0.25)
    llm = LLM(None if model is None else str(model), device="cpu", **engine_args)
    try:
        return llm, llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
    finally:
        llm.engine.close()


def _assert_same(reference, outputs):
    for ref, out in zip(reference, outputs, strict=True):
        assert out.token_ids == ref.token_ids
        for ref_lp, lp in zip(ref.logprobs, out.logprobs, strict=True):
            assert ref_lp.keys() == lp.keys()
            for token, value in ref_lp.items():
                assert lp[token] == pytest.approx(value, abs=LOGPROB_TOLERANCE)


@pytest.mark.usefixtures("pooled_ranks")
def test_two_ranks_equal_one_by_expert_and_by_tensor(random_model):
    """Greedy tokens and top logprobs of TP=2 (experts split by expert, then by tensor) equal TP=1's,
    over chunked prefill (a 70-token prompt in 32-token chunks) and a prefix-cache hit."""
    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    prompts = [*PROMPTS, [*PROMPTS[2][:64], 7, 7]]  # the last shares a page-aligned prefix with the third
    args = dict(chunked_prefill_size=32, page_size=16, prefix_snapshot_interval=16)
    _, reference = _generate(random_model, prompts, params, **args)
    for ep in (2, 1):
        llm, outputs = _generate(random_model, prompts, params, tp_size=2, ep_size=ep, **args)
        _assert_same(reference, outputs)
        report = llm.engine.memory_report
        assert [r["max_total_num_tokens"] for r in report["ranks"]] == [report["max_total_num_tokens"]] * 2
        # each rank holds about half of the weights (the replicated norms, router, indexer and mHC aside)
        one_rank = report["ranks"][1]["weights_bytes"]
        assert one_rank == report["weights_bytes"]
    single = load_model(random_model, dtype=torch.float32, progress=False)
    total = sum(t.numel() * t.element_size() for t in single.state_dict().values())
    assert 0.5 * total < one_rank < 0.7 * total


@pytest.mark.usefixtures("pooled_ranks")
def test_two_ranks_prefill_a_lone_long_prompt_in_chunks(random_model):
    """One prompt longer than a chunk, alone: its first chunks' steps have no logits to gather (the
    vocabulary-parallel head's all-gather of zero rows failed before), and TP=2 equals TP=1."""
    params = SamplingParams(max_tokens=4, temperature=0, logprobs=2)
    args = dict(chunked_prefill_size=32)
    _, reference = _generate(random_model, [PROMPTS[2]], params, **args)
    _, outputs = _generate(random_model, [PROMPTS[2]], params, tp_size=2, **args)
    _assert_same(reference, outputs)


@pytest.mark.usefixtures("pooled_ranks")
def test_two_ranks_split_by_token_equal_one(random_model, monkeypatch):
    """Sequence parallelism (`sequence_parallel_tokens` 5: every prefill step, and none of the 4-token
    decode steps): the streams split by token, odd token counts padded, give TP=1's tokens and logprobs,
    experts split by expert and by tensor."""
    seen = []
    scatter = Parallel.reduce_scatter_rows

    def counted(self, x, shards):
        seen.append(shards.tokens)
        return scatter(self, x, shards)

    monkeypatch.setattr(Parallel, "reduce_scatter_rows", counted)
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=2)
    prompts = [*PROMPTS, [3, 4, 5, 6]]  # 85 tokens: two 32-token steps and 21
    args = dict(chunked_prefill_size=32)
    _, reference = _generate(random_model, prompts, params, **args)
    assert not seen  # one rank: nothing to split
    for ep in (2, 1):
        split = dict(tp_size=2, ep_size=ep, sequence_parallel_tokens=5)
        _, outputs = _generate(random_model, prompts, params, **split, **args)
        _assert_same(reference, outputs)
    assert seen and min(seen) >= 5 and any(t % 2 for t in seen)  # rank 0 split steps, odd ones among them


def test_token_shards_split_pad_and_gather():
    """Rank r holds rows [r·local, (r+1)·local) of the padded tokens; a rank measured alone (stand-in)
    keeps its rows of its own partial sum and gathers its rows into every place; steps below the
    threshold, or with sequence parallelism off, stay whole."""
    parallel = Parallel(rank=2, size=3, stand_in=StandInCollectives(), sequence_parallel_tokens=4)
    assert parallel.token_shards(3) is None and Parallel(0, 3).token_shards(100) is None
    shards = parallel.token_shards(7)
    assert (shards.local, shards.padded) == (3, 9)
    x = torch.arange(7 * 2, dtype=torch.float32).reshape(7, 2)
    mine = parallel.reduce_scatter_rows(x, shards)
    assert torch.equal(mine, torch.cat([x[6:], torch.zeros(2, 2)]))  # row 6, then two padding rows
    whole = parallel.all_gather_rows(mine, shards)
    assert whole.shape == (7, 2) and torch.equal(whole[:3], mine)
    assert [(c.kind, c.shape) for c in parallel.stand_in.calls] == [("reduce_scatter", (9, 2)),
                                                                    ("all_gather", (3, 2))]  # fmt: skip
    assert TokenShards(6, 3, 1).take(x).tolist() == x[2:4].tolist()
    rows = torch.arange(7)[:, None].expand(7, 4)
    assert shards.take(rows, -1).tolist() == [[6] * 4, [-1] * 4, [-1] * 4]  # padding attends no row
    # the attention's swap: every token with this rank's 2 heads <-> this rank's tokens with all 6 heads
    q = torch.randn(7, 2, 5)
    by_token = parallel.heads_to_tokens(q, shards)
    assert by_token.shape == (3, 6, 5) and torch.equal(by_token[0, 4:], q[6])  # its own heads, in place
    back = parallel.tokens_to_heads(by_token, shards)
    assert back.shape == (7, 2, 5) and torch.equal(back[6], q[6])
    assert [c.kind for c in parallel.stand_in.calls[2:]] == ["all_to_all"] * 2


@pytest.mark.usefixtures("pooled_ranks")
def test_two_ranks_speculative_equal_one(tmp_path):
    """DFlash2, MTP with 3 steps and DFlash with a token map on the demo model, drafts verified every
    step: TP=2 commits the tokens TP=1 does (lossless either way) with the same acceptance, so drafts
    agree across ranks (the map's tokens lie in both ranks' vocabulary halves)."""
    params = SamplingParams(max_tokens=16, temperature=0, logprobs=1)
    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    chats = ["What is the capital of France?", "Write a short poem about the sea."]
    prompts = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": c}]), add_special_tokens=False
        )
        for c in chats
    ]
    # every token of rank 0's half of the vocabulary (the frequent ones), every other one of rank 1's
    hot_map = torch.cat(
        [
            torch.arange(tokenizer.vocab_size // 2),
            torch.arange(tokenizer.vocab_size // 2, tokenizer.vocab_size, 2),
        ]
    )
    for spec in (
        # prefill steps split by token (the target's features gathered for the draft)
        dict(
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=str(DEMO_DRAFTS["dflash2"]),
            sequence_parallel_tokens=8,
        ),
        dict(speculative_algorithm="MTP", speculative_num_steps=3),
        dict(
            speculative_algorithm="DFLASH",
            speculative_draft_model_path=str(DEMO_DRAFTS["dflash"]),
            speculative_token_map=str(save_token_map(hot_map, tmp_path / "map.pt")),
        ),
    ):
        spec |= dict(speculative_adaptive=False)
        _, reference = _generate(None, prompts, params, **spec)
        _, outputs = _generate(None, prompts, params, tp_size=2, **spec)
        _assert_same(reference, outputs)
        accepted = [o.metrics.spec_accepted_tokens for o in outputs]
        assert accepted == [o.metrics.spec_accepted_tokens for o in reference]
        assert sum(accepted) > 0


@pytest.mark.parametrize("fp8", [False, True], ids=["fp32", "fp8"])
@pytest.mark.parametrize("ep", [2, 1], ids=["by-expert", "by-tensor"])
def test_each_rank_reads_only_its_slices(random_model, tmp_path, fp8, ep):
    """Each rank holds exactly TP=1's tensors cut along the split dims (FP8 weights dequantised with the
    whole weight's block scales, at offsets inside a block), and reads only that: together the two
    ranks read each split tensor and each routed expert once and each replicated tensor twice."""
    single = load_model(random_model, dtype=torch.float32, progress=False)
    path = tmp_path / "ckpt"
    save_checkpoint(single, path, json.loads((random_model / "config.json").read_text()), fp8=fp8)
    reference = load_model(path, dtype=torch.float32, progress=False)
    ranks, read = [], []
    for rank in range(2):
        model = build_model(reference.config, "cpu", torch.float32, Parallel(rank, 2, ep))
        read.append(load_weights(model, path, progress=False))
        ranks.append(model)
    file_bytes = _file_tensor_bytes(path)
    whole = sum(file_bytes.values())
    assert max(read) < 0.75 * whole
    if not fp8:  # (FP8: both ranks also read the small block scales of the weights they dequantise)
        split = {k for k, slot in checkpoint_layout(ranks[0]).items() if slot.shard is not None}
        once = [k for k in file_bytes if _local(k) in split or ".mlp.experts." in k]
        assert split and sum(read) == 2 * whole - sum(file_bytes[k] for k in once)
    # checkpoint tensor by checkpoint tensor (a fused projection's parts are cut one by one)
    held = [(checkpoint_layout(m), _tensors(m)) for m in ranks]
    reference_tensors = _tensors(reference)
    for key, slot in checkpoint_layout(reference).items():
        full = slot.view(reference_tensors[slot.param])
        parts = [(lay[key], lay[key].view(t[lay[key].param])) for lay, t in held if key in lay]
        assert parts, key
        if parts[0][0].shard is None:  # replicated, or a routed expert only one rank holds
            for _, part in parts:
                torch.testing.assert_close(part, full, rtol=0, atol=0)
            continue
        ordered = [part for s, part in sorted(parts, key=lambda p: p[0].shard.start)]
        torch.testing.assert_close(torch.cat(ordered, parts[0][0].shard.dim), full, rtol=0, atol=0)


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(model.named_parameters()) | dict(model.named_buffers())


def _local(raw: str) -> str:
    return raw.removeprefix("model.language_model.")


def _file_tensor_bytes(path) -> dict[str, int]:
    sizes = {}
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for key in f.keys():  # noqa: SIM118 (a safetensors handle is not iterable)
            t = f.get_slice(key)
            sizes[key] = math.prod(t.get_shape()) * {"F32": 4, "BF16": 2, "F8_E4M3": 1}[t.get_dtype()]
    return sizes


def test_parallel_settings_are_checked(random_model):
    with pytest.raises(ValueError, match="ep_size must be 1 or tp_size"):
        EngineConfig(tp_size=4, ep_size=2)
    with pytest.raises(ValueError, match="multiple of nnodes"):
        EngineConfig(tp_size=3, nnodes=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match=r"dist_init_addr .* is required"):
        EngineConfig(tp_size=4, nnodes=2)
    with pytest.raises(ValueError, match="host:port"):
        EngineConfig(dist_init_addr="nohost")
    with pytest.raises(ValueError, match="node_rank"):
        EngineConfig(tp_size=2, nnodes=2, node_rank=2, dist_init_addr="h:1")
    with pytest.raises(ValueError, match=r"sequence_parallel_tokens must be an int >= 0, got -1"):
        EngineConfig(tp_size=2, sequence_parallel_tokens=-1)
    config = ModelConfig.from_dir(random_model)
    with pytest.raises(ValueError, match=r"linear_num_heads \(4\) must be divisible by tp_size \(3\)"):
        Glm5NextForCausalLM(config, Parallel(0, 3, 1))
    with pytest.raises(ValueError, match=r"n_routed_experts \(16\) must be divisible by tp_size \(3\)"):
        MoE(config, Parallel(0, 3, 3))
    # the engine runs on the ranks it is given: hylo.distributed.launch starts them, above the engine
    with pytest.raises(ValueError, match=r"tp_size 2: the engine is given 1 rank\(s\); start them with"):
        Engine(EngineConfig.from_kwargs(model=str(random_model), device="cpu", tp_size=2))


@pytest.mark.parametrize("lead", [(0,), (2, 3)])
def test_all_gather_keeps_leading_dims_with_no_rows(lead):
    """A rank's all-gather of `[..., n]` is `[..., size·n]`, also where the leading dims hold nothing (a
    prefill chunk with no logits to gather: the TP8 rank's prefill table died on it, S37)."""
    parallel = Parallel(rank=0, size=8, stand_in=StandInCollectives())
    x = torch.arange(math.prod(lead) * 5, dtype=torch.float32).reshape(*lead, 5)
    out = parallel.all_gather(x)
    assert out.shape == (*lead, 40)
    assert torch.equal(out, torch.cat([x] * 8, dim=-1))
    assert parallel.stand_in.calls[0].shape == (math.prod(lead), 5)
