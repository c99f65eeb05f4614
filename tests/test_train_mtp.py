"""MTP training: the training forward is hylo's inference function (logits of every step after export
and `load_mtp_layer`, on sequences several times longer than the indexer's top-k), its selection is
`select_rows`', the loss trains the MTP layer alone, and the export round-trips next to the target."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import Caches, random_prompt
from hf_reference import tiny_text_config, write_hf_checkpoint
from safetensors import safe_open
from safetensors.torch import save_file
from tolerance import assert_fp32_close

from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.layers.linear import unfused_state_dict
from hylo.layers.moe import FP8Experts
from hylo.memory.specs import TokenCacheSpec
from hylo.memory.state import StateCache
from hylo.models.loader import CheckpointError, dequantize_fp8, load_model, load_mtp_layer
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.indexer.reference import select_rows
from hylo.train.mtp import (
    INDEX_FILE,
    MTP_FILE,
    MTPObjective,
    export_mtp_layer,
    init_mtp_layer,
    select_entries,
)

# a query sees 2 pools and its tail of up to 3: at most 11 of the 39 entries of a 40-token sequence
KPOOL, TOPK = 4, 8
LAYERS = 6
VOCAB = 160
MTP_PREFIX = f"model.language_model.layers.{LAYERS}."


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Every tensor here is tiny: a second intra-op thread only adds synchronisation (on a loaded
    2-core machine it makes this file several times slower)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory) -> Path:
    """A tiny 6-layer glm5_next target (last layer DSA with its own indexer and an MoE), no MTP layer."""
    path = tmp_path_factory.mktemp("target")
    return write_hf_checkpoint(path, tiny_text_config(KPOOL, TOPK), seed=5, gain=0.7)


@pytest.fixture(scope="module")
def target(target_dir):
    return load_model(target_dir, dtype=torch.float32, progress=False)


@pytest.fixture
def checkpoint(target_dir, tmp_path) -> Path:
    """A copy of the target's directory to export into."""
    return Path(shutil.copytree(target_dir, tmp_path / "target"))


def perturbed_layer(target, seed: int):
    """An initialised MTP layer with every tensor moved off its initialisation (so that no two tensors
    are equal and a swapped name would show)."""
    layer = init_mtp_layer(target, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for t in list(layer.parameters()) + list(layer.buffers()):
            t.add_(0.1 * t.abs().mean().clamp(min=0.1) * torch.randn(t.shape, generator=gen))
    return layer


def target_hiddens(target, sequences: list[list[int]]) -> list[torch.Tensor]:
    """Per sequence `[len, H]`: the mean of the last target layer's streams for every token, captured
    by hylo's forward (the sequences prefilled together)."""
    caches = Caches(target, num_seqs=len(sequences), per_seq=64)
    m = caches.manager
    chunks = [caches.chunk(i, s, 0) for i, s in enumerate(sequences)]
    batch = ForwardBatch.build(chunks, m.table.table, m.tokens, m.states, m.kpool)
    features = target(batch, capture_layers=(LAYERS - 1,)).features
    return list(features.split([len(s) for s in sequences]))


@torch.inference_mode()
def inference_logits(
    layer, target, tokens: list[int], hidden: torch.Tensor, steps: int
) -> list[torch.Tensor]:
    """hylo's MTP inference for every base i of one sequence: request row i observes the step-1
    entries 0 .. i, then drafts steps 2 .. `steps` (at positions i+1, ..) from its own MTP hiddens with
    the true tokens. Step j's logits `[bases, vocab]` for the bases whose input token exists."""
    n = len(tokens) - 1
    caches = Caches(target, num_seqs=n, per_seq=64)
    m = caches.manager
    cache = TokenCacheSpec(layer.config, torch.float32).allocate(m.num_token_slots, "cpu")
    states = StateCache(layer.config, 0, torch.float32, "cpu")
    ids = torch.tensor(tokens)

    def forward(chunks, token_ids, hiddens):
        batch = ForwardBatch.build(chunks, m.table.table, cache, states, layer.config.index_kpool)
        return layer(layer.embedding(target)(token_ids), hiddens, batch)

    chunks = [SequenceChunk([0] * (i + 1), 0, i, i, sample=False) for i in range(n)]
    out = forward(
        chunks, torch.cat([ids[1 : i + 2] for i in range(n)]), torch.cat([hidden[: i + 1] for i in range(n)])
    )
    g = out[torch.arange(1, n + 1).cumsum(0) - 1]  # row i's entry at position i
    logits = [layer.logits(g, target)]
    for j in range(2, steps + 1):
        bases = range(n - j + 1)  # token i+j exists
        chunks = [SequenceChunk([0], i + j - 1, i, i, sample=False) for i in bases]
        g = forward(chunks, ids[[i + j for i in bases]], g[: len(bases)])
        logits.append(layer.logits(g, target))
    return logits


@pytest.mark.parametrize(("kpool", "topk"), [(KPOOL, TOPK), (1, 2)])
def test_training_logits_equal_hylo_inference_after_export(tmp_path, kpool, topk):
    """Step 1, 2 and 3 logits of a right-padded batch of two sequences (40 and 27 tokens, so that most
    queries see a fraction of their entries, and chained k-pools complete on chain entries: with kpool
    1, two per step-3 query) equal hylo's inference of the exported layer, sequence by sequence."""
    checkpoint = write_hf_checkpoint(tmp_path, tiny_text_config(kpool, topk), seed=5, gain=0.7)
    target = load_model(checkpoint, dtype=torch.float32, progress=False)
    layer = perturbed_layer(target, seed=1)
    export_mtp_layer(layer, checkpoint)
    served = load_mtp_layer(checkpoint, target, progress=False)
    sequences = [random_prompt(40, VOCAB, seed=11), random_prompt(27, VOCAB, seed=12)]
    hiddens = target_hiddens(target, sequences)
    tokens = torch.zeros(2, 40, dtype=torch.long)
    hidden = torch.zeros(2, 40, target.config.hidden_size)
    for row, (s, h) in enumerate(zip(sequences, hiddens, strict=True)):
        tokens[row, : len(s)], hidden[row, : len(s)] = torch.tensor(s), h
    objective = MTPObjective(layer, target)
    with torch.no_grad():
        trained = [objective.logits(g) for g in objective.hiddens(tokens, hidden, steps=3)]
    terms = 3 * (target.config.hidden_size + target.config.intermediate_size)
    for row, (s, h) in enumerate(zip(sequences, hiddens, strict=True)):
        for j, expected in enumerate(inference_logits(served, target, s, h, steps=3), start=1):
            actual = trained[j - 1][row, : len(expected)]
            assert_fp32_close(actual, expected, terms, f"sequence {row} step {j}")


def test_step_one_selection_is_select_rows():
    """On a 64-entry sequence with ties (few index heads: many scores ReLU to exactly 0), step 1 selects
    what `select_rows` selects, for kpool 1, 4 and 16."""
    gen = torch.Generator().manual_seed(3)
    n, heads, d = 64, 2, 8
    for kpool, topk in ((1, 5), (4, 16), (16, 32)):
        q = torch.randn(1, n, heads, d, generator=gen)
        weights = torch.randn(1, n, heads, generator=gen).abs()
        keys, gates = torch.randn(1, n, d, generator=gen), torch.randn(1, n, d, generator=gen)
        ape = torch.randn(kpool, d, generator=gen)
        empty = keys.new_zeros(1, n, 0, d)
        mask, _ = select_entries(q, weights, keys, gates, empty, empty, ape, topk, tail=True)
        pools = n // kpool
        pooled = torch.softmax(gates[0, : pools * kpool].view(pools, kpool, d) + ape, dim=1)
        pooled = (pooled * keys[0, : pools * kpool].view(pools, kpool, d)).sum(1)
        rows = select_rows(
            q, weights, pooled, torch.arange(pools)[None], torch.arange(n)[None], kpool, topk, True
        )
        expected = torch.zeros(1, n, n + 1, dtype=torch.bool).scatter_(
            -1, rows.masked_fill(rows < 0, n), True
        )
        assert torch.equal(mask, expected[..., :n]), kpool
        assert mask.sum(-1).max() <= topk + kpool - 1 and not mask.triu(1).any()


def copy_task(count: int, length: int, seed: int) -> torch.Tensor:
    """Sequences where each token follows from the one before it (t' = 7t + 3 mod 160): the token two
    ahead of an entry follows from the entry's own token, so the MTP layer can learn it."""
    start = torch.randint(VOCAB, (count, 1), generator=torch.Generator().manual_seed(seed))
    tokens = [start]
    for _ in range(length - 1):
        tokens.append((tokens[-1] * 7 + 3) % VOCAB)
    return torch.cat(tokens, dim=1)


def test_loss_decreases_and_only_the_mtp_layer_trains(target):
    """30 AdamW steps of the 2-step loss on the synthetic task: the loss falls to under half, every
    trainable tensor of the layer moves, the frozen indexer and the target stay as they were and
    never get a gradient."""
    layer = init_mtp_layer(target, seed=0)
    objective = MTPObjective(layer, target)
    tokens = copy_task(4, 16, seed=0)
    hidden = torch.stack(target_hiddens(target, tokens.tolist()))
    mask = torch.ones_like(tokens, dtype=torch.bool)
    mask[:, :4] = False  # a prompt
    before_target = {k: v.clone() for k, v in target.state_dict().items()}
    before_layer = {k: v.clone() for k, v in layer.state_dict().items()}
    trainable = [p for p in layer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    losses = []
    for _ in range(30):
        loss, stats = objective.loss(tokens, hidden, mask, steps=2)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses
    assert stats["mtp_tokens_1"] == stats["mtp_tokens_2"] == 4 * 12
    assert all(p.grad is None for p in target.parameters())
    assert all(torch.equal(v, before_target[k]) for k, v in target.state_dict().items())
    for name, value in layer.state_dict().items():
        frozen = ".indexer." in name or name.endswith("e_score_correction_bias")
        assert torch.equal(value, before_layer[name]) == frozen, name


def test_init_copies_the_targets_last_layers(target):
    layer = init_mtp_layer(target, seed=0)
    dec, last = layer.decoder, target.layers[-1]
    assert target.config.indexer_layers[-1] == LAYERS - 1
    for name, value in unfused_state_dict(last).items():  # (hylo fuses projections of one input)
        assert torch.equal(dec.state_dict()[name], value), name
    assert torch.equal(layer.shared_head.norm.weight, target.norm.weight)
    assert not any(p.requires_grad for p in dec.self_attn.indexer.parameters())
    assert torch.equal(layer.eh_proj.weight, init_mtp_layer(target, seed=0).eh_proj.weight)
    assert not torch.equal(layer.eh_proj.weight, init_mtp_layer(target, seed=1).eh_proj.weight)


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118


def test_export_round_trips_and_the_target_still_loads(target, checkpoint):
    """Without an index: `mtp.safetensors` beside the target's file, `load_mtp_layer` gives back every
    tensor, the target loads as before. With one: the names are added to its weight map (replaced on
    a second export), total_size follows. A directory whose own files hold an MTP layer is refused."""
    layer = perturbed_layer(target, seed=2)
    path = export_mtp_layer(layer, checkpoint)
    assert path == checkpoint / MTP_FILE and all(k.startswith(MTP_PREFIX) for k in tensors_of(path))
    served = load_mtp_layer(checkpoint, target, progress=False)
    assert served.embed_tokens is None and served.shared_head.head is None
    trained = layer.state_dict()
    for name, value in unfused_state_dict(served).items():
        assert torch.equal(value, trained[name]), name
    reloaded = load_model(checkpoint, dtype=torch.float32, progress=False)
    for (name, a), b in zip(target.state_dict().items(), reloaded.state_dict().values(), strict=True):
        assert torch.equal(a, b), name

    weights = tensors_of(checkpoint / "model.safetensors")
    size = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": size}, "weight_map": dict.fromkeys(weights, "model.safetensors")}
    (checkpoint / INDEX_FILE).write_text(json.dumps(index))
    export_mtp_layer(layer, checkpoint, dtype=torch.bfloat16)
    export_mtp_layer(layer, checkpoint)  # a second export replaces the first's entries
    written = json.loads((checkpoint / INDEX_FILE).read_text())
    mtp = {k for k, v in written["weight_map"].items() if v == MTP_FILE}
    assert mtp == set(tensors_of(path)) and len(written["weight_map"]) == len(weights) + len(mtp)
    exported = sum(t.numel() * t.element_size() for t in tensors_of(path).values())
    assert written["metadata"]["total_size"] == size + exported
    assert torch.equal(
        load_mtp_layer(checkpoint, target, progress=False).eh_proj.weight, layer.eh_proj.weight
    )
    load_model(checkpoint, dtype=torch.float32, progress=False)

    save_file({MTP_PREFIX + "enorm.weight": torch.ones(64)}, str(checkpoint / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"extra\.safetensors already holds an MTP layer"):
        export_mtp_layer(layer, checkpoint)


def test_export_in_bf16_and_fp8(target, checkpoint):
    """`dtype` casts the parameters but the hyper-connections' fp32 base and scale and the buffers;
    `fp8` stores the projections block-scaled, which the loader dequantises for an unquantised target."""
    layer = perturbed_layer(target, seed=4)
    path = export_mtp_layer(layer, checkpoint, dtype=torch.bfloat16)
    tensors = tensors_of(path)
    assert tensors[MTP_PREFIX + "eh_proj.weight"].dtype == torch.bfloat16
    assert tensors[MTP_PREFIX + "hc_attn_base"].dtype == torch.float32
    assert tensors[MTP_PREFIX + "mlp.gate.e_score_correction_bias"].dtype == torch.float32
    export_mtp_layer(layer, checkpoint, fp8=True)
    tensors = tensors_of(path)
    assert tensors[MTP_PREFIX + "mlp.experts.3.gate_proj.weight"].dtype == torch.float8_e4m3fn
    served = load_mtp_layer(checkpoint, target, progress=False)
    expected = dequantize_fp8(*quantize_fp8_blocks(layer.eh_proj.weight.detach()), torch.float32)
    assert torch.equal(served.eh_proj.weight, expected)


def test_init_dequantises_fp8_experts(tmp_path):
    """A target whose routed experts stay FP8 gives its MTP layer their dequantised weights."""
    text = {"model_type": "glm5_next_text", **tiny_text_config(KPOOL, TOPK, moe_intermediate_size=128)}
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "glm5_next", "text_config": text}))
    target = load_model(tmp_path, dtype=torch.float32, progress=False, fp8_experts=True, random_weights=True)
    experts = target.layers[-1].mlp.experts
    assert isinstance(experts, FP8Experts)
    layer = init_mtp_layer(target, seed=0)
    expected = dequantize_fp8(experts.gate_up_proj[2], experts.gate_up_proj_scale_inv[2], torch.float32)
    assert torch.equal(layer.decoder.mlp.experts.gate_up_proj[2], expected)
