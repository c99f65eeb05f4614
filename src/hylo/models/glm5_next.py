"""GLM-5.3-Flash (`glm5_next`) text model on hylo's ops: KDA + DSA layers, mHC residual streams, MoE."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import LINEAR, ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.layers.kda import KDAAttention
from hylo.layers.mhc import HyperConnection
from hylo.layers.mlp import MLP
from hylo.layers.moe import MoE
from hylo.layers.norm import RMSNorm
from hylo.layers.sparse_mla import SparseMLA
from hylo.ops.mhc import mhc_post


class DecoderLayer(nn.Module):
    """attention block and MLP block, each entered and left through its own hyper-connection."""

    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        self.is_linear = config.layer_types[layer_idx] == LINEAR
        self.self_attn: nn.Module = (
            KDAAttention(config, layer_idx) if self.is_linear else SparseMLA(config, layer_idx)
        )
        dense = config.mlp_layer_types[layer_idx] == "dense"
        self.mlp: nn.Module = (
            MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit) if dense else MoE(config)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self, streams: torch.Tensor, batch: ForwardBatch, rows: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Returns the new streams and the rows a following `shared` DSA layer reuses (None after KDA)."""
        post, comb, x = self.attn_hc.pre(streams)
        x = self.input_layernorm(x)
        if self.is_linear:
            out, rows = self.self_attn(x, batch), None
        else:
            out, rows = self.self_attn(x, batch, rows)
        streams = mhc_post(out, streams, post, comb)

        post, comb, x = self.ffn_hc.pre(streams)
        out = self.mlp(self.post_attention_layernorm(x))
        return mhc_post(out, streams, post, comb), rows


class Glm5NextForCausalLM(nn.Module):
    """The text model and its head. Caches are owned by the caller and reached through the batch."""

    def __init__(self, config: ModelConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Runs the batch's new tokens through every layer, updating the caches; returns the logits
        `[len(batch.logits_index), vocab]` (fp32) of the tokens the batch asks for."""
        x = self.embed_tokens(batch.input_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        rows = None
        for layer in self.layers:
            streams, rows = layer(streams, batch, rows)
        hidden = self.norm(streams[batch.logits_index].mean(dim=1))
        return self.lm_head(hidden).float()
