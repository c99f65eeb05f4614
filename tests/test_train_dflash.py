"""DFlash / DFlash2 draft training: new configs in z-lab's layout, the training pass against the
inference forward, the loss learning a simple rule with only the draft changing, anchor sampling,
and the exported checkpoint."""

from __future__ import annotations

import pytest
import torch
from hf_reference import tiny_text_config
from safetensors import safe_open
from tolerance import assert_fp32_close, draft_accumulation_terms

from hylo.config import ModelConfig
from hylo.models.dflash import DFlashConfig, DFlashDraftModel
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.models.loader import load_flat
from hylo.models.random_init import randomize
from hylo.train.dflash import (
    DFlashObjective,
    block_targets,
    build_target_layer_ids,
    init_draft,
    new_draft_config,
    save_draft,
)

BLOCK, MASK = 4, 159
ALGORITHMS = ["dflash", "dflash2"]


@pytest.fixture(scope="module")
def target() -> Glm5NextForCausalLM:
    model = Glm5NextForCausalLM(ModelConfig.from_dict(tiny_text_config(4, 8)))
    randomize(model, torch.Generator().manual_seed(0))
    return model


def draft_config(target: Glm5NextForCausalLM, algorithm: str, **overrides) -> dict:
    """Two layers, the second a sliding window of 3 < B (it cuts the context and the block itself)."""
    options = dict(
        mask_token_id=MASK, block_size=BLOCK, num_layers=2, sliding_window=3, conv_kernel_size=3,
        selector_top_k=6, layer_types=["full_attention", "sliding_attention"],
    )  # fmt: skip
    return new_draft_config(target.config, algorithm, **(options | overrides))


def random_draft(config: dict, seed: int) -> DFlashDraftModel:
    """Weights far from the near-identity init, so every sublayer, conv and selector term matters."""
    draft = init_draft(config, seed)
    randomize(draft, torch.Generator().manual_seed(seed))
    return draft


def inference_hidden(
    draft: DFlashDraftModel, block: torch.Tensor, features: torch.Tensor, anchors: list[int]
) -> torch.Tensor:
    """`DFlashDraftModel.forward` of one block per anchor (embedded `block [R, B, H]`) over the
    features of the positions before it, padded to the longest context and masked by `ctx_valid`."""
    longest = max(anchors)
    padded = torch.zeros(len(anchors), longest, features.shape[-1])
    for r, a in enumerate(anchors):
        padded[r, :a] = features[r, :a]
    ctx_pos = torch.arange(longest).expand(len(anchors), -1)
    ctx_valid = ctx_pos < torch.tensor(anchors)[:, None]
    positions = torch.tensor(anchors)[:, None] + torch.arange(BLOCK)
    return draft(block, positions, draft.context_kv(padded, ctx_pos), ctx_pos, ctx_valid)


def test_new_draft_config_follows_z_lab_layout():
    qwen3_8b = ModelConfig.from_dict({"num_hidden_layers": 36, "hidden_size": 4096})
    config = new_draft_config(qwen3_8b, "dflash", mask_token_id=7, block_size=16, num_layers=5)
    # z-lab's Qwen3-8B-DFlash-b16: 5 layers reading [1, 9, 17, 25, 33], 32 heads / 8 KV heads of 128
    assert config["dflash_config"]["target_layer_ids"] == [1, 9, 17, 25, 33]
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (32, 8, 128)
    assert config["intermediate_size"] == 3 * 4096 and config["architectures"] == ["DFlashDraftModel"]
    assert build_target_layer_ids(45, 1) == [22]

    v2 = DFlashConfig.from_dict(new_draft_config(qwen3_8b, "dflash2", mask_token_id=7))
    assert v2.dflash2 is not None and v2.dflash2.vocab_size == qwen3_8b.vocab_size
    assert (v2.dflash2.conv_kernel_size, v2.dflash2.conv_group_size) == (4, 16)
    assert (v2.dflash2.selector_rank, v2.dflash2.selector_top_k) == (32, 8)
    chosen = new_draft_config(qwen3_8b, "dflash", mask_token_id=7, num_layers=2, target_layer_ids=[17, 35])
    assert chosen["dflash_config"]["target_layer_ids"] == [17, 35]
    with pytest.raises(ValueError, match=r"target_layer_ids \[1, 36\]"):
        new_draft_config(qwen3_8b, "dflash", mask_token_id=7, target_layer_ids=[1, 36])
    with pytest.raises(ValueError, match="outside the target vocabulary"):
        new_draft_config(qwen3_8b, "dflash", mask_token_id=qwen3_8b.vocab_size)
    with pytest.raises(ValueError, match="conv_kernel_size 4 exceeds block_size 2"):
        new_draft_config(qwen3_8b, "dflash2", mask_token_id=7, block_size=2)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_training_pass_equals_the_inference_forward(target, algorithm):
    """Blocks at the sequence start (no context), mid-sequence, and running past the end, all of a
    sequence in one pass: a block that saw its anchor's features, a later position or another
    block would differ from the inference forward by the order of the hidden states themselves."""
    config = draft_config(target, algorithm)
    config["dflash_config"]["input_embedding_scale"] = 1.3
    draft = random_draft(config, seed=1)
    objective = DFlashObjective(draft, target.embed_tokens, target.lm_head)
    gen = torch.Generator().manual_seed(2)
    length = 20
    tokens = torch.randint(0, MASK, (2, length), generator=gen)
    features = torch.randn(2, length, 2 * 64, generator=gen)
    anchors = torch.tensor([[0, 5, 11], [3, 17, 18]])
    with torch.no_grad():
        hidden = objective.hidden(tokens, features, anchors).flatten(0, 1)
        ids = torch.full((6, BLOCK), MASK)
        ids[:, 0] = tokens.gather(1, anchors).flatten()
        expected = inference_hidden(
            draft, target.embed_tokens(ids), features.repeat_interleave(3, 0), anchors.flatten().tolist()
        )
    assert_fp32_close(hidden, expected, draft_accumulation_terms(draft.config))


def successor_task(seqs: int, length: int, prompt: int, seed: int):
    """Token i+1 = token i + 1 (mod 150) from a random start: a draft can learn to read the anchor and
    count. Features are random but fixed; the first `prompt` positions are not trained on."""
    gen = torch.Generator().manual_seed(seed)
    starts = torch.randint(0, 150, (seqs, 1), generator=gen)
    tokens = (starts + torch.arange(length)) % 150
    features = torch.randn(seqs, length, 2 * 64, generator=gen)
    loss_mask = torch.arange(length).expand(seqs, -1) >= prompt
    return tokens, features, loss_mask


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_loss_decreases_and_only_the_draft_learns(target, algorithm):
    draft = init_draft(draft_config(target, algorithm), seed=3)
    objective = DFlashObjective(draft, target.embed_tokens, target.lm_head, num_anchors=16)
    frozen = [p.detach().clone() for p in (target.embed_tokens.weight, target.lm_head.weight)]
    optimizer = torch.optim.AdamW(objective.parameters(), lr=1e-2)
    tokens, features, loss_mask = successor_task(4, 32, prompt=6, seed=4)
    gen = torch.Generator().manual_seed(5)
    curve = []
    for step in range(30):
        loss, stats = objective.loss(tokens, features, loss_mask, gen)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            assert all(p.grad is not None for p in draft.parameters())
        optimizer.step()
        curve.append((loss.item(), stats["accepted"].item()))
    print(f"{algorithm} (loss, accepted) every 5 steps:", [(round(a, 3), round(b, 2)) for a, b in curve[::5]])
    assert curve[-1][0] < 0.5 * curve[0][0]
    assert curve[-1][1] > 1  # the proposals (the selector's path for DFlash2) now match in a block
    assert {id(p) for p in objective.parameters()} == {id(p) for p in draft.parameters()}
    for before, p in zip(frozen, (target.embed_tokens.weight, target.lm_head.weight), strict=True):
        assert p.grad is None and not p.requires_grad and torch.equal(p, before)


def test_anchors_and_targets_stay_inside_the_response(target):
    objective = DFlashObjective(init_draft(draft_config(target, "dflash"), seed=6), target.embed_tokens,
                                target.lm_head, num_anchors=5)  # fmt: skip
    gen = torch.Generator().manual_seed(7)
    length = 24
    loss_mask = torch.rand(3, length, generator=gen) < 0.4
    loss_mask[2] = False
    loss_mask[2, [3, 10]] = True  # two eligible anchors (2 and 9): fewer than num_anchors
    tokens = torch.randint(0, MASK, (3, length), generator=gen)
    for _ in range(20):
        anchors, keep = objective.sample_anchors(loss_mask, gen)
        for s in range(3):
            chosen = anchors[s][keep[s]].tolist()
            eligible = (loss_mask[s, 1:].nonzero()[:, 0]).tolist()
            assert len(set(chosen)) == len(chosen) == min(5, len(eligible))
            assert set(chosen) <= set(eligible)
        assert sorted(anchors[2][keep[2]].tolist()) == [2, 9]
        targets, valid = block_targets(tokens, loss_mask, anchors, keep, BLOCK)
        seq = torch.arange(3)[:, None, None].expand(-1, *valid.shape[1:])[valid]
        position = (anchors[..., None] + torch.arange(1, BLOCK))[valid]
        assert (position < length).all() and loss_mask[seq, position].all()
        assert torch.equal(targets[valid], tokens[seq, position])
        assert valid[..., 0][keep].all()  # a kept anchor's first target is always a response token
    with pytest.raises(ValueError, match="nothing to train on"):
        objective.sample_anchors(torch.zeros(2, length, dtype=torch.bool), gen)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_saved_draft_loads_and_proposes_the_same(tmp_path, target, algorithm):
    config = draft_config(target, algorithm)
    draft = random_draft(config, seed=8)
    save_draft(draft, config, tmp_path / "fp32")
    loaded = DFlashDraftModel(DFlashConfig.from_dir(tmp_path / "fp32"))
    load_flat(loaded, tmp_path / "fp32")
    assert loaded.config == draft.config

    gen = torch.Generator().manual_seed(9)
    features = torch.randn(3, 10, 2 * 64, generator=gen)
    ids = torch.full((3, BLOCK), MASK)
    ids[:, 0] = torch.tensor([4, 50, 120])
    with torch.no_grad():
        block = target.embed_tokens(ids)
        proposals = [
            model.propose(
                inference_hidden(model, block, features, [10, 6, 3])[:, 1:], ids[:, 0], target.lm_head
            )
            for model in (draft, loaded)
        ]
    assert torch.equal(*proposals)

    save_draft(draft, config, tmp_path / "bf16", dtype=torch.bfloat16)
    with safe_open(str(tmp_path / "bf16" / "model.safetensors"), framework="pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.bfloat16}  # noqa: SIM118
    load_flat(loaded, tmp_path / "bf16")
    other = draft_config(target, algorithm, num_layers=1, layer_types=["full_attention"])
    with pytest.raises(ValueError, match="does not describe this draft"):
        save_draft(draft, other, tmp_path / "wrong")
