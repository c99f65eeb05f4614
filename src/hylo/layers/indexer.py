"""DSA indexer with k-pool compression: picks the latent rows each query of a DSA layer attends to."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.ops import indexer as indexer_ops
from hylo.parallel.layout import TokenShards


class Indexer(nn.Module):
    def __init__(self, config: ModelConfig, layer_idx: int):
        super().__init__()
        d, h = config.index_head_dim, config.index_n_heads
        self.layer_idx, self.num_heads, self.head_dim = layer_idx, h, d
        self.selection = indexer_ops.Selection(
            config.index_kpool, config.index_topk, config.index_kpool_always_select_tail
        )
        # wq_b reads the DSA layer's normed q latent: its rows are in the layer's `q_b_proj`; wk,
        # weights_proj and index_kpool_compress_gate read the layer input: their rows are in its `in_proj`
        self.k_norm = nn.LayerNorm(d, eps=1e-6)
        self.index_kpool_compress_ape = nn.Parameter(torch.empty(config.index_kpool, d))

    def forward(
        self,
        query: torch.Tensor,
        batch: ForwardBatch,
        key: torch.Tensor,
        head_logits: torch.Tensor,
        gate_scores: torch.Tensor,
        shards: TokenShards | None = None,
    ) -> torch.Tensor:
        """Token-cache slots of the rows each query attends to, `[T, W]`, -1 for empty entries. `query`
        is the q latent's wq_b projection `[T, heads · head_dim]`; `key`, `head_logits` and `gate_scores`
        the layer input's wk, weights_proj and k-pool compress gate projections. With `shards` (a step
        split by token) every rank still writes every token's key and pools (the caches are
        replicated), but selects for its own tokens alone: `[shards.local, W]`, padding rows -1."""
        cache = batch.tokens
        layer = cache.indexer_index[self.layer_idx]
        keys, gates = cache.index_key[layer], cache.index_gate[layer]
        scale = None if cache.pooled_key_scale is None else cache.pooled_key_scale[layer]
        pooled = indexer_ops.PooledKeys(cache.pooled_key[layer], scale)
        norm = indexer_ops.KeyNorm(self.k_norm.weight, self.k_norm.bias, self.k_norm.eps)
        token_keys = indexer_ops.TokenKeys(keys, gates)
        indexer_ops.store_tokens(key, gate_scores, norm, token_keys, batch.new_slots)
        indexer_ops.compress_pools(keys, gates, self.index_kpool_compress_ape, batch.completed_pools, pooled)

        # HF scales the scores by d^-1/2 and the head weights by Hi^-1/2: constant positive factors of
        # every score, which change no choice of pools, so the projections go in as they are
        q = query.unflatten(-1, (self.num_heads, self.head_dim))
        layout = indexer_ops.SlotLayout(
            batch.pool_table, batch.req_to_token, batch.token_seq, batch.token_rows, batch.positions,
            batch.pad_index, batch.pad_valid,
        )  # fmt: skip
        if shards is None:
            return indexer_ops.select_slots(q, head_logits, pooled, layout, self.selection)
        mine = indexer_ops.select_slots(q, head_logits, pooled, layout, self.selection, shards.mine)
        return shards.pad_local(mine, -1)
