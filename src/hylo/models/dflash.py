"""DFlash block-diffusion draft model (z-lab checkpoint format).

A stack of Qwen3-style layers with no embedding or head of its own: the block `[anchor, mask × (B−1)]`
is embedded with the target's embeddings, every layer attends (non-causally inside the block) to
the block and to the context, and the context is the committed tokens' target features after
`target_layer_ids`, fused by `fc` + `hidden_norm` and projected by each layer's k/v projections
(k_norm and RoPE at the token's absolute position). Proposals come from the target's `lm_head`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from hylo.layers.norm import RMSNorm

ARCHITECTURES = ("DFlashDraftModel",)


@dataclass(frozen=True)
class DFlashConfig:
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    rms_norm_eps: float
    rope_theta: float
    block_size: int
    mask_token_id: int
    target_layer_ids: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None

    @classmethod
    def from_dir(cls, path: str | Path) -> DFlashConfig:
        file = Path(path) / "config.json"
        if not file.is_file():
            raise FileNotFoundError(f"{file} not found: a DFlash draft directory needs a config.json")
        raw = json.loads(file.read_text())
        arch = (raw.get("architectures") or ["?"])[0]
        if arch not in ARCHITECTURES:
            raise ValueError(f"{file}: architecture {arch!r} is not a supported DFlash draft {ARCHITECTURES}")
        dflash = raw.get("dflash_config") or {}
        missing = [k for k in ("block_size", "mask_token_id", "target_layer_ids") if k not in dflash]
        if missing:
            raise ValueError(f"{file}: dflash_config lacks {', '.join(missing)}")
        n = raw["num_hidden_layers"]
        heads = raw["num_attention_heads"]
        rope = raw.get("rope_parameters") or {}
        return cls(
            hidden_size=raw["hidden_size"], num_hidden_layers=n, num_attention_heads=heads,
            num_key_value_heads=raw.get("num_key_value_heads", heads),
            head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
            intermediate_size=raw["intermediate_size"], rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta", raw.get("rope_theta", 1e6)),
            block_size=dflash["block_size"], mask_token_id=dflash["mask_token_id"],
            target_layer_ids=tuple(dflash["target_layer_ids"]),
            layer_types=tuple(raw.get("layer_types") or ["full_attention"] * n),
            sliding_window=raw.get("sliding_window"),
        )  # fmt: skip


def rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary embedding (rotate-half layout) of `x [..., heads, d]` at `positions [...]`."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, device=x.device, dtype=torch.float32) / d)
    angles = positions.float()[..., None] * inv_freq
    cos, sin = (torch.cat([f, f], -1)[..., None, :] for f in (angles.cos(), angles.sin()))
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x.float() * cos + rotated.float() * sin).to(x.dtype)


class DraftAttention(nn.Module):
    def __init__(self, c: DFlashConfig, sliding: bool):
        super().__init__()
        self.c, self.window = c, c.sliding_window if sliding else None
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)
        self.q_norm = RMSNorm(c.head_dim, c.rms_norm_eps)
        self.k_norm = RMSNorm(c.head_dim, c.rms_norm_eps)

    def key_value(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys (normed, rotated) and values of `x [..., H]` at `positions [...]`."""
        c = self.c
        k = self.k_norm(self.k_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim)))
        v = self.v_proj(x).unflatten(-1, (c.num_key_value_heads, c.head_dim))
        return rope(k, positions, c.rope_theta), v

    def forward(
        self, x: torch.Tensor, positions: torch.Tensor, ctx_k: torch.Tensor, ctx_v: torch.Tensor,
        ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Block `x [R, B, H]` at `positions [R, B]` over context keys `[R, L, kv, d]` (valid where
        `ctx_valid`) and the block's own keys, non-causally."""
        c = self.c
        q = rope(self.q_norm(self.q_proj(x).unflatten(-1, (c.num_attention_heads, c.head_dim))), positions,
                 c.rope_theta)  # fmt: skip
        k_blk, v_blk = self.key_value(x, positions)
        keys, values = torch.cat([ctx_k, k_blk], 1), torch.cat([ctx_v, v_blk], 1)
        key_pos = torch.cat([ctx_pos, positions], 1)
        allowed = torch.cat([ctx_valid, torch.ones_like(positions, dtype=torch.bool)], 1)[:, None, :]
        if self.window is not None:
            allowed = allowed & (key_pos[:, None, :] > positions[:, :, None] - self.window)
        group = c.num_attention_heads // c.num_key_value_heads
        keys, values = keys.repeat_interleave(group, 2), values.repeat_interleave(group, 2)
        scores = torch.einsum("rqhd,rkhd->rhqk", q.float(), keys.float()) * c.head_dim**-0.5
        scores = scores.masked_fill(~allowed[:, None], float("-inf"))
        out = torch.einsum("rhqk,rkhd->rqhd", scores.softmax(-1), values.float()).to(x.dtype)
        return self.o_proj(out.flatten(-2))


class DraftMLP(nn.Module):
    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftLayer(nn.Module):
    def __init__(self, c: DFlashConfig, index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.self_attn = DraftAttention(c, c.layer_types[index] == "sliding_attention")
        self.mlp = DraftMLP(c)


class DFlashDraftModel(nn.Module):
    """Parameter names are the checkpoint's tensor names."""

    def __init__(self, c: DFlashConfig):
        super().__init__()
        self.config = c
        self.fc = nn.Linear(len(c.target_layer_ids) * c.hidden_size, c.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.layers = nn.ModuleList(DraftLayer(c, i) for i in range(c.num_hidden_layers))
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def context_kv(
        self, features: torch.Tensor, positions: torch.Tensor
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer, the keys and values of committed tokens from their target features `[N, K·H]`."""
        ctx = self.hidden_norm(self.fc(features))
        return [layer.self_attn.key_value(ctx, positions) for layer in self.layers]

    def forward(
        self, block: torch.Tensor, positions: torch.Tensor, ctx_kv: list[tuple[torch.Tensor, torch.Tensor]],
        ctx_pos: torch.Tensor, ctx_valid: torch.Tensor,
    ) -> torch.Tensor:  # fmt: skip
        """Final hidden states `[R, B, H]` of the embedded blocks `[R, B, H]`."""
        x = block
        for layer, (k, v) in zip(self.layers, ctx_kv, strict=True):
            x = x + layer.self_attn(layer.input_layernorm(x), positions, k, v, ctx_pos, ctx_valid)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.norm(x)
