"""The DFlash draft attention family (`ops/draft_attention/kernels.py`): the paged block attention (context
splits, then the block and merge) at blocks of 8 with 32 query heads over 8 KV heads (d = 128, bf16), with
and without a sliding window, 1 and 8 requests, the 128-row group of 64 heads at blocks of 16 in one split;
the context K/V store of 5 draft layers; the queries' and keys' RMSNorm + RoPE. Operands are the views the
model passes (q, k and v slices of one GEMM's rows); the table int32, rows, lengths and positions int64."""

from __future__ import annotations

import torch
from code_size import HEAD_DIM

from hylo.ops.draft_attention import kernels
from hylo.ops.draft_attention.reference import ContextTable, ContextTokens, DraftBlock, KeyTransform, KVCache

BF16 = torch.bfloat16
MODULES = ()  # no launch of the family is a programmatic dependent
KV_HEADS, LAYERS, MAX_LEN, MAX_POS = 8, 5, 4096, 8192


def paged(requests: int, block: int, heads: int, window: int | None, num_splits: int) -> None:
    """One layer's attention of `requests` blocks over a `MAX_LEN`-wide table, `num_splits` context splits
    (33 and 5: what `default_num_splits` gives 1 and 8 requests on an H100's 132 SMs)."""
    width = (heads + 2 * KV_HEADS) * HEAD_DIM
    qkv = torch.zeros(requests, block, width, dtype=BF16)
    q = qkv[..., : heads * HEAD_DIM].unflatten(-1, (heads, HEAD_DIM)).contiguous()  # normed_rotated's output
    k = (
        qkv[..., heads * HEAD_DIM : width - KV_HEADS * HEAD_DIM]
        .unflatten(-1, (KV_HEADS, HEAD_DIM))
        .contiguous()
    )
    v = qkv[..., width - KV_HEADS * HEAD_DIM :].unflatten(-1, (KV_HEADS, HEAD_DIM))  # a view of the GEMM
    slots = requests * MAX_LEN
    cache = KVCache(*(torch.zeros(LAYERS, slots, KV_HEADS, HEAD_DIM, dtype=BF16)[2] for _ in "kv"))
    table = ContextTable(
        torch.zeros(requests + 1, MAX_LEN, dtype=torch.int32),
        torch.arange(requests),
        torch.full((requests,), 1000),
    )
    kernels.paged_draft_attention(
        DraftBlock(q, k, v), cache, table, HEAD_DIM**-0.5, window, num_splits=num_splits
    )


def store(tokens: int, gemm_views: bool = True) -> None:
    """The committed tokens' keys and values of every draft layer: `[k|v, layer, token, kv heads, d]` views
    of one GEMM's rows as `DFlashProposer.observe` permutes them, int64 positions and slots; or contiguous
    keys and values with int32 positions and slots (the kernel benchmark's)."""
    if gemm_views:
        kv = torch.zeros(tokens, LAYERS * 2 * KV_HEADS * HEAD_DIM, dtype=BF16)
        kv = kv.view(-1, LAYERS, 2, KV_HEADS, HEAD_DIM).permute(2, 1, 0, 3, 4)
        positions, slots = torch.arange(tokens), torch.arange(tokens)
    else:
        kv = torch.zeros(2, LAYERS, tokens, KV_HEADS, HEAD_DIM, dtype=BF16)
        positions, slots = (torch.arange(tokens, dtype=torch.int32) for _ in "ps")
    keys = KeyTransform(
        torch.ones(LAYERS, HEAD_DIM, dtype=BF16), 1e-6, *(torch.zeros(MAX_POS, HEAD_DIM // 2) for _ in "cs")
    )
    cache = KVCache(*(torch.zeros(LAYERS, tokens * 4, KV_HEADS, HEAD_DIM, dtype=BF16) for _ in "kv"))
    kernels.store_context_kv(ContextTokens(kv[0], kv[1], positions, slots), keys, cache)


def normed_rotated(tokens: int, heads: int, row_width: int) -> None:
    """`heads` of each token's `row_width`-wide GEMM row (the block's q, or a context key)."""
    x = torch.zeros(tokens, row_width, dtype=BF16)[:, : heads * HEAD_DIM].unflatten(-1, (heads, HEAD_DIM))
    cos, sin = (torch.zeros(MAX_POS, HEAD_DIM // 2) for _ in "cs")
    kernels.normed_rotated(x, torch.ones(HEAD_DIM, dtype=BF16), 1e-6, cos, sin, torch.arange(tokens))


CASES = {
    "paged_r1_b8_h32": lambda: paged(1, 8, 32, None, 33),
    "paged_r8_b8_h32_window": lambda: paged(8, 8, 32, 2048, 5),
    "paged_r8_b16_h64_one_split": lambda: paged(8, 16, 64, None, 1),
    "store_n64": lambda: store(64),
    "store_contiguous_n8": lambda: store(8, gemm_views=False),
    "normed_rotated_q_n64": lambda: normed_rotated(64, 32, (32 + 2 * KV_HEADS) * HEAD_DIM),
    "normed_rotated_k_n8": lambda: normed_rotated(8, KV_HEADS, 2 * KV_HEADS * HEAD_DIM),
}
