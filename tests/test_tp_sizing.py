"""The TP/EP plan of the full model (`benchmarks/sizing.py`), on meta tensors: it fits where it
should and not where it cannot, the ranks' shards add up to the one-rank model, and the collectives
the plan counts are the ones a forward makes."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import sizing

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.layers.linear import FusedLinear
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.memory.specs import TokenCacheSpec
from hylo.memory.state import StateCache
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import checkpoint_layout
from hylo.models.mtp import MTPLayer, mtp_config
from hylo.models.random_init import randomize
from hylo.parallel.layout import Parallel
from hylo.parallel.sharding import expert_of

FUSED = ("weight", "dense_weight", "weight_scale_inv")  # a FusedLinear's tensors

FULL = sizing.full_config()
GiB = 2**30


def test_full_model_fits_four_h200s_and_not_one():
    """TP4 by expert: every rank holds the same bytes and leaves >= 16 GiB for caches after the
    allowance; one rank's weights alone exceed an H200."""
    memory = sizing.rank_memory(FULL, 4, 4)
    assert memory.ranks_equal
    assert memory.left_for_caches >= 16 * GiB, memory
    single = sizing.rank_weights(FULL, 1, 1, 0)
    # more than the largest figure any source gives one H200 (nvidia-smi's 143771 MiB)
    assert single.total > sizing.NVIDIA_SMI_BYTES > 141e9
    # FP8 routed experts: every MoE layer's 288 experts of 3 [4096, 2048] e4m3 matrices, plus scales
    moe_layers = FULL.mlp_layer_types.count("sparse")
    assert single.routed_experts > moe_layers * 288 * 3 * 4096 * 2048
    assert single.routed_experts < 1.001 * moe_layers * 288 * 3 * 4096 * 2048


def _split_and_replicated(config: ModelConfig, tp: int, ep: int) -> tuple[set[str], set[str]]:
    """Tensor by tensor (target and MTP layer): the names whose parts on the ranks together hold exactly
    TP=1's bytes (the same share on every rank), and the names every rank holds whole as TP=1 does.
    Any other tensor fails."""
    whole = sizing.rank_tensor_sizes(config, 1, 1, 0)
    ranks = [sizing.rank_tensor_sizes(config, tp, ep, r) for r in range(tp)]
    assert all(r.keys() == whole.keys() for r in ranks)
    split, replicated = set(), set()
    for name, size in whole.items():
        parts = [r[name] for r in ranks]
        assert all(p.nbytes == parts[0].nbytes for p in parts), name
        if all(p.shape == size.shape for p in parts):
            replicated.add(name)
        else:
            assert sum(p.nbytes for p in parts) == size.nbytes, name
            split.add(name)
    return split, replicated


@pytest.mark.parametrize("ep", [4, 1], ids=["by-expert", "by-tensor"])
def test_shards_add_up_to_one_rank(ep):
    """The 45-layer model at TP4: the ranks together hold TP=1's bytes, each replicated tensor counted
    once per rank."""
    tp = 4
    split, replicated = _split_and_replicated(FULL, tp, ep)
    whole = sizing.rank_tensor_sizes(FULL, 1, 1, 0)
    held = sum(sizing.rank_weights(FULL, tp, ep, r).total for r in range(tp))
    assert held == tp * sum(whole[n].nbytes for n in replicated) + sum(whole[n].nbytes for n in split)
    assert held < 1.05 * sizing.rank_weights(FULL, 1, 1, 0).total  # little is replicated
    routed = {n for n, size in whole.items() if size.routed_expert}
    assert routed and routed <= split


@pytest.mark.parametrize("ep", [4, 1], ids=["by-expert", "by-tensor"])
def test_split_tensors_are_the_ones_the_checkpoint_table_splits(ep):
    """At full width (4 layers: KDA, DSA with its indexer, dense MLP, MoE; and the MTP layer), the
    tensors whose shapes differ across ranks are exactly those the checkpoint table
    (`hylo.parallel.sharding`, through `checkpoint_layout`) reads in parts or by expert."""
    tp, config = 4, ModelConfig.from_dict({"num_hidden_layers": 4})
    assert config.layer_types[3] != config.layer_types[0] and config.mlp_layer_types[3] == "sparse"
    split, _ = _split_and_replicated(config, tp, ep)
    parallel = Parallel(0, tp, ep, None)
    read_in_parts = set()
    for prefix, module in (
        ("", sizing.build_target(config, parallel)),
        ("mtp.", sizing.build_mtp(config, parallel)),
    ):
        fused = {
            f"{name}.{p}" for name, m in module.named_modules() if isinstance(m, FusedLinear) for p in FUSED
        }
        for key, slot in checkpoint_layout(module).items():
            if slot.shard is not None or (parallel.experts_by_expert and expert_of(key) is not None):
                # a FusedLinear's parts are sized by their checkpoint tensors (sizing.fused_part_sizes)
                read_in_parts.add(prefix + (key if slot.param in fused else slot.param))
    assert split == read_in_parts


# --- the collectives a forward makes ----------------------------------------------------------------

SMALL = ModelConfig.from_dict(
    dict(
        vocab_size=301, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=4, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=16, v_head_dim=16, index_topk=16,
        index_head_dim=16, index_n_heads=4, index_kpool=4, linear_head_dim=16, linear_num_heads=4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
        layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full"] * 4, hc_sinkhorn_iters=2,
    )
)  # fmt: skip


@pytest.fixture
def traced(monkeypatch):
    """Record every device collective a `Parallel` of 2 ranks would run (here: none runs; all_reduce
    returns its input, all_gather the input side by side with itself)."""
    calls = []

    def all_reduce(self, x):
        calls.append((sizing.ALL_REDUCE, x.numel() * x.element_size()))
        return x

    def all_gather(self, x):
        calls.append((sizing.ALL_GATHER, self.size * x.numel() * x.element_size()))
        return torch.cat([x] * self.size, dim=-1)

    monkeypatch.setattr(Parallel, "all_reduce", all_reduce)
    monkeypatch.setattr(Parallel, "all_gather", all_gather)
    return calls


def _planned(collectives):
    """The plan's collectives as sorted (kind, bytes) calls."""
    return sorted((c.kind, c.message_bytes) for c in collectives for _ in range(c.count))


def _model(module):
    randomize(module, torch.Generator().manual_seed(0))
    return module.eval()


@torch.inference_mode()
def test_collectives_are_the_planned_ones(traced):
    """A decode step of 3 sequences, a prefill chunk, an MTP observe, and a chained MTP draft step
    with its greedy argmax, on rank 0 of 2: the same collectives, in count and bytes, as the plan."""
    tp = 2
    parallel = Parallel(0, tp, tp, None)
    target = _model(Glm5NextForCausalLM(SMALL, parallel))
    layer = _model(MTPLayer(mtp_config(SMALL, "sparse"), False, False, parallel))
    plan = MemoryPlan(64, 16, 4, 256, 0, 0)
    caches = CacheManager(parallel.local_config(SMALL), plan, torch.float32, "cpu")
    for _ in range(4):
        slot = caches.acquire_slot()
        assert caches.grow(slot, [], 256)

    def forward(chunks):
        m = caches
        return target(ForwardBatch.build(chunks, m.table.table, m.tokens, m.states, m.kpool)).logits

    forward([SequenceChunk(list(range(2, 42)), 0, 0, 0)])  # prefill: 40 tokens, 1 logits row
    assert sorted(traced) == _planned(sizing.target_step(SMALL, tp, 40, 1, itemsize=4))
    traced.clear()
    forward([SequenceChunk([5], 40, 0, 0), SequenceChunk([6], 0, 1, 1), SequenceChunk([7], 0, 2, 2)])
    assert sorted(traced) == _planned(sizing.target_step(SMALL, tp, 3, 3, itemsize=4))

    cache = TokenCacheSpec(layer.config, torch.float32).allocate(caches.num_token_slots, "cpu")
    states = StateCache(layer.config, 0, torch.float32, "cpu")
    kpool = layer.config.index_kpool
    traced.clear()
    tokens = torch.tensor([3, 4, 5, 6, 7])
    batch = ForwardBatch.build(
        [SequenceChunk([0] * 5, 0, 0, 0, sample=False)], caches.table.table, cache, states, kpool
    )
    layer(layer.embedding(target)(tokens), torch.randn(5, SMALL.hidden_size), batch)
    assert sorted(traced) == _planned(sizing.mtp_observe(SMALL, 5, itemsize=4))
    traced.clear()
    rows = torch.tensor([0, 1])
    batch = ForwardBatch.uniform(torch.tensor([5, 0]), rows, 1, caches.table.table, cache, states, kpool)
    hidden = layer(layer.embedding(target)(torch.tensor([8, 9])), torch.randn(2, SMALL.hidden_size), batch)
    layer.greedy(hidden, target)
    assert sorted(traced) == _planned(sizing.mtp_draft_step(SMALL, tp, 2, itemsize=4))


def test_comm_model():
    """Ring bytes and NCCL's latency model on numbers worked by hand."""
    step = sizing.step_comm(sizing.target_step(FULL, 8, 1, 1), 8)
    assert step.collectives == 92  # 1 + 2 × 45 all-reduces, 1 all-gather
    ar = 91 * 2 * 7 / 8 * 4096 * 2
    ag = 7 / 8 * 154880 * 2
    assert step.sent_per_rank == pytest.approx(ar + ag)
    assert step.latency_us == pytest.approx(91 * (6.6 + 14 * 0.6) + (6.6 + 7 * 0.6))
    assert sizing.step_comm(sizing.target_step(FULL, 1, 1, 1), 1).collectives == 0
