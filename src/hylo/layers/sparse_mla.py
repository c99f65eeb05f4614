"""DSA layer: NoPE MLA over the rows selected by the indexer, in the absorbed (latent) form."""

from __future__ import annotations

import torch
from torch import nn

from hylo.config import ModelConfig
from hylo.forward_batch import ForwardBatch
from hylo.layers.indexer import Indexer
from hylo.layers.linear import FusedLinear, Linear
from hylo.layers.norm import RMSNorm
from hylo.ops.norm import NormRows, RowStore, rms_norm_pair
from hylo.ops.sparse_mla import sparse_mla
from hylo.parallel.layout import SINGLE, Parallel, TokenShards

# the indexer's k-pool gate, a bare parameter `[index_head_dim, hidden]` in checkpoints (no `.weight`)
_GATE = "indexer.index_kpool_compress_gate"


class SparseMLA(nn.Module):
    """Only the latent `c = RMSNorm(kv_a x)` is cached. kv_b is absorbed: q_lat = q·W_UK per head,
    attention runs over latents, and W_UV maps the latent output back per head.

    Under tensor parallelism the heads are split (q_b and kv_b by head, o_proj row parallel: the
    decoder layer completes its partial sum); q_a, kv_a, their norms, the indexer and the latent cache
    are replicated: every rank writes the same latents."""

    def __init__(self, config: ModelConfig, layer_idx: int, parallel: Parallel = SINGLE):
        super().__init__()
        hidden, h = config.hidden_size, parallel.part(config.num_attention_heads, "num_attention_heads")
        self.layer_idx, self.num_heads, self.parallel = layer_idx, h, parallel
        self.nope_dim, self.v_dim, self.rank = config.qk_nope_head_dim, config.v_head_dim, config.kv_lora_rank
        self.scale = config.qk_nope_head_dim**-0.5
        full_indexer = config.indexer_types[layer_idx] == "full"
        # q_a, kv_a and the indexer's key, head-weight and k-pool gate projections read the same
        # input: one GEMM (in an FP8 checkpoint two: weights_proj and the gate are stored unquantised)
        parts = [("q_a_proj", config.q_lora_rank), ("kv_a_proj_with_mqa", self.rank)]
        if full_indexer:
            d = config.index_head_dim
            parts += [("indexer.wk", d), ("indexer.weights_proj", config.index_n_heads), (_GATE, d)]
        self.in_proj = FusedLinear(hidden, parts, bare=[_GATE] if full_indexer else ())
        self.q_a_layernorm = RMSNorm(config.q_lora_rank, config.rms_norm_eps)
        # q_b and the indexer's query projection read the same normed q latent: one GEMM (q_b split by
        # head under tensor parallelism, the indexer's whole)
        q_parts = [("q_b_proj", h * self.nope_dim)]
        if full_indexer:
            q_parts.append(("indexer.wq_b", config.index_n_heads * config.index_head_dim))
        self.q_b_proj = FusedLinear(config.q_lora_rank, q_parts)
        self.kv_a_layernorm = RMSNorm(self.rank, config.rms_norm_eps)
        # absorbed into the queries and the output (read as a matrix): kept in the model dtype
        self.kv_b_proj = Linear(self.rank, h * (self.nope_dim + self.v_dim), quantizable=False)
        self.o_proj = Linear(h * self.v_dim, hidden)
        self.indexer = Indexer(config, layer_idx) if full_indexer else None

    def forward(
        self,
        x: torch.Tensor,
        batch: ForwardBatch,
        rows: torch.Tensor | None,
        shards: TokenShards | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns this rank's partial sum of the output (the decoder layer completes it) and the rows used
        (a `shared` layer passes in its predecessor's rows). With `shards` (a step split by token) the
        attention runs on this rank's tokens with every head, between two all-to-alls: each token's
        gathered latent rows serve all its heads at once (at a TP8 rank of a 13K prompt the head-split
        attention ran at 0.085 of its FLOP floor, bound by every rank gathering every token's rows);
        the rows are then this rank's tokens' alone, `[shards.local, W]` (the indexer selects no other)."""
        latent = batch.tokens.latent[batch.tokens.dsa_index[self.layer_idx]]
        q_a, kv_a, *index_parts = self.in_proj(x)
        # q_a's norm, and kv_a's written straight into the latent cache: one launch on the GPU
        q_resid = rms_norm_pair(
            _rows(q_a, self.q_a_layernorm),
            _rows(kv_a, self.kv_a_layernorm),
            RowStore(latent, batch.new_slots),
        )
        q, *index_query = self.q_b_proj(q_resid)
        if self.indexer is not None:
            rows = self.indexer(*index_query, batch, *index_parts, shards)
        elif rows is None:
            raise ValueError(f"layer {self.layer_idx} shares rows but no full indexer layer precedes it")

        w_kv = self.kv_b_proj.weight.view(self.num_heads, self.nope_dim + self.v_dim, self.rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        q = q.unflatten(-1, (self.num_heads, self.nope_dim))
        q_latent = torch.einsum("thd,hdr->thr", q, w_uk)
        if shards is None:
            out_latent = sparse_mla(q_latent, latent, rows, self.scale)
        else:
            mine = sparse_mla(self.parallel.heads_to_tokens(q_latent, shards), latent, rows, self.scale)
            out_latent = self.parallel.tokens_to_heads(mine, shards)
        out = torch.einsum("thr,hvr->thv", out_latent, w_uv)
        return self.o_proj(out.flatten(1)), rows


def _rows(x: torch.Tensor, norm: RMSNorm) -> NormRows:
    return NormRows(x, norm.weight, norm.eps)
