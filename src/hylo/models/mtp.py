"""GLM-5.3-Flash's multi-token-prediction (MTP, next-n) layer, DeepSeek-V3 style.

The checkpoint stores it after the target's layers, at `layers.{num_hidden_layers}.*` (any prefix the
target loader accepts). One MTP forward turns a target hidden `h` and the embedding `e` of the token
that follows it into a prediction of the token after that:

    x      = eh_proj(cat[enorm(e), hnorm(h)])                      (Linear 2H -> H, no bias)
    s      = x copied into hc_mult residual streams                (as the target expands its embeddings)
    s      = decoder layer (a DSA layer of the target's kind: sparse MLA + its own full k-pool indexer,
             MoE or dense MLP, its own attention / MLP hyper-connections)
    g      = mean of the streams of s                              (the "MTP hidden")
    logits = head(shared_head.norm(g))

`h` is what the target's final norm sees: the mean over the hc streams of the last target layer's
output (the feature a proposer gets from `capture_layers = (num_hidden_layers - 1,)`). `e` comes from
the layer's own `embed_tokens` when the checkpoint has one, else from the target's; `head` is
`shared_head.head` when present, else the target's `lm_head`. Chained drafting feeds step j's MTP
hidden `g` (before `shared_head.norm`) as step j+1's `h`, with step j's greedy draft as its token.

Position convention: the MTP sequence pairs each target hidden with the token after it. Its entry at
position i is the layer's K/V (latent, indexer key and gate) for (h_i, token i+1), so a sequence of
n committed tokens has n - 1 MTP entries (positions 0 .. n-2), and the entry at i predicts token
i+2. Entries are stored at the target's token-cache slot of position i and k-pools group positions
from 0 as the target's do. This is DeepSeek-V3-style MTP training's pairing (position i sees h_i and
token i+1); token 0 has no hidden before it and gets no entry. Every chained step runs the layer's
own indexer (no top-k reuse across steps).

Tensor names (under `layers.{num_hidden_layers}.`): `enorm.weight`, `hnorm.weight`, `eh_proj.weight`
[H, 2H], `shared_head.norm.weight`, optional `shared_head.head.weight` [vocab, H] and
`embed_tokens.weight` [vocab, H], and the decoder layer's tensors named as in any target layer
(`hc_attn_*`, `hc_ffn_*`, `input_layernorm`, `post_attention_layernorm`, `self_attn.*` with
`self_attn.indexer.*`, `mlp.*`).
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from hylo.config import INDEXED, ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.layers.linear import Linear
from hylo.layers.norm import RMSNorm
from hylo.layers.vocab import HotTokenHead, VocabEmbedding, VocabHead
from hylo.models.glm5_next import DecoderLayer, Glm5NextForCausalLM
from hylo.ops.mhc import mhc_post_mean
from hylo.ops.norm import NormRows, rms_norm_cat
from hylo.parallel.layout import SINGLE, Parallel


def mtp_config(target: ModelConfig, mlp_type: str) -> ModelConfig:
    """The target's sizes with a single layer: DSA with its own (`full`) indexer, `mlp_type` MLP. The
    MTP layer's caches are built from it, so they hold exactly one DSA layer and one indexer."""
    return dataclasses.replace(
        target, num_hidden_layers=1, layer_types=[INDEXED], indexer_types=["full"], mlp_layer_types=[mlp_type]
    )


class SharedHead(nn.Module):
    def __init__(self, config: ModelConfig, own_head: bool, parallel: Parallel = SINGLE):
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = VocabHead(config.hidden_size, config.vocab_size, parallel) if own_head else None


class MTPLayer(nn.Module):
    """Parameter names are the checkpoint's below `layers.{num_hidden_layers}.`, except that the decoder
    layer's sit under `decoder.`. `config` is the one-layer `mtp_config`."""

    def __init__(self, config: ModelConfig, own_embedding: bool, own_head: bool, parallel: Parallel = SINGLE):
        super().__init__()
        if config.num_hidden_layers != 1 or config.layer_types[0] != INDEXED:
            raise ValueError("an MTPLayer is built from a one-layer DSA config (see mtp_config)")
        h = config.hidden_size
        self.config, self.parallel = config, parallel
        self.enorm = RMSNorm(h, config.rms_norm_eps)
        self.hnorm = RMSNorm(h, config.rms_norm_eps)
        self.eh_proj = Linear(2 * h, h)
        self.decoder = DecoderLayer(config, 0, parallel)
        self.shared_head = SharedHead(config, own_head, parallel)
        self.embed_tokens = VocabEmbedding(config.vocab_size, h, parallel) if own_embedding else None

    def embedding(self, target: Glm5NextForCausalLM) -> nn.Embedding:
        return self.embed_tokens if self.embed_tokens is not None else target.embed_tokens

    def head(self, target: Glm5NextForCausalLM) -> VocabHead:
        return self.shared_head.head if self.shared_head.head is not None else target.lm_head

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """MTP hiddens `[T, H]` of the packed entries (`embeds`: the tokens' embeddings, `hidden`: the
        target or previous-step hiddens paired with them). Writes the entries' K/V at `batch.new_slots`
        of `batch.tokens`; `batch.input_ids` is not read."""
        normed = rms_norm_cat(
            NormRows(embeds, self.enorm.weight, self.enorm.eps),
            NormRows(hidden, self.hnorm.weight, self.hnorm.eps),
        )  # enorm and hnorm side by side: one launch on CUDA
        x = self.eh_proj(normed)
        streams = x[:, None, :].expand(-1, self.config.hc_mult, -1).contiguous()
        step = self.decoder(streams, batch, None)
        out, post, comb = step.pending
        return mhc_post_mean(out, step.streams, post, comb)

    def logits(self, hidden: torch.Tensor, target: Glm5NextForCausalLM) -> torch.Tensor:
        return self.head(target)(self.shared_head.norm(hidden)).float()

    def greedy(
        self, hidden: torch.Tensor, target: Glm5NextForCausalLM, head: VocabHead | HotTokenHead | None = None
    ) -> torch.Tensor:
        """`logits(hidden, target).argmax(-1)`, without the full logits under tensor parallelism; with
        `head` (`self.head(target)` restricted to a token map), the best of its tokens."""
        return (self.head(target) if head is None else head).argmax(self.shared_head.norm(hidden))
