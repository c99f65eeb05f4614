"""Random DFlash draft checkpoints in the z-lab format, for tiny test targets."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file


def write_dflash_checkpoint(
    path: Path,
    hidden: int,
    vocab: int,
    target_layers: list[int],
    seed: int,
    block_size: int = 4,
    layers: int = 2,
) -> Path:
    heads, kv_heads, head_dim, inter = 4, 2, 16, 96
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inter, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": (["full_attention", "sliding_attention"] * layers)[:layers], "sliding_window": 6,
        "is_causal": False, "dflash_config": {"block_size": block_size, "mask_token_id": vocab - 1,
                                              "target_layer_ids": target_layers},
    }  # fmt: skip
    gen = torch.Generator().manual_seed(seed)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[-1] ** -0.5

    def norm(n: int) -> torch.Tensor:
        return 1 + 0.1 * torch.randn(n, generator=gen)

    tensors = {
        "fc.weight": w(hidden, len(target_layers) * hidden),
        "hidden_norm.weight": norm(hidden),
        "norm.weight": norm(hidden),
    }
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": norm(hidden), p + "post_attention_layernorm.weight": norm(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": norm(head_dim), p + "self_attn.k_norm.weight": norm(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }  # fmt: skip
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path
