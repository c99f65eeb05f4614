"""What each rank holds of every checkpoint tensor under tensor parallelism, by checkpoint name.

- vocabulary rows (`Parallel.vocab_span`): `embed_tokens`, `lm_head`, an MTP layer's `embed_tokens`
  and `shared_head.head`;
- by head (dim 0): KDA `q_proj k_proj v_proj f_b_proj g_b_proj b_proj`, `q/k/v_conv1d`, `dt_bias`,
  `A_log`; DSA `q_b_proj`, `kv_b_proj`;
- row parallel (dim 1): KDA and DSA `o_proj`, dense and shared-expert `down_proj`;
- column parallel (dim 0): dense and shared-expert `gate_proj`, `up_proj`;
- the block scales of FP8 projections (`weight_scale_inv`) like their weights, by whole blocks;
- routed experts with `ep_size == tp_size`: by expert, rank r reads only its experts; with
  `ep_size == 1`: by tensor, `gate_proj`/`up_proj` dim 0 and `down_proj` dim 1 (FP8 scales by block);
- replicated: everything else (norms, `f_a_proj`, `g_a_proj`, `q_a_proj`, `kv_a_proj_with_mqa`, the
  indexer, the router, mHC, `eh_proj`).

A split tensor is read as a slice (`safe_open(...).get_slice`): a rank never reads the rows or columns
it does not keep.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from hylo.parallel.layout import Parallel

VOCAB = "vocab"
_VOCAB = re.compile(r"(^|\.)(embed_tokens|lm_head|shared_head\.head)\.weight$")
_DIM0 = re.compile(
    r"\.self_attn\.(q_proj|k_proj|v_proj|f_b_proj|g_b_proj|b_proj|q_b_proj|kv_b_proj)\.weight(_scale_inv)?$"
    r"|\.self_attn\.(q_conv1d\.weight|k_conv1d\.weight|v_conv1d\.weight|dt_bias|A_log)$"
    r"|\.mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight(_scale_inv)?$"
)
_DIM1 = re.compile(
    r"\.self_attn\.o_proj\.weight(_scale_inv)?$|\.mlp\.(shared_experts\.)?down_proj\.weight(_scale_inv)?$"
)
_EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.(weight|weight_scale_inv)$")


@dataclass(frozen=True)
class Shard:
    """The part `[start, start + length)` along `dim` of a checkpoint tensor that this rank reads."""

    dim: int
    start: int
    length: int

    def index(self) -> tuple[slice, ...]:
        return (*(slice(None),) * self.dim, slice(self.start, self.start + self.length))


def split_dim(key: str, parallel: Parallel) -> int | str | None:
    """How checkpoint tensor `key` is split: a dim, `VOCAB`, or None (replicated, or a routed expert
    held whole by the rank that holds it)."""
    if parallel.size == 1:
        return None
    if _VOCAB.search(key):
        return VOCAB
    expert = _EXPERT.search(key)
    if expert is not None:
        if parallel.experts_by_expert:
            return None
        return 1 if expert.group(2) == "down_proj" else 0
    return projection_split(key)


def projection_split(key: str) -> int | str | None:
    """How tensor parallelism splits the non-expert tensor `key` (a dim, `VOCAB`, or None), whatever
    the number of ranks."""
    if _VOCAB.search(key):
        return VOCAB
    if _DIM0.search(key):
        return 0
    if _DIM1.search(key):
        return 1
    return None


def expert_of(key: str) -> int | None:
    """The routed expert a checkpoint tensor belongs to, None for any other tensor."""
    match = _EXPERT.search(key)
    return None if match is None else int(match.group(1))
