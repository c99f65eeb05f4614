"""Triton kernels of the DFlash draft's attention: paged block attention and the context K/V store.

`paged_draft_attention` is two launches with grids fixed by the shapes, so it can be captured in a
CUDA graph and replayed with other context lengths:

1. `_context_split_kernel`, grid (R, Hkv, num_splits). One program owns one request, one kv head
   and one share of that request's context tiles. Its M rows are the B block rows times the
   Hq / Hkv query heads of the kv head, so each K/V tile, gathered through the request's table row,
   is read once per kv head and feeds one `tl.dot`. The number of tiles comes from the context length
   read on the device (with a window, only the tiles from the first key any row can see), and the
   program's share of them is its loop bound. It writes its normalised partial output and its
   log-sum-exp (base 2; -inf when its share is empty or entirely outside the window) to fp32
   buffers `[R, Hkv, num_splits, BLOCK_M, d]` and `[R, Hkv, num_splits, BLOCK_M]`.
2. `_block_merge_kernel`, grid (R, Hkv, d / BLOCK_D). Attends the same M rows over the block's own
   B keys, then folds the partials of the splits that own tiles (read from the context length as the
   first kernel shares them) into that by log-sum-exp and writes the output, each program for one
   slice of head_dim (the partials of a long context are read by several programs rather than
   streamed through one). Every query row sees at least its own block key, so the merged
   denominator is never zero.

Scores, softmax statistics and accumulators are fp32, kept in base 2 (the scale is multiplied by
log2 e); the probabilities enter the P·V dot in the input dtype, as in flash attention, so bf16
results differ from the reference by about one bf16 rounding. A finite running-max start keeps
`exp2(-inf - m) = 0` rather than NaN for rows whose keys in a tile are all masked.

`store_context_kv` is one launch over (token, layer): RMSNorm over head_dim, weight, rotate-half
RoPE from fp32 tables, then both caches; a negative slot masks the row's stores.

The kernels take their tensors with the strides that address them as the typed bundles of `operands.py`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.draft_attention.operands import (
    BlockRows,
    ContextSlots,
    LayerHeads,
    LayerKeyNorm,
    RotaryTables,
    SlotHeads,
    SplitPartials,
    StoredTokens,
)
from hylo.ops.draft_attention.reference import ContextTable, ContextTokens, DraftBlock, KeyTransform, KVCache
from hylo.ops.draft_attention.support import (
    normed_rotated_refusal,
    paged_draft_attention_refusal,
    store_context_kv_refusal,
)
from hylo.ops.operands import HeadRows

LOG2E = 1.4426950408889634
# Context-split tiles: on sm_90 at B = 8, group 4, d = 128 in bf16 these compile without spills (the
# compile test in tests/test_draft_attention_kernels.py); the benchmark sweeps the alternatives.
CONTEXT_TILES = {"block_n": 64, "num_warps": 4, "num_stages": 2}


@triton.jit
def _query_rows(
    q: BlockRows, req, kv,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, HEAD_DIM: tl.constexpr,
):  # fmt: skip
    """The M = B * group query rows of kv head `kv` in request `req` of `q` (row m: block row m // group,
    head kv * group + m % group), their block rows, heads and validity (rows past B * group are padding)."""
    m = tl.arange(0, BLOCK_M)
    block_row = m // GROUP
    head = kv * GROUP + m % GROUP
    row_ok = m < BLOCK * GROUP
    dims = tl.arange(0, HEAD_DIM)
    rows = tl.load(
        q.data + req * q.request_stride + block_row[:, None] * q.row_stride + head[:, None] * q.head_stride
        + dims[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )  # fmt: skip
    return rows, block_row, head, row_ok


@triton.jit
def _context_split_kernel(
    q: BlockRows, k_cache: SlotHeads, v_cache: SlotHeads, context: ContextSlots, partials: SplitPartials,
    scale_log2, window,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    split = tl.program_id(2)
    ctx_len = tl.load(context.ctx_lens + req).to(tl.int32)
    table_row = tl.load(context.rows + req).to(tl.int64)
    q_rows, block_row, _, _ = _query_rows(q, req, kv, BLOCK, GROUP, BLOCK_M, HEAD_DIM)
    q_pos = ctx_len + block_row
    # Block row 0 is the earliest query: no row sees a context key at or before ctx_len - window.
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window + 1, 0)
    num_tiles = tl.cdiv(ctx_len - first, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, partials.num_splits)
    tile_lo = split * tiles_per_split
    tile_hi = tl.minimum(tile_lo + tiles_per_split, num_tiles)

    dims = tl.arange(0, HEAD_DIM)
    m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(tile_lo, tile_hi):
        pos = first + tile * BLOCK_N + tl.arange(0, BLOCK_N)
        in_ctx = pos < ctx_len
        table = context.req_to_token + table_row * context.row_stride
        slot = tl.load(table + pos, mask=in_ctx, other=0).to(tl.int64)
        k = tl.load(
            k_cache.data + slot[:, None] * k_cache.slot_stride + kv * k_cache.head_stride + dims[None, :],
            mask=in_ctx[:, None],
            other=0.0,
        )
        v = tl.load(
            v_cache.data + slot[:, None] * v_cache.slot_stride + kv * v_cache.head_stride + dims[None, :],
            mask=in_ctx[:, None],
            other=0.0,
        )
        s = tl.dot(q_rows, tl.trans(k)) * scale_log2
        allowed = in_ctx[None, :]
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        s = tl.where(allowed, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    has_keys = l_i > 0
    safe_l = tl.where(has_keys, l_i, 1.0)
    lse = tl.where(has_keys, m_i + tl.log2(safe_l), float("-inf"))
    m = tl.arange(0, BLOCK_M)
    parts = partials
    out = parts.out + req * parts.request_stride + kv * parts.head_stride + split * parts.split_stride
    tl.store(out + m[:, None] * parts.row_stride + dims[None, :], acc / safe_l[:, None])
    lse_out = parts.lse + req * parts.lse_request_stride + kv * parts.lse_head_stride
    tl.store(lse_out + split * parts.lse_split_stride + m, lse)


@triton.jit
def _block_merge_kernel(
    q: BlockRows, k_block: BlockRows, v_block: BlockRows, partials: SplitPartials, out: BlockRows, ctx_lens,
    scale_log2, window,
    BLOCK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
    BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HAS_WINDOW: tl.constexpr,
):  # fmt: skip
    req = tl.program_id(0).to(tl.int64)
    kv = tl.program_id(1)
    # The splits that own context tiles, as `_context_split_kernel` shares them out: the others wrote
    # lse = -inf, which folds in as nothing (a short context leaves most of the splits empty, and a
    # serial fold over all of them was most of this kernel's time)
    ctx_len = tl.load(ctx_lens + req).to(tl.int32)
    first = 0
    if HAS_WINDOW:
        first = tl.maximum(ctx_len - window + 1, 0)
    num_tiles = tl.cdiv(ctx_len - first, BLOCK_N)
    tiles_per_split = tl.cdiv(num_tiles, partials.num_splits)
    used_splits = tl.cdiv(num_tiles, tl.maximum(tiles_per_split, 1))
    # Scores need all of head_dim; the values, partials and output only this program's BLOCK_D slice.
    out_dims = tl.program_id(2) * BLOCK_D + tl.arange(0, BLOCK_D)
    q_rows, block_row, head, row_ok = _query_rows(q, req, kv, BLOCK, GROUP, BLOCK_M, HEAD_DIM)
    dims = tl.arange(0, HEAD_DIM)
    j = tl.arange(0, BLOCK_J)
    key_ok = j < BLOCK
    k = tl.load(
        k_block.data + req * k_block.request_stride + j[:, None] * k_block.row_stride
        + kv * k_block.head_stride + dims[None, :],
        mask=key_ok[:, None],
        other=0.0,
    )  # fmt: skip
    v = tl.load(
        v_block.data + req * v_block.request_stride + j[:, None] * v_block.row_stride
        + kv * v_block.head_stride + out_dims[None, :],
        mask=key_ok[:, None],
        other=0.0,
    )  # fmt: skip
    s = tl.dot(q_rows, tl.trans(k)) * scale_log2
    allowed = key_ok[None, :]
    if HAS_WINDOW:  # block key j sits at ctx_len + j, block row b at ctx_len + b
        allowed = allowed & (j[None, :] > block_row[:, None] - window)
    s = tl.where(allowed, s, float("-inf"))
    m_i = tl.maximum(tl.max(s, axis=1), -1.0e30)
    p = tl.exp2(s - m_i[:, None])
    l_i = tl.sum(p, axis=1)
    acc = tl.dot(p.to(v.dtype), v)

    m = tl.arange(0, BLOCK_M)
    parts = partials
    part = parts.out + req * parts.request_stride + kv * parts.head_stride + m[:, None] * parts.row_stride
    part += out_dims[None, :]
    lse = parts.lse + req * parts.lse_request_stride + kv * parts.lse_head_stride + m
    for split in range(used_splits):
        lse_s = tl.load(lse + split * parts.lse_split_stride)
        o_s = tl.load(part + split * parts.split_stride)
        m_new = tl.maximum(m_i, lse_s)
        alpha = tl.exp2(m_i - m_new)
        weight = tl.exp2(lse_s - m_new)
        l_i = l_i * alpha + weight
        acc = acc * alpha[:, None] + weight[:, None] * o_s
        m_i = m_new

    o = acc / tl.where(row_ok, l_i, 1.0)[:, None]
    dst = out.data + req * out.request_stride + block_row[:, None] * out.row_stride
    dst += head[:, None] * out.head_stride
    tl.store(dst + out_dims[None, :], o.to(out.data.dtype.element_ty), mask=row_ok[:, None])


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


def default_num_splits(
    num_requests: int, num_kv_heads: int, max_len: int, window: int | None, block_n: int, device: torch.device
) -> int:
    """Context splits per (request, kv head): about 2 x the SM count of programs in all, but no more
    than the tiles the longest possible context (the table's width, or the window) can fill. Depends
    on shapes only, so a captured graph stays valid for any context lengths."""
    longest = max_len if window is None else min(max_len, window)
    tiles = max(1, triton.cdiv(longest, block_n))
    wanted = triton.cdiv(2 * _num_sms(device), max(1, num_requests * num_kv_heads))
    return max(1, min(tiles, wanted))


def paged_draft_attention(
    block: DraftBlock, cache: KVCache, table: ContextTable, scale: float, window: int | None = None, *,
    num_splits: int | None = None, block_n: int | None = None, num_warps: int | None = None,
    num_stages: int | None = None, merge_block_d: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Triton `paged_draft_attention_reference` (same arguments and result), CUDA-graph safe: no
    host read of device data, grids and buffers fixed by the shapes and `num_splits` (by default
    `default_num_splits`); tiles default to `CONTEXT_TILES`, the merge's head_dim slice to 32.
    Requires `ctx_lens[r] <= req_to_token.shape[1]` (the table is not bounds-checked on the device).
    Raises ValueError for a call `paged_draft_attention_refusal` refuses."""
    refusal = paged_draft_attention_refusal(block, cache, table, window)
    if refusal is not None:
        raise ValueError(f"paged_draft_attention kernel: {refusal}")
    q, k_block, v_block, k_cache, v_cache = block.q, block.k, block.v, cache.k, cache.v
    req_to_token, ctx_lens = table.req_to_token, table.ctx_lens
    num_requests, block_size, num_heads, head_dim = q.shape
    merge_block_d = merge_block_d or min(head_dim, 32)
    if merge_block_d & (merge_block_d - 1) or not 16 <= merge_block_d <= head_dim:
        raise ValueError(f"merge_block_d must be a power of two in [16, head_dim], got {merge_block_d}")
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_requests == 0:
        return out
    block_n = block_n or CONTEXT_TILES["block_n"]
    num_warps = num_warps or CONTEXT_TILES["num_warps"]
    num_stages = num_stages or CONTEXT_TILES["num_stages"]
    if num_splits is None:
        num_splits = default_num_splits(
            num_requests, num_kv_heads, req_to_token.shape[1], window, block_n, q.device
        )
    block_m = max(16, triton.next_power_of_2(block_size * group))
    part = torch.empty(
        num_requests, num_kv_heads, num_splits, block_m, head_dim, dtype=torch.float32, device=q.device
    )
    lse = torch.empty(num_requests, num_kv_heads, num_splits, block_m, dtype=torch.float32, device=q.device)
    scale_log2 = scale * LOG2E
    window_arg = 0 if window is None else window
    common = dict(
        BLOCK=block_size, GROUP=group, BLOCK_M=block_m, HEAD_DIM=head_dim, HAS_WINDOW=window is not None
    )
    queries, partials = BlockRows.of(q), SplitPartials.of(part, lse)
    _context_split_kernel[(num_requests, num_kv_heads, num_splits)](
        queries, SlotHeads.of(k_cache), SlotHeads.of(v_cache), ContextSlots.of(table), partials,
        scale_log2, window_arg,
        BLOCK_N=block_n, num_warps=num_warps, num_stages=num_stages, **common,
    )  # fmt: skip
    _block_merge_kernel[(num_requests, num_kv_heads, head_dim // merge_block_d)](
        queries, BlockRows.of(k_block), BlockRows.of(v_block), partials, BlockRows.of(out), ctx_lens,
        scale_log2, window_arg,
        BLOCK_J=max(16, triton.next_power_of_2(block_size)), BLOCK_N=block_n, BLOCK_D=merge_block_d,
        num_warps=4, **common,
    )  # fmt: skip
    return out


@triton.jit
def _norm_rope(x, mask, weight, cos, sin, eps, HALF: tl.constexpr):
    """`reference.normed_rotated_reference` of the rows at `x` (pointers `[rows, HALF]` to the first halves of
    head vectors, `mask`ed), with the weight and this position's cos / sin rows at `weight`, `cos`,
    `sin`: (first halves, second halves) in x's dtype."""
    lo = tl.arange(0, HALF)
    x_lo = tl.load(x, mask=mask, other=0.0)
    x_hi = tl.load(x + HALF, mask=mask, other=0.0)
    dtype = x_lo.dtype
    # RMSNorm as hylo.layers.norm: normalise in fp32, round to the input dtype, then scale by the
    # weight (a product of two 16-bit floats is exact in fp32, so one rounding matches torch's).
    x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
    mean_sq = (tl.sum(x_lo * x_lo, axis=1) + tl.sum(x_hi * x_hi, axis=1)) / (2 * HALF)
    rstd = 1.0 / tl.sqrt_rn(mean_sq + eps)[:, None]
    w_lo = tl.load(weight + lo).to(tl.float32)[None, :]
    w_hi = tl.load(weight + HALF + lo).to(tl.float32)[None, :]
    n_lo = ((x_lo * rstd).to(dtype).to(tl.float32) * w_lo).to(dtype).to(tl.float32)
    n_hi = ((x_hi * rstd).to(dtype).to(tl.float32) * w_hi).to(dtype).to(tl.float32)
    c = tl.load(cos + lo)[None, :]
    s = tl.load(sin + lo)[None, :]
    return (n_lo * c - n_hi * s).to(dtype), (n_hi * c + n_lo * s).to(dtype)


@triton.jit
def _normed_rotated_kernel(
    x: HeadRows, out: HeadRows, weight, eps, rotary: RotaryTables, positions, num_heads,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    lo = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None]
    src = x.data + tok * x.token_stride + heads[:, None] * x.head_stride + lo[None, :]
    cos, sin = rotary.cos + pos * rotary.cos_stride, rotary.sin + pos * rotary.sin_stride
    out_lo, out_hi = _norm_rope(src, mask, weight, cos, sin, eps, HALF)
    dst = out.data + tok * out.token_stride + heads[:, None] * out.head_stride + lo[None, :]
    tl.store(dst, out_lo, mask=mask)
    tl.store(dst + HALF, out_hi, mask=mask)


def normed_rotated(
    x: torch.Tensor, weight: torch.Tensor, eps: float, cos: torch.Tensor, sin: torch.Tensor,
    positions: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    """Triton `reference.normed_rotated_reference` (same arguments and result): one launch, all heads
    of a token per program. Raises ValueError for a call `normed_rotated_refusal` refuses."""
    refusal = normed_rotated_refusal(x, weight, cos, sin, positions)
    if refusal is not None:
        raise ValueError(f"normed_rotated kernel: {refusal}")
    num_tokens, num_heads, head_dim = x.shape
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    _normed_rotated_kernel[(num_tokens,)](
        HeadRows.of(x), HeadRows.of(out), weight, eps, RotaryTables.of(cos, sin), positions, num_heads,
        BLOCK_H=triton.next_power_of_2(num_heads), HALF=head_dim // 2, num_warps=4,
    )  # fmt: skip
    return out


@triton.jit
def _heads_at(rows: LayerHeads, layer, row, heads, lo):
    """Pointers `[heads, lo]` into row `row` (a token or a cache slot) of layer `layer` of `rows`."""
    row_start = rows.data + layer * rows.layer_stride + row * rows.row_stride
    return row_start + heads[:, None] * rows.head_stride + lo[None, :]


@triton.jit
def _store_context_kv_kernel(
    k_raw: LayerHeads, v: LayerHeads, tokens: StoredTokens, key_norm: LayerKeyNorm,
    k_cache: LayerHeads, v_cache: LayerHeads, num_heads,
    BLOCK_H: tl.constexpr, HALF: tl.constexpr,
):  # fmt: skip
    tok = tl.program_id(0).to(tl.int64)
    layer = tl.program_id(1).to(tl.int64)
    slot = tl.load(tokens.slots + tok).to(tl.int64)
    pos = tl.load(tokens.positions + tok).to(tl.int64)
    heads = tl.arange(0, BLOCK_H)
    lo = tl.arange(0, HALF)
    mask = (heads < num_heads)[:, None] & (slot >= 0)
    rotary = key_norm.rotary
    k_lo, k_hi = _norm_rope(
        _heads_at(k_raw, layer, tok, heads, lo), mask, key_norm.weight + layer * key_norm.layer_stride,
        rotary.cos + pos * rotary.cos_stride, rotary.sin + pos * rotary.sin_stride, key_norm.eps, HALF,
    )  # fmt: skip
    k_out = _heads_at(k_cache, layer, slot, heads, lo)
    tl.store(k_out, k_lo.to(k_cache.data.dtype.element_ty), mask=mask)
    tl.store(k_out + HALF, k_hi.to(k_cache.data.dtype.element_ty), mask=mask)
    v_in, v_out = _heads_at(v, layer, tok, heads, lo), _heads_at(v_cache, layer, slot, heads, lo)
    for half in tl.static_range(2):
        value = tl.load(v_in + half * HALF, mask=mask, other=0.0)
        tl.store(v_out + half * HALF, value.to(v_cache.data.dtype.element_ty), mask=mask)


def store_context_kv(tokens: ContextTokens, keys: KeyTransform, cache: KVCache) -> None:
    """Triton `store_context_kv_reference` (same arguments, caches written in place): one launch over
    (token, layer), all kv heads of a token per program. Raises ValueError for a call
    `store_context_kv_refusal` refuses."""
    refusal = store_context_kv_refusal(tokens, keys, cache)
    if refusal is not None:
        raise ValueError(f"store_context_kv kernel: {refusal}")
    k_raw, v, positions, slots = tokens.k_raw, tokens.v, tokens.positions, tokens.slots
    k_cache, v_cache = cache.k, cache.v
    num_layers, num_tokens, num_heads, head_dim = k_raw.shape
    if num_tokens == 0:
        return
    _store_context_kv_kernel[(num_tokens, num_layers)](
        LayerHeads.of(k_raw), LayerHeads.of(v), StoredTokens(positions, slots), LayerKeyNorm.of(keys),
        LayerHeads.of(k_cache), LayerHeads.of(v_cache), num_heads,
        BLOCK_H=triton.next_power_of_2(num_heads), HALF=head_dim // 2, num_warps=4,
    )  # fmt: skip
