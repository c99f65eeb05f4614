"""Tiny random `glm5_next` checkpoints written by `transformers` 5.23 (the reference implementation)."""

from __future__ import annotations

from pathlib import Path

import torch

LAYER_MIXES = {
    # 6 layers: KDA and DSA interleaved, a shared indexer layer directly after a full one.
    "shared": dict(
        layer_types=[
            "linear_attention",
            "indexed_attention",
            "indexed_attention",
            "linear_attention",
            "linear_attention",
            "indexed_attention",
        ],
        indexer_types=["full", "full", "shared", "full", "full", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"],
    ),
    "default": dict(
        layer_types=["linear_attention", "linear_attention", "linear_attention", "indexed_attention"],
        indexer_types=["full"] * 4,
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
    # 4 layers with every kind "shared" has (KDA, DSA with a full indexer, DSA reusing it through a
    # shared indexer; dense and MoE MLPs) and two KDA layers, whose state slots the engine resets and
    # copies for every KDA layer at once (a fault that touched only the first passes one KDA layer):
    # for engine tests whose time is in the forwards
    "each-kind": dict(
        layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
        indexer_types=["full", "full", "shared", "full"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
    ),
}


def tiny_text_config(kpool: int, topk: int, mix: str = "shared", **overrides) -> dict:
    """16 indexer heads: with few heads every head's ReLU score is often exactly 0, and HF breaks such
    ties however `torch.topk` happens to (hylo prefers the earlier pool)."""
    config = dict(
        vocab_size=160,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=len(LAYER_MIXES[mix]["layer_types"]),
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=2,
        topk_group=1,
        kv_lora_rank=32,
        q_lora_rank=48,
        qk_nope_head_dim=16,
        v_head_dim=16,
        index_topk=topk,
        index_head_dim=16,
        index_n_heads=16,
        linear_head_dim=16,
        linear_num_heads=4,
        index_kpool=kpool,
        pad_token_id=0,
        **LAYER_MIXES[mix],
    )
    config.update(overrides)
    return config


def write_hf_checkpoint(path: Path, text_config: dict, seed: int, gain: float = 1.0) -> Path:
    """Build the HF model with random weights (every tensor perturbed, none left at its init constant)
    and `save_pretrained` it to `path`. Projection matrices get std `gain`/sqrt(fan_in); a gain below 1
    gives a tamer network whose logits move smoothly with its weights."""
    from transformers import Glm5NextConfig, Glm5NextForConditionalGeneration

    torch.manual_seed(seed)
    vision = dict(
        depth=1,
        hidden_size=32,
        num_heads=2,
        intermediate_size=32,
        out_hidden_size=text_config["hidden_size"],
        projection_intermediate_size=32,
    )
    model = Glm5NextForConditionalGeneration(Glm5NextConfig(text_config=text_config, vision_config=vision))
    with torch.no_grad():
        for name, p in list(model.named_parameters()) + list(model.named_buffers()):
            if name.endswith(("norm.weight", "layernorm.weight", "o_norm.weight", "k_norm.weight")):
                p.copy_(1 + 0.2 * torch.randn_like(p))
            elif name.endswith(("attn_hc.scale", "ffn_hc.scale")):
                p.copy_(1 + 0.5 * torch.randn_like(p))
            elif name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif name.endswith(("dt_bias", "e_score_correction_bias", "base", "k_norm.bias")):
                p.copy_(0.5 * torch.randn_like(p))
            elif name.endswith("index_kpool_compress_ape"):
                p.copy_(torch.randn_like(p))
            elif name.endswith("index_kpool_compress_gate"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name.endswith(("embed_tokens.weight",)):
                p.copy_(torch.randn_like(p))
            elif p.dim() >= 2:
                p.copy_(torch.randn_like(p) * gain * p.shape[-1] ** -0.5)
    model.eval().save_pretrained(path)
    return path


def hf_model(path: Path):
    from transformers import Glm5NextForConditionalGeneration

    return Glm5NextForConditionalGeneration.from_pretrained(path, dtype=torch.float32).eval()
