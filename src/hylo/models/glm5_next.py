"""GLM-5.3-Flash (`glm5_next`) text model on hylo's ops: KDA + DSA layers, mHC residual streams, MoE."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

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
from hylo.layers.vocab import VocabEmbedding, VocabHead
from hylo.ops.kda import VerifyCache, chunked_prefill_refusal
from hylo.ops.mhc import BlockNorm, PendingPost, mhc_post_mean, streams_refusal
from hylo.ops.norm import width_refusal
from hylo.ops.sparse_mla import rank_refusal
from hylo.parallel.layout import SINGLE, Parallel, TokenShards


class LayerOutput(NamedTuple):
    """What a decoder layer hands the next: the streams, the rows a following `shared` DSA layer
    reuses (None after KDA), the MLP's post, left pending so that it runs fused with the next
    hyper-connection's pre, and a KDA layer's verify record (`KDAAttention.forward`; None elsewhere
    and in a batch without verify chunks)."""

    streams: torch.Tensor
    rows: torch.Tensor | None
    pending: PendingPost
    kda_record: VerifyCache | None


@dataclass
class ForwardOutput:
    """What one forward of the target returns (`Glm5NextForCausalLM.forward`).

    Invariants: `logits [len(batch.logits_index), vocab]` (fp32) are the tokens the batch asks for;
    `features [T, len(capture_layers)·hidden]` hold, for every packed token, the mean of the residual
    streams after each captured layer, concatenated (None when the forward captured none);
    `kda_records` maps each KDA layer's index to what its verify kept for `commit` (empty without
    verify chunks)."""

    logits: torch.Tensor
    features: torch.Tensor | None = None
    kda_records: dict[int, VerifyCache] = field(default_factory=dict)


class DecoderLayer(nn.Module):
    """attention block and MLP block, each entered and left through its own hyper-connection."""

    def __init__(self, config: ModelConfig, layer_idx: int, parallel: Parallel = SINGLE):
        super().__init__()
        self.parallel = parallel
        self.is_linear = config.layer_types[layer_idx] == LINEAR
        attention = KDAAttention if self.is_linear else SparseMLA
        self.self_attn: nn.Module = attention(config, layer_idx, parallel)
        dense = config.mlp_layer_types[layer_idx] == "dense"
        self.mlp: nn.Module = (
            MLP(config.hidden_size, config.intermediate_size, config.swiglu_limit, parallel)
            if dense
            else MoE(config, parallel)
        )
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attn_hc = HyperConnection(config)
        self.ffn_hc = HyperConnection(config)

    def forward(
        self,
        streams: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None,
        pending: PendingPost | None = None,
        shards: TokenShards | None = None,
    ) -> LayerOutput:
        """The layer's streams, rows, pending post and KDA record (`LayerOutput`). `pending` is the
        previous layer's, still to be applied to `streams`. Each block returns this rank's partial sum,
        completed here: all-reduced, or with `shards` (the streams hold this rank's tokens alone,
        `Parallel.token_shards`) reduce-scattered by token, the block's input gathered whole first."""
        streams, post, comb, x = self.attn_hc.enter(streams, pending, _block_norm(self.input_layernorm))
        x = self.parallel.whole(x, shards)
        record = None
        if self.is_linear:
            (out, record), rows = self.self_attn(x, batch), None
        else:
            out, rows = self.self_attn(x, batch, rows, shards)
        entry = self.ffn_hc.enter(
            streams,
            PendingPost(self.parallel.complete(out, shards), post, comb),
            _block_norm(self.post_attention_layernorm),
        )
        out = self.parallel.complete(self.mlp(self.parallel.whole(entry.block_input, shards)), shards)
        return LayerOutput(entry.streams, rows, PendingPost(out, entry.post, entry.comb), record)


def _block_norm(norm: RMSNorm) -> BlockNorm:
    """`norm` as the hyper-connection applies it to the block input it collapses."""
    return BlockNorm(norm.weight, norm.eps)


class Glm5NextForCausalLM(nn.Module):
    """The text model and its head. Caches are owned by the caller and reached through the batch.
    `parallel`: this rank's share under tensor parallelism (`hylo.parallel.layout`); `config` stays the
    whole model's."""

    def __init__(self, config: ModelConfig, parallel: Parallel = SINGLE):
        super().__init__()
        self.config, self.parallel = config, parallel
        self.embed_tokens = VocabEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, parallel) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = VocabHead(config.hidden_size, config.vocab_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, capture_layers: Sequence[int] = ()) -> ForwardOutput:
        """Runs the batch's new tokens through every layer, updating the caches; returns the logits
        of the tokens the batch asks for, the features of `capture_layers` and what the KDA layers'
        verify kept (`ForwardOutput`)."""
        # a large step keeps each rank's share of the tokens' streams (sequence parallelism)
        shards = self.parallel.token_shards(batch.input_ids.shape[0])
        streams = self.embed_tokens.streams(batch.input_ids, self.config.hc_mult, shards)
        rows, pending = None, None
        captured, records = [], {}
        last = len(self.layers) - 1
        # the last layer's mean of the logits' tokens alone, unless its features are captured (all tokens)
        logits_rows = None if last in capture_layers else batch.logits_index
        for i, layer in enumerate(self.layers):
            streams, rows, pending, record = layer(streams, batch, rows, pending, shards)
            if record is not None:
                records[i] = record
            if i == last and shards is not None and logits_rows is not None:
                mean = self._sharded_rows_mean(pending, streams, logits_rows, shards)
            elif i == last:  # only the streams' mean is read after the last layer
                mean = mhc_post_mean(pending.out, streams, pending.post, pending.comb, logits_rows)
                mean = self.parallel.whole(mean, shards)
            elif i in capture_layers:  # the new streams' mean; the next layer's entry still applies the post
                mean = mhc_post_mean(pending.out, streams, pending.post, pending.comb)
                mean = self.parallel.whole(mean, shards)
            if i in capture_layers:
                captured.append(mean)
        features = None
        if capture_layers:
            features = captured[0] if len(captured) == 1 else torch.cat(captured, dim=-1)
        hidden = self.norm(mean if logits_rows is not None else mean[batch.logits_index])
        return ForwardOutput(self.lm_head(hidden).float(), features, records)

    def _sharded_rows_mean(
        self, pending: PendingPost, streams: torch.Tensor, rows: torch.Tensor, shards: TokenShards
    ) -> torch.Tensor:
        """The new streams' mean at the tokens `rows [R]` where each rank holds its share of the tokens:
        each rank takes the rows it holds, zeros for the others', and an all-reduce of `[R, D]` adds them
        (each row is nonzero on one rank: the sum is that row exactly, on every rank) instead of
        gathering every token's mean."""
        local = rows - shards.rank * shards.local
        mine = (local >= 0) & (local < shards.local)
        local = local.clamp(0, shards.local - 1)
        mean = mhc_post_mean(pending.out, streams, pending.post, pending.comb, local)
        return self.parallel.all_reduce(mean.masked_fill(~mine[:, None], 0))

    @torch.inference_mode()
    def commit(self, batch: ForwardBatch, records: dict[int, VerifyCache], lengths: torch.Tensor) -> None:
        """After a forward of `batch` with verify chunks, whose KDA layers kept `records`
        (`ForwardOutput.kda_records`): advance each verify chunk's KDA state and conv window by its
        first `lengths[j]` tokens (int32, device: the anchor and the accepted drafts), one commit launch
        per KDA layer. Attention caches need nothing: what lies past a sequence's committed length is
        never read and is overwritten later."""
        if not batch.verify_seqs:
            return
        for i, layer in enumerate(self.layers):
            if layer.is_linear:
                layer.self_attn.commit(batch, records[i], lengths)


def model_refusals(config: ModelConfig) -> dict[str, str]:
    """The kernels that would refuse every call of a model of `config`, by op, with why (each op
    family's verifier asked about the figure of the model it checks): its layers then run the torch
    reference on the GPU too (the engine warns at start-up)."""
    found = {
        "mhc": streams_refusal(config.hc_mult),
        "sparse_mla": rank_refusal(config.kv_lora_rank),
        "kda.prefill": chunked_prefill_refusal(config.linear_lower_bound),
        "norm.rms_norm": width_refusal(config.hidden_size),
    }
    return {op: reason for op, reason in found.items() if reason is not None}
