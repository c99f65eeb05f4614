"""The DSA indexer and sparse MLA families (`ops/indexer/kernels.py`, `ops/sparse_mla/kernels.py`): the
new tokens' key stores, pool compression into FP8 and bf16 pools, selection (scoring then top-k) at 32
index heads and a TP8 rank's 4, B = 1 and 8, FP8 and bf16 pooled keys, a rank's share of a step's tokens,
a context too long for one top-k tile without the tail, scores computed token-major; sparse MLA's
prefill pass and split decode with its merge at 64 heads and a TP8 rank's 8, T = 1 and 8, with and without
skipping empty blocks."""

from __future__ import annotations

import torch
from code_size import INDEX_DIM, KPOOL

from hylo.ops.indexer import kernels as indexer
from hylo.ops.indexer.reference import KeyNorm, PooledKeys, Selection, SlotLayout, TokenKeys
from hylo.ops.sparse_mla import kernels as sparse_mla

BF16, FP8 = torch.bfloat16, torch.float8_e4m3fn
MODULES = (indexer, sparse_mla)
INDEX_HEADS, TOPK = 32, 2048
HEADS, RANK = 64, 512  # attention heads, latent rank (kv_lora_rank)
SLOTS = 16384  # token-cache slots
WIDTH = indexer.row_width(TOPK, KPOOL, tail=True)  # a selected row list: 2112
HIDDEN_REST = 2048  # in_proj's product: its columns ahead of the indexer's (q_a, kv_a)
# the split count `sparse_mla_fwd` picks on an H100 (132 SMs) at (tokens, heads): the CPU counts 4 SMs
H100_SPLITS = {(1, HEADS): 33, (8, HEADS): 9, (1, 8): 33}


def in_proj(tokens: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The indexer's key, head weights and gate scores: column views of one wider product, as the
    layer's `in_proj` hands them over."""
    product = torch.zeros(tokens, HIDDEN_REST + 2 * INDEX_DIM + INDEX_HEADS, dtype=BF16)
    key, weights, gates = product[:, HIDDEN_REST:].split([INDEX_DIM, INDEX_HEADS, INDEX_DIM], dim=1)
    return key, weights, gates


def store_tokens(tokens: int) -> None:
    key, _, gates = in_proj(tokens)
    norm = KeyNorm(torch.ones(INDEX_DIM, dtype=BF16), torch.zeros(INDEX_DIM, dtype=BF16), 1e-6)
    cache = TokenKeys(*(torch.zeros(SLOTS, INDEX_DIM, dtype=BF16) for _ in range(2)))
    indexer.store_tokens(key, gates, norm, cache, torch.arange(tokens))


def compress(fp8: bool) -> None:
    """One completed pool (a decode step of one sequence)."""
    keys, gates = (torch.zeros(SLOTS, INDEX_DIM, dtype=BF16) for _ in range(2))
    pooled = torch.zeros(SLOTS // KPOOL, INDEX_DIM, dtype=FP8 if fp8 else BF16)
    scale = torch.ones(SLOTS // KPOOL) if fp8 else None
    ape = torch.zeros(KPOOL, INDEX_DIM)
    indexer.compress_pools(keys, gates, ape, torch.tensor([3]), pooled, scale)


def layout(batch: int, steps: int, pools: int) -> SlotLayout:
    """`batch` sequences of `steps` new tokens each, `pools` pools in the table's rows."""
    tokens = batch * steps
    return SlotLayout(
        pool_table=torch.zeros(batch, pools, dtype=torch.int64),
        req_to_token=torch.zeros(batch, pools * KPOOL, dtype=torch.int32),
        token_seq=torch.zeros(tokens, dtype=torch.int64),
        token_rows=torch.zeros(tokens, dtype=torch.int64),
        positions=torch.zeros(tokens, dtype=torch.int64),
        pad_index=torch.zeros(batch, steps, dtype=torch.int64),
        pad_valid=torch.ones(batch, steps, dtype=torch.bool),
    )


def index_query(tokens: int, heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q `[T, heads, d]` (columns of q_b_proj's product, after the attention heads' q) and the head
    weights (columns of `in_proj`'s)."""
    product = torch.zeros(tokens, HEADS * 192 + heads * INDEX_DIM, dtype=BF16)
    q = product[:, HEADS * 192 :].unflatten(-1, (heads, INDEX_DIM))
    return q, in_proj(tokens)[1][:, :heads]


def pooled_keys(pools: int, fp8: bool) -> PooledKeys:
    if fp8:
        return PooledKeys(torch.zeros(pools, INDEX_DIM, dtype=FP8), torch.ones(pools))
    return PooledKeys(torch.zeros(pools, INDEX_DIM, dtype=BF16))


def select(
    batch: int,
    pools: int,
    heads: int = INDEX_HEADS,
    fp8: bool = True,
    tail: bool = True,
    tokens: range | None = None,
) -> None:
    """Scoring then top-k of `batch` sequences' decode tokens against `pools` pools each."""
    q, weights = index_query(batch, heads)
    indexer.select_slots(
        q, weights, pooled_keys(SLOTS // KPOOL, fp8), layout(batch, 1, pools), Selection(KPOOL, TOPK, tail),
        tokens,
    )  # fmt: skip


def scores_tokens_major(batch: int, pools: int) -> None:
    q, weights = index_query(batch, INDEX_HEADS)
    keys, rows = pooled_keys(SLOTS // KPOOL, True), layout(batch, 1, pools)
    indexer.index_scores(
        q, weights, keys.keys, keys.scale, rows.pool_table, rows.positions, rows.pad_index, rows.pad_valid,
        KPOOL, pools_major=False,
    )  # fmt: skip


def attend(tokens: int, heads: int, prefill: bool = False, **kwargs) -> None:
    """Sparse MLA of `tokens` queries over their selected row lists; at decode, split as on an H100."""
    q = torch.zeros(tokens, heads, RANK, dtype=BF16)
    latent = torch.zeros(SLOTS, RANK, dtype=BF16)
    rows = torch.zeros(tokens, WIDTH, dtype=torch.int32)
    if prefill:
        sparse_mla.sparse_mla_prefill(q, latent, rows, RANK**-0.5, cuda=False)
        return
    splits = H100_SPLITS[tokens, heads]
    sparse_mla.sparse_mla_decode(q, latent, rows, RANK**-0.5, num_splits=splits, **kwargs)


CASES = {
    "store_tokens_t8": lambda: store_tokens(8),
    "compress_fp8": lambda: compress(True),
    "compress_bf16": lambda: compress(False),
    "select_fp8_b1_p1000": lambda: select(1, 1000),
    "select_fp8_b8_p1024": lambda: select(8, 1024),
    "select_fp8_b1_h4": lambda: select(1, 1024, heads=4),
    "select_bf16_b8": lambda: select(8, 1024, fp8=False),
    "select_rank1_of_b8": lambda: select(8, 1024, tokens=range(1, 2)),
    "select_long_no_tail_b1": lambda: select(1, 12288, tail=False),
    "scores_tokens_major_b8": lambda: scores_tokens_major(8, 1024),
    "mla_prefill_t16_h64": lambda: attend(16, HEADS, prefill=True),
    "mla_decode_t1_h64": lambda: attend(1, HEADS),
    "mla_decode_t8_h64": lambda: attend(8, HEADS),
    "mla_decode_t1_h8": lambda: attend(1, 8),
    "mla_decode_skip_empty_t1_h64": lambda: attend(1, HEADS, skip_empty=True),
}
