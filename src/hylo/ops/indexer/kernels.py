"""Triton kernels of the DSA k-pool indexer: the new tokens' key norm and cache stores, pool
compression, pool scoring (bf16 or FP8 e4m3 with per-row power-of-two scales) and top-k selection
that writes token-cache slots directly.

Selection is exact: a radix search (2 bits a pass) finds the k-th largest score of each query's
visible pools (its sortable int32 key), every pool above it is taken, and pools equal to it are
taken earliest first, the reference's tie rule. Output rows are compact: the selected pools' slots
(pool order), then the query's own incomplete pool (tail), then -1 up to a width padded to
`pad_to`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.indexer.operands import LayerNorm, PaddedSteps, PoolKeys, PoolTable, TokenPlaces
from hylo.ops.indexer.reference import KeyNorm, PooledKeys, Selection, SlotLayout, TokenKeys
from hylo.ops.operands import HeadRows, Rows

FP8_MAX = 448.0
# Largest pool count one top-k program holds in registers; longer rows are searched tile by tile.
MAX_TOPK_TILE = 8192


@triton.jit
def _pow2_scale(amax):
    """Smallest power of two s with amax / s <= 448 (1 where amax is 0); matches `fp8_row_scale`."""
    bits = (amax / 448.0).to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) + ((bits & 0x7FFFFF) != 0).to(tl.int32)
    scale = (exponent << 23).to(tl.float32, bitcast=True)
    return tl.where(amax > 0, scale, 1.0)


@triton.jit
def _store_tokens_kernel(key, gate, norm, slots, keys, gates, D: tl.constexpr, PDL: tl.constexpr):
    """One token: LayerNorm (`norm`, a `LayerNorm`) of its key (fp32 statistics and affine, the output
    rounded to the key's dtype, as torch's) into `keys[slot]`, its gate scores copied into `gates[slot]`.
    `key`, `gate` `[T, D]` and the caches `keys`, `gates` `[S, D]` are `Rows`; `slots [T]`, the slots."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots + t).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(key.data + t * key.row_stride + d).to(tl.float32)
    mean = tl.sum(x, 0) / D
    centred = x - mean
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / D + norm.eps)
    y = centred * rstd * tl.load(norm.weight + d).to(tl.float32) + tl.load(norm.bias + d).to(tl.float32)
    y = y.to(key.data.dtype.element_ty)
    tl.store(keys.data + slot * keys.row_stride + d, y.to(keys.data.dtype.element_ty))
    x_gate = tl.load(gate.data + t * gate.row_stride + d)
    tl.store(gates.data + slot * gates.row_stride + d, x_gate.to(gates.data.dtype.element_ty))


@triton.jit
def _compress_kernel(
    keys, gates, ape, pools, pooled,
    KPOOL: tl.constexpr, KPOOL_PAD: tl.constexpr, D: tl.constexpr, FP8: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """One pool of `pools` (its id; its members are token slots id·KPOOL + j): the gate-weighted mean of
    its members' keys into `pooled` (`PoolKeys`; FP8: with its scale), from the token caches `keys`, `gates`
    `[S, D]` and the position bias `ape [KPOOL, D]` (`Rows`). Its members' gates and keys are one
    [kpool, D] tile each, loaded at once. (The pool's members walked one by one, unrolled, made 4.7k
    instructions: at decode this one-program launch then waited on instruction fetches, 15 us on an H100.)"""
    enter(PDL)
    pool = tl.load(pools + tl.program_id(0)).to(tl.int64)
    j = tl.arange(0, KPOOL_PAD)
    d = tl.arange(0, D)
    member = (pool * KPOOL + j)[:, None]
    live = (j < KPOOL)[:, None]
    g = tl.load(gates.data + member * gates.row_stride + d[None, :], mask=live, other=0.0).to(tl.float32)
    g += tl.load(ape.data + j[:, None] * ape.row_stride + d[None, :], mask=live, other=0.0).to(tl.float32)
    g = tl.where(live, g, float("-inf"))
    k = tl.load(keys.data + member * keys.row_stride + d[None, :], mask=live, other=0.0).to(tl.float32)
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    # Round to the key dtype first: an FP8 pool quantises the value a bf16 pool would have stored.
    mean = (tl.sum(e * k, axis=0) / tl.sum(e, axis=0)).to(keys.data.dtype.element_ty).to(tl.float32)
    dst = pooled.keys + pool * pooled.row_stride + d
    if FP8:
        scale = _pow2_scale(tl.max(tl.abs(mean), axis=0))
        tl.store(dst, (mean / scale).to(pooled.keys.dtype.element_ty))
        tl.store(pooled.scale + pool, scale)
    else:
        tl.store(dst, mean.to(pooled.keys.dtype.element_ty))


@triton.jit(do_not_specialize=["tok_lo", "tok_hi"])  # one compile serves every rank's range
def _score_kernel(
    queries, weights, pooled, pool_table, positions, padded, out, num_pools, kpool, tok_lo, tok_hi,
    H: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, FP8: tl.constexpr,
    POOLS_MAJOR: tl.constexpr, FP8_ACC_K: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """logits[t - tok_lo, p] = sum_h w[t,h] relu(q[t,h] . k[p]) for BLOCK_T new tokens of sequence b
    (one program) and every pool p visible to one of them, packed tokens t in [tok_lo, tok_hi) alone
    (a program holding none reads no pool); -inf at pools a token cannot see. q `queries [T, H, D]`
    (`HeadRows`), w the head `weights [T, H]` (`Rows`), k the `pooled` keys (`PoolKeys`) of the ids in
    `pool_table` (`PoolTable`); each sequence's tokens found through `padded` (`PaddedSteps`), their
    `positions [T]`; `out [*, num_pools]` is `Rows`."""
    enter(PDL)
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_T
    M: tl.constexpr = BLOCK_T * H
    r = tl.arange(0, M)
    row_step = first + r // H
    row_ok = (
        tl.load(padded.valid + b * padded.seq_stride + row_step, mask=row_step < padded.steps, other=0) != 0
    )
    row_tok = tl.load(padded.index + b * padded.seq_stride + row_step, mask=row_ok, other=0).to(tl.int64)
    row_ok &= (row_tok >= tok_lo) & (row_tok < tok_hi)
    d = tl.arange(0, D)
    q = tl.load(
        queries.data
        + row_tok[:, None] * queries.token_stride
        + (r % H)[:, None] * queries.head_stride
        + d[None, :],
        mask=row_ok[:, None],
    )
    w = tl.load(weights.data + row_tok * weights.row_stride + r % H, mask=row_ok, other=0.0).to(tl.float32)
    if FP8:
        q_scale = _pow2_scale(tl.max(tl.abs(q.to(tl.float32)), axis=1))
        q = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
        w = w * q_scale

    step = first + tl.arange(0, BLOCK_T)
    tok_ok = tl.load(padded.valid + b * padded.seq_stride + step, mask=step < padded.steps, other=0) != 0
    tok = tl.load(padded.index + b * padded.seq_stride + step, mask=tok_ok, other=0).to(tl.int64)
    tok_ok &= (tok >= tok_lo) & (tok < tok_hi)
    visible = tl.where(tok_ok, (tl.load(positions + tok, mask=tok_ok, other=0) + 1) // kpool, 0)
    n_visible = tl.max(visible, axis=0)
    for p0 in range(0, n_visible, BLOCK_P):
        pools = p0 + tl.arange(0, BLOCK_P)
        pool_ok = pools < n_visible
        slot = tl.load(pool_table.ids + b * pool_table.seq_stride + pools, mask=pool_ok, other=0).to(tl.int64)
        k = tl.load(
            pooled.keys + slot[:, None] * pooled.row_stride + d[None, :], mask=pool_ok[:, None], other=0.0
        )
        if POOLS_MAJOR:
            # FP8_ACC_K: promote the tensor cores' FP8 partial sums to fp32 every that many k (0: bf16)
            s = tl.dot(k, tl.trans(q), max_num_imprecise_acc=FP8_ACC_K)  # [BLOCK_P, M]
            s = tl.maximum(s, 0.0) * w[None, :]
            logits = tl.trans(tl.sum(tl.reshape(s, [BLOCK_P, BLOCK_T, H]), axis=2))
        else:
            s = tl.dot(q, tl.trans(k), max_num_imprecise_acc=FP8_ACC_K)  # [M, BLOCK_P]
            s = tl.maximum(s, 0.0) * w[:, None]
            logits = tl.sum(tl.reshape(s, [BLOCK_T, H, BLOCK_P]), axis=1)
        if FP8:  # a pool's power-of-two scale commutes with ReLU: apply it once per pool, exactly
            logits = logits * tl.load(pooled.scale + slot, mask=pool_ok, other=0.0)[None, :]
        logits = tl.where(pools[None, :] < visible[:, None], logits, float("-inf"))
        tl.store(
            out.data + (tok - tok_lo)[:, None] * out.row_stride + pools[None, :],
            logits,
            mask=tok_ok[:, None] & (pools < num_pools)[None, :],
        )


@triton.jit
def _sort_keys(x):
    """int32 keys ordered like the float scores (-0.0 taken as +0.0)."""
    bits = tl.where(x == 0.0, 0.0, x).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _count_at_least(keys, threshold, step, RADIX: tl.constexpr):
    """For j = 1 .. 2^RADIX - 1: how many keys are >= threshold + j*step, packed 21 bits per count."""
    packed = tl.zeros(keys.shape, tl.int64)
    for j in tl.static_range(1, 2**RADIX):
        cand = (threshold + j * step).to(tl.int32)
        packed += (keys >= cand).to(tl.int64) << (21 * (j - 1))
    return tl.sum(packed, axis=0)


@triton.jit
def _topk_kernel(
    logits, places, pool_table, req_to_token, out, k_pools, width,
    KPOOL: tl.constexpr, TAIL: tl.constexpr, BLOCK: tl.constexpr, ONE_TILE: tl.constexpr,
    BLOCK_W: tl.constexpr, RADIX: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    """Packed token t's row of `out [T, width]` (`Rows`; module docstring): the `k_pools` best of its
    visible pools by `logits [T, *]` (`Rows`), their slots from `pool_table` (`PoolTable`), then with
    TAIL its incomplete pool's slots from `req_to_token` (`Rows`); `places` (`TokenPlaces`) says where
    t sits."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(places.positions + t)
    b = tl.load(places.seq + t).to(tl.int64)
    visible = (pos + 1) // KPOOL
    row = logits.data + t * logits.row_stride
    offs = tl.arange(0, BLOCK)
    out_row = out.data + t * out.row_stride
    int_min = -2147483648
    if ONE_TILE:
        keys = tl.where(
            offs < visible, _sort_keys(tl.load(row + offs, mask=offs < visible, other=0.0)), int_min
        )

    # Greedy search, RADIX bits per pass from the top, for the largest threshold with at least k keys
    # >= it, in unsigned offset space (threshold = int_min + accepted digits; masked keys = int_min
    # never count). One pass counts the keys >= each of the 2^RADIX - 1 candidates in one reduction.
    threshold = tl.full([], int_min, tl.int64)
    take_all = visible <= k_pools
    if not take_all:
        step = tl.full([], 2 ** (32 - RADIX), tl.int64)
        for _ in range(32 // RADIX):
            if ONE_TILE:
                packed = _count_at_least(keys, threshold, step, RADIX)
            else:
                packed = tl.zeros([], tl.int64)
                for p0 in range(0, visible, BLOCK):
                    p = p0 + offs
                    x = tl.load(row + p, mask=p < visible, other=0.0)
                    key = tl.where(p < visible, _sort_keys(x), int_min)
                    packed += _count_at_least(key, threshold, step, RADIX)
            digit = 0
            for j in tl.static_range(1, 2**RADIX):  # counts fall with j: the digit is how many reach k
                digit += (((packed >> (21 * (j - 1))) & 0x1FFFFF) >= k_pools).to(tl.int32)
            threshold += digit.to(tl.int64) * step
            step = step >> RADIX
    thr = threshold.to(tl.int32)
    if ONE_TILE:
        above = tl.sum((keys > thr).to(tl.int32), axis=0)
    else:
        above = 0
        for p0 in range(0, visible, BLOCK):
            p = p0 + offs
            x = tl.load(row + p, mask=p < visible, other=0.0)
            above += tl.sum(((_sort_keys(x) > thr) & (p < visible)).to(tl.int32), axis=0)
    ties_left = k_pools - above  # pools equal to the threshold still to take, earliest first

    n_sel = 0
    for p0 in range(0, visible, BLOCK):
        p = p0 + offs
        in_row = p < visible
        if ONE_TILE:
            key = keys
        else:
            key = tl.where(in_row, _sort_keys(tl.load(row + p, mask=in_row, other=0.0)), int_min)
        tie = in_row & (key == thr)
        tie_rank = tl.cumsum(tie.to(tl.int32), axis=0)
        sel = in_row & (take_all | (key > thr) | (tie & (tie_rank <= ties_left)))
        ties_left -= tl.sum(tie.to(tl.int32), axis=0)
        dest = n_sel + tl.cumsum(sel.to(tl.int32), axis=0) - 1
        slot = tl.load(pool_table.ids + b * pool_table.seq_stride + p, mask=sel, other=0).to(tl.int32)
        for i in tl.static_range(KPOOL):
            tl.store(out_row + dest * KPOOL + i, slot * KPOOL + i, mask=sel)
        n_sel += tl.sum(sel.to(tl.int32), axis=0)
    n_rows = n_sel * KPOOL
    if TAIL:
        j = tl.arange(0, KPOOL)
        tail_pos = visible * KPOOL + j
        tail_ok = (j < KPOOL - 1) & (tail_pos <= pos)
        tail_row = tl.load(places.table_rows + t)
        slot = tl.load(
            req_to_token.data + tail_row * req_to_token.row_stride + tail_pos, mask=tail_ok, other=0
        ).to(tl.int32)
        tl.store(out_row + n_rows + j, slot, mask=tail_ok)
        n_rows += tl.sum(tail_ok.to(tl.int32), axis=0)
    for w0 in range(0, width, BLOCK_W):
        c = w0 + tl.arange(0, BLOCK_W)
        tl.store(out_row + c, tl.full([BLOCK_W], -1, tl.int32), mask=(c >= n_rows) & (c < width))


def _is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == torch.float8_e4m3fn


def store_tokens(
    key: torch.Tensor, gate_scores: torch.Tensor, norm: KeyNorm, cache: TokenKeys, slots: torch.Tensor
) -> None:
    """Same contract as `reference.store_tokens`, one launch (one program per token) for its
    LayerNorm and two scattered stores; `key` and `gate_scores` may be column views of a wider
    product (rows strided, unit last stride). The width must be a power of two (128 in GLM-5.3-Flash):
    `store_refusal` says which calls it takes."""
    tokens, dim = key.shape
    if tokens == 0:
        return
    dependent = dependent_launches(key.device)
    _store_tokens_kernel[(tokens,)](
        Rows.of(key), Rows.of(gate_scores), LayerNorm(norm.weight, norm.bias, norm.eps), slots,
        Rows.of(cache.keys), Rows.of(cache.gates),
        D=dim, num_warps=1,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip


def compress_pools(
    keys: torch.Tensor,
    gates: torch.Tensor,
    ape: torch.Tensor,
    pools: torch.Tensor,
    pooled: torch.Tensor,
    pooled_scale: torch.Tensor | None = None,
) -> None:
    """Same contract as the reference, one program a pool; an FP8 `pooled` also writes
    `pooled_scale [S/kpool]`."""
    num_pools = pools.numel()
    if num_pools == 0:
        return
    kpool, dim = ape.shape
    fp8 = _is_fp8(pooled)
    if fp8 and pooled_scale is None:
        raise ValueError("an FP8 pooled-key cache needs its per-pool scale tensor")
    dependent = dependent_launches(keys.device)
    _compress_kernel[(num_pools,)](
        Rows.of(keys), Rows.of(gates), Rows.of(ape), pools, PoolKeys.of(pooled, pooled_scale),
        KPOOL=kpool, KPOOL_PAD=triton.next_power_of_2(kpool), D=dim, FP8=fp8, num_warps=4,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip


def index_scores(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: torch.Tensor,
    pooled_scale: torch.Tensor | None,
    pool_table: torch.Tensor,
    positions: torch.Tensor,
    pad_index: torch.Tensor,
    pad_valid: torch.Tensor,
    kpool: int,
    tokens: range | None = None,
    *,
    block_t: int | None = None,
    block_p: int | None = None,
    pools_major: bool = True,
    fp8_acc_k: int = 128,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """`[T, P]` fp32 scores of the packed queries `q [T, Hi, d]` (weights `[T, Hi]`) against their
    sequence's pools (`pool_table [B, P]`); entries past a token's visible pools are -inf or unwritten
    (never read by `topk_rows`); with `tokens`, those packed tokens' rows alone, `[len(tokens), P]`.
    FP8 when `pooled` is e4m3: q is quantised per (token, head) inside
    the kernel with a power-of-two scale folded into the head weight; the tensor cores' FP8 partial
    sums are promoted to fp32 every `fp8_acc_k` of the d products (>= d: never; the d = 128 products
    of one score are too few for the tensor cores' reduced accumulator precision to matter).
    `pools_major` computes scores transposed (pools x token-heads), which reduces over heads faster."""
    _, heads, dim = q.shape
    tokens = range(q.shape[0]) if tokens is None else tokens
    batch, num_pools = pool_table.shape
    out = torch.empty(len(tokens), num_pools, dtype=torch.float32, device=q.device)
    if num_pools == 0 or len(tokens) == 0:
        return out
    fp8 = _is_fp8(pooled)
    if fp8 and pooled_scale is None:
        raise ValueError("FP8 pooled keys need their per-pool scales")
    block_t = block_t or max(1, 128 // heads)
    block_p = block_p or (64 if fp8 else 128)  # the faster tile of each on H200 (RESULTS.md)
    padded = PaddedSteps.of(pad_index, pad_valid)
    grid = (batch, triton.cdiv(padded.steps, block_t))
    dependent = dependent_launches(q.device)
    _score_kernel[grid](
        HeadRows.of(q), Rows.of(head_weights), PoolKeys.of(pooled, pooled_scale), PoolTable.of(pool_table),
        positions, padded, Rows.of(out), num_pools, kpool, tokens.start, tokens.stop,
        H=heads, D=dim, BLOCK_T=block_t, BLOCK_P=block_p, FP8=fp8, POOLS_MAJOR=pools_major,
        FP8_ACC_K=min(fp8_acc_k, dim) if fp8 else 0, num_warps=num_warps, num_stages=num_stages,
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return out


def row_width(topk: int, kpool: int, tail: bool, pad_to: int = 64) -> int:
    return triton.cdiv(topk + (kpool - 1 if tail else 0), pad_to) * pad_to


def topk_rows(
    logits: torch.Tensor,
    positions: torch.Tensor,
    token_seq: torch.Tensor,
    token_rows: torch.Tensor,
    pool_table: torch.Tensor,
    req_to_token: torch.Tensor,
    kpool: int,
    topk: int,
    tail: bool,
    *,
    pad_to: int = 64,
    radix_bits: int = 2,
    num_warps: int | None = None,
) -> torch.Tensor:
    """Token-cache slots `[T, W]` int32 (W = topk + tail rounded up to `pad_to`): the top
    `topk/kpool` visible pools of each query expanded to their tokens (slot = pool slot * kpool + i),
    then its incomplete pool's tokens (`req_to_token[token_rows[t], .]`), then -1."""
    num_tokens, num_pools = logits.shape
    width = row_width(topk, kpool, tail, pad_to)
    out = torch.empty(num_tokens, width, dtype=torch.int32, device=logits.device)
    if num_tokens == 0:
        return out
    if radix_bits not in (1, 2):
        raise ValueError(f"radix_bits must be 1 or 2, got {radix_bits}")
    block = max(16, triton.next_power_of_2(min(max(num_pools, 1), MAX_TOPK_TILE)))
    dependent = dependent_launches(logits.device)
    _topk_kernel[(num_tokens,)](
        Rows.of(logits), TokenPlaces(positions, token_seq, token_rows), PoolTable.of(pool_table),
        Rows.of(req_to_token), Rows.of(out), topk // kpool, width,
        KPOOL=kpool, TAIL=tail and kpool > 1, BLOCK=block, ONE_TILE=num_pools <= block,
        BLOCK_W=min(1024, triton.next_power_of_2(width)), RADIX=radix_bits,
        num_warps=num_warps or max(4, min(16, block // 1024)),
        PDL=dependent, launch_pdl=dependent,
    )  # fmt: skip
    return out


def select_slots(
    q: torch.Tensor,
    head_weights: torch.Tensor,
    pooled: PooledKeys,
    layout: SlotLayout,
    selection: Selection,
    tokens: range | None = None,
    *,
    pad_to: int = 64,
) -> torch.Tensor:
    """Scoring then top-k: the token-cache slots each packed query attends to, `[T, W]` int32; with
    `tokens`, those packed tokens' alone (`[len(tokens), W]`: the other tokens are neither scored nor
    ranked)."""
    kpool = selection.kpool
    logits = index_scores(
        q, head_weights, pooled.keys, pooled.scale, layout.pool_table, layout.positions, layout.pad_index,
        layout.pad_valid, kpool, tokens,
    )  # fmt: skip
    mine = slice(None) if tokens is None else slice(tokens.start, tokens.stop)
    return topk_rows(
        logits, layout.positions[mine], layout.token_seq[mine], layout.token_rows[mine], layout.pool_table,
        layout.req_to_token, kpool, selection.topk, selection.tail, pad_to=pad_to,
    )  # fmt: skip
