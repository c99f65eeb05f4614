"""GLM-5.3-Flash (`glm5_next`) text model on hylo's ops: KDA + DSA layers, mHC residual streams, MoE."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from hylo.config import LINEAR, ModelConfig
from hylo.forward_batch import ForwardBatch, SequenceChunk
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
        if self.is_linear and batch.verify_seqs:
            out, rows = self._verify_linear(x, batch), None
        elif self.is_linear:
            out, rows = self.self_attn(x, batch), None
        else:
            out, rows = self.self_attn(x, batch, rows)
        streams = mhc_post(out, streams, post, comb)

        post, comb, x = self.ffn_hc.pre(streams)
        out = self.mlp(self.post_attention_layernorm(x))
        return mhc_post(out, streams, post, comb), rows

    def _verify_linear(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """KDA over a batch with verify chunks: their slots' conv windows and states are put back as
        they were, and the layer input is kept so `commit` can replay the accepted prefix."""
        states, layer = batch.states, batch.states.kda_index[self.self_attn.layer_idx]
        slots = batch.state_slots[batch.verify_seqs]
        saved = states.conv[layer, slots].clone(), states.recurrent[layer, slots].clone()
        out = self.self_attn(x, batch)
        states.conv[layer, slots], states.recurrent[layer, slots] = saved
        batch.kda_records[self.self_attn.layer_idx] = x
        return out


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
    def forward(self, batch: ForwardBatch, capture_layers: Sequence[int] = ()) -> torch.Tensor:
        """Runs the batch's new tokens through every layer, updating the caches; returns the logits
        `[len(batch.logits_index), vocab]` (fp32) of the tokens the batch asks for. With
        `capture_layers`, `batch.features` receives, for every token, the mean of the residual
        streams after each of those layers, concatenated (`[T, len(capture_layers)·hidden]`)."""
        x = self.embed_tokens(batch.input_ids)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        rows = None
        captured = []
        for i, layer in enumerate(self.layers):
            streams, rows = layer(streams, batch, rows)
            if i in capture_layers:
                captured.append(streams.mean(dim=1))
        if capture_layers:
            batch.features = torch.cat(captured, dim=-1)
        hidden = self.norm(streams[batch.logits_index].mean(dim=1))
        return self.lm_head(hidden).float()

    @torch.inference_mode()
    def commit(self, batch: ForwardBatch, lengths: Sequence[int]) -> None:
        """After a forward with verify chunks: advance each verify chunk's KDA state and conv window
        by its first `lengths[j]` tokens (the anchor and the accepted drafts), replaying every KDA
        layer on the inputs the forward kept. Attention caches need nothing: what lies past a
        sequence's committed length is never read and is overwritten later."""
        if not batch.verify_seqs:
            return
        starts = [sum(batch.extend_lens[:b]) for b in batch.verify_seqs]
        chunks = [
            SequenceChunk([0] * n, batch.prefix_lens[b], batch.seq_rows[b], batch.seq_slots[b], sample=False)
            for b, n in zip(batch.verify_seqs, lengths, strict=True)
        ]
        replay = ForwardBatch.build(
            chunks, batch.req_to_token, batch.tokens, batch.states, self.config.index_kpool
        )
        picked = torch.tensor(
            [s + t for s, n in zip(starts, lengths, strict=True) for t in range(n)],
            device=batch.input_ids.device,
        )
        for layer in self.layers:
            if layer.is_linear:
                layer.self_attn(batch.kda_records[layer.self_attn.layer_idx][picked], replay)
