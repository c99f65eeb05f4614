"""Random DFlash / DFlash2 draft checkpoints in the z-lab format, for tiny test targets, and a plain
re-implementation of the DFlash2 draft written from the format description."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from hylo.ops.topk import top_k


def write_dflash_checkpoint(
    path: Path,
    hidden: int,
    vocab: int,
    target_layers: list[int],
    seed: int,
    block_size: int = 4,
    layers: int = 2,
    dflash2: dict | None = None,
) -> Path:
    """`dflash2`: the DFlash2 `dflash_config` additions; given, the checkpoint is a DFlash2 draft
    with random conv and selector tensors."""
    heads, kv_heads, head_dim, inter = 4, 2, 16, 96
    architecture = "DFlash2DraftModel" if dflash2 else "DFlashDraftModel"
    config = {
        "architectures": [architecture], "model_type": "qwen3", "hidden_size": hidden,
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
    if dflash2:
        config["dflash_config"] |= dflash2
        taps, groups, rank = (
            dflash2["conv_kernel_size"],
            hidden // dflash2["conv_group_size"],
            dflash2["selector_rank"],
        )
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                base = 0.4 * torch.randn(2, taps, hidden, generator=gen)
                base[:, 0] += 1  # tap 0 near identity keeps the signal; the other taps mix earlier rows
                tensors[f"layers.{i}.{conv}.base_kernel"] = base
                tensors[f"layers.{i}.{conv}.kernel_projection.weight"] = 0.5 * w(2 * taps * groups, hidden)
        tensors |= {
            "candidate_selector.hidden_projection.weight": w(rank, hidden),
            "candidate_selector.predecessor_codebook": torch.randn(vocab, rank, generator=gen),
            "candidate_selector.successor_codebook": torch.randn(vocab, rank, generator=gen),
        }
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


def _rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of `x [N, heads, d]` at `positions [N]`."""
    d = x.shape[-1]
    angles = positions[:, None].double() / theta ** (torch.arange(0, d, 2).double() / d)
    cos = torch.cat([angles.cos()] * 2, -1)[:, None].float()
    sin = torch.cat([angles.sin()] * 2, -1)[:, None].float()
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _grouped_conv(rows: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor, group: int) -> torch.Tensor:
    """row i <- sum over taps t <= i of (base[t, c] + deltas[i, t, c // group]) * row (i - t)[c], channel by
    channel: only rows of this block, nothing before its first row."""
    out = torch.zeros_like(rows)
    for i in range(rows.shape[0]):
        for t in range(min(base.shape[0], i + 1)):
            for c in range(rows.shape[1]):
                out[i, c] += (base[t, c] + deltas[i, t, c // group]) * rows[i - t, c]
    return out


def reference_dflash2(
    path: Path, features: torch.Tensor, block: torch.Tensor, anchor: int, lm_head: torch.Tensor
) -> tuple[torch.Tensor, list[int]]:
    """One request's DFlash2 draft, from the checkpoint's tensors: committed positions 0..N-1 with
    target `features [N, K·H]`, the embedded block `[B, H]` at positions N..N+B-1 after `anchor`.
    Returns the final hidden states `[B, H]` and the B-1 drafted tokens."""
    config = json.loads((path / "config.json").read_text())
    options = config["dflash_config"]
    t = load_file(str(path / "model.safetensors"))
    eps, theta = config["rms_norm_eps"], config["rope_parameters"]["rope_theta"]
    heads, kv_heads, d = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    group, taps = options["conv_group_size"], options["conv_kernel_size"]
    start, size = features.shape[0], block.shape[0]
    positions = torch.arange(start + size)
    context = _rms_norm(features @ t["fc.weight"].T, t["hidden_norm.weight"], eps)

    def around(prefix: str, h: torch.Tensor, sublayer) -> torch.Tensor:
        deltas = (h @ t[prefix + ".kernel_projection.weight"].T).view(size, 2, taps, -1)
        base = t[prefix + ".base_kernel"]
        inner = sublayer(_grouped_conv(h, base[0], deltas[:, 0], group))
        return _grouped_conv(inner, base[1], deltas[:, 1], group)

    x = block * options.get("input_embedding_scale", 1.0)
    for i in range(config["num_hidden_layers"]):
        p = f"layers.{i}."
        sliding = config["layer_types"][i] == "sliding_attention"

        def attention(h: torch.Tensor, p: str = p, sliding: bool = sliding) -> torch.Tensor:
            both = torch.cat([context, h])
            q = _rms_norm((h @ t[p + "self_attn.q_proj.weight"].T).view(size, heads, d),
                          t[p + "self_attn.q_norm.weight"], eps)  # fmt: skip
            k = _rms_norm((both @ t[p + "self_attn.k_proj.weight"].T).view(-1, kv_heads, d),
                          t[p + "self_attn.k_norm.weight"], eps)  # fmt: skip
            v = (both @ t[p + "self_attn.v_proj.weight"].T).view(-1, kv_heads, d)
            q, k = _rotate(q, positions[start:], theta), _rotate(k, positions, theta)
            out = torch.zeros(size, heads, d)
            for row in range(size):
                query_pos = start + row
                keys = [
                    j for j in range(start + size) if not sliding or j > query_pos - config["sliding_window"]
                ]
                for head in range(heads):
                    kv = head // (heads // kv_heads)
                    weights = (k[keys, kv] @ q[row, head] / d**0.5).softmax(0)
                    out[row, head] = weights @ v[keys, kv]
            return out.flatten(1) @ t[p + "self_attn.o_proj.weight"].T

        def mlp(h: torch.Tensor, p: str = p) -> torch.Tensor:
            gate, up = h @ t[p + "mlp.gate_proj.weight"].T, h @ t[p + "mlp.up_proj.weight"].T
            return (torch.nn.functional.silu(gate) * up) @ t[p + "mlp.down_proj.weight"].T

        x = x + around(p + "attention_conv", _rms_norm(x, t[p + "input_layernorm.weight"], eps), attention)
        x = x + around(p + "mlp_conv", _rms_norm(x, t[p + "post_attention_layernorm.weight"], eps), mlp)
    hidden = _rms_norm(x, t["norm.weight"], eps)

    logits = hidden[1:] @ lm_head.T * options.get("output_multiplier", 1.0)
    cap = options.get("final_logit_softcapping")
    if cap:
        logits = cap * torch.tanh(logits / cap)
    projected = hidden[1:] @ t["candidate_selector.hidden_projection.weight"].T
    predecessors, successors = (
        t["candidate_selector.predecessor_codebook"],
        t["candidate_selector.successor_codebook"],
    )
    drafts, previous = [], anchor
    for row in range(size - 1):
        candidates = logits[row].argsort(descending=True)[: options["selector_top_k"]].tolist()
        scores = [
            logits[row, c] + (predecessors[previous] * projected[row] * successors[c]).sum()
            for c in candidates
        ]
        previous = candidates[max(range(len(candidates)), key=lambda j: scores[j])]
        drafts.append(previous)
    return hidden, drafts


def per_tap_block_conv(x: torch.Tensor, base: torch.Tensor, deltas: torch.Tensor, group: int) -> torch.Tensor:
    """`GroupedBlockConv.convolve` one tap at a time (its form before the windowed contraction): blocks
    `x [R, B, H]`, kernel `base [taps, H]` + `deltas [R, B, taps, G]`; tap t adds row i − t, zeros
    before the block start."""
    rows = x.unflatten(-1, (-1, group))
    kernel = base.unflatten(-1, (-1, group)) + deltas[..., None]
    out = kernel[:, :, 0] * rows
    for tap in range(1, min(base.shape[0], x.shape[1])):
        earlier = torch.nn.functional.pad(rows[:, :-tap], (0, 0, 0, 0, tap, 0))
        out = out + kernel[:, :, tap] * earlier
    return out.flatten(-2)


def sequential_selector_path(
    selector, hidden: torch.Tensor, logits: torch.Tensor, anchors: torch.Tensor
) -> torch.Tensor:
    """`CandidateSelector.forward` walked row by row (its form before the batched scores): each row's
    pair scores against the token chosen in the row before, then its argmax."""
    unary, candidates = top_k(logits, selector.top_k)
    folded = (
        selector.successor_codebook[candidates].float()
        * selector.hidden_projection(hidden).float()[:, :, None]
    )
    previous, path = anchors, []
    for row in range(hidden.shape[1]):
        pair = torch.einsum("rkd,rd->rk", folded[:, row], selector.predecessor_codebook[previous].float())
        choice = (unary[:, row] + pair).argmax(-1, keepdim=True)
        previous = candidates[:, row].gather(-1, choice)[:, 0]
        path.append(previous)
    return torch.stack(path, 1)
