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
from hylo.ops.indexer.reference import KeyNorm, PooledKeys, Selection, SlotLayout, TokenKeys

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
def _store_tokens_kernel(
    key_ptr,
    stride_key,
    gate_ptr,
    stride_gate,
    weight_ptr,
    bias_ptr,
    eps,
    slots_ptr,
    keys_ptr,
    stride_keys,
    gates_ptr,
    stride_gates,
    D: tl.constexpr,
    PDL: tl.constexpr,
):
    """One token: LayerNorm of its key (fp32 statistics and affine, the output rounded to the key's
    dtype, as torch's) into `keys[slot]`, its gate scores copied into `gates[slot]`."""
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slots_ptr + t).to(tl.int64)
    d = tl.arange(0, D)
    x = tl.load(key_ptr + t * stride_key + d).to(tl.float32)
    mean = tl.sum(x, 0) / D
    centred = x - mean
    rstd = 1.0 / tl.sqrt(tl.sum(centred * centred, 0) / D + eps)
    y = centred * rstd * tl.load(weight_ptr + d).to(tl.float32) + tl.load(bias_ptr + d).to(tl.float32)
    y = y.to(key_ptr.dtype.element_ty)
    tl.store(keys_ptr + slot * stride_keys + d, y.to(keys_ptr.dtype.element_ty))
    gate = tl.load(gate_ptr + t * stride_gate + d)
    tl.store(gates_ptr + slot * stride_gates + d, gate.to(gates_ptr.dtype.element_ty))


@triton.jit
def _compress_kernel(
    keys_ptr,
    stride_k,
    gates_ptr,
    stride_g,
    ape_ptr,
    stride_a,
    pools_ptr,
    pooled_ptr,
    scale_ptr,
    stride_p,
    KPOOL: tl.constexpr,
    KPOOL_PAD: tl.constexpr,
    D: tl.constexpr,
    FP8: tl.constexpr,
    PDL: tl.constexpr,
):
    """One pool: its members' gates and keys as one [kpool, D] tile each, loaded at once. (The pool's
    members walked one by one, unrolled, made 4.7k instructions: at decode this one-program launch
    then waited on instruction fetches, 15 us on an H100.)"""
    enter(PDL)
    pool = tl.load(pools_ptr + tl.program_id(0)).to(tl.int64)
    j = tl.arange(0, KPOOL_PAD)
    d = tl.arange(0, D)
    member = (pool * KPOOL + j)[:, None]
    live = (j < KPOOL)[:, None]
    g = tl.load(gates_ptr + member * stride_g + d[None, :], mask=live, other=0.0).to(tl.float32)
    g += tl.load(ape_ptr + j[:, None] * stride_a + d[None, :], mask=live, other=0.0).to(tl.float32)
    g = tl.where(live, g, float("-inf"))
    k = tl.load(keys_ptr + member * stride_k + d[None, :], mask=live, other=0.0).to(tl.float32)
    e = tl.exp(g - tl.max(g, axis=0)[None, :])
    # Round to the key dtype first: an FP8 pool quantises the value a bf16 pool would have stored.
    pooled = (tl.sum(e * k, axis=0) / tl.sum(e, axis=0)).to(keys_ptr.dtype.element_ty).to(tl.float32)
    dst = pooled_ptr + pool * stride_p + d
    if FP8:
        scale = _pow2_scale(tl.max(tl.abs(pooled), axis=0))
        tl.store(dst, (pooled / scale).to(pooled_ptr.dtype.element_ty))
        tl.store(scale_ptr + pool, scale)
    else:
        tl.store(dst, pooled.to(pooled_ptr.dtype.element_ty))


@triton.jit(do_not_specialize=["tok_lo", "tok_hi"])  # one compile serves every rank's range
def _score_kernel(
    q_ptr,
    stride_qt,
    stride_qh,
    w_ptr,
    stride_wt,
    k_ptr,
    ks_ptr,
    stride_k,
    pool_table_ptr,
    stride_pb,
    positions_ptr,
    pad_index_ptr,
    pad_valid_ptr,
    stride_xb,
    max_new,
    out_ptr,
    stride_ot,
    num_pools,
    kpool,
    tok_lo,
    tok_hi,
    H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_T: tl.constexpr,
    BLOCK_P: tl.constexpr,
    FP8: tl.constexpr,
    POOLS_MAJOR: tl.constexpr,
    FP8_ACC_K: tl.constexpr,
    PDL: tl.constexpr,
):
    """logits[t - tok_lo, p] = sum_h w[t,h] relu(q[t,h] . k[p]) for BLOCK_T new tokens of sequence b
    (one program) and every pool p visible to one of them, packed tokens t in [tok_lo, tok_hi) alone
    (a program holding none reads no pool); -inf at pools a token cannot see."""
    enter(PDL)
    b = tl.program_id(0)
    first = tl.program_id(1) * BLOCK_T
    M: tl.constexpr = BLOCK_T * H
    r = tl.arange(0, M)
    row_step = first + r // H
    row_ok = tl.load(pad_valid_ptr + b * stride_xb + row_step, mask=row_step < max_new, other=0) != 0
    row_tok = tl.load(pad_index_ptr + b * stride_xb + row_step, mask=row_ok, other=0).to(tl.int64)
    row_ok &= (row_tok >= tok_lo) & (row_tok < tok_hi)
    d = tl.arange(0, D)
    q = tl.load(
        q_ptr + row_tok[:, None] * stride_qt + (r % H)[:, None] * stride_qh + d[None, :], mask=row_ok[:, None]
    )
    w = tl.load(w_ptr + row_tok * stride_wt + r % H, mask=row_ok, other=0.0).to(tl.float32)
    if FP8:
        q_scale = _pow2_scale(tl.max(tl.abs(q.to(tl.float32)), axis=1))
        q = (q.to(tl.float32) / q_scale[:, None]).to(tl.float8e4nv)
        w = w * q_scale

    step = first + tl.arange(0, BLOCK_T)
    tok_ok = tl.load(pad_valid_ptr + b * stride_xb + step, mask=step < max_new, other=0) != 0
    tok = tl.load(pad_index_ptr + b * stride_xb + step, mask=tok_ok, other=0).to(tl.int64)
    tok_ok &= (tok >= tok_lo) & (tok < tok_hi)
    visible = tl.where(tok_ok, (tl.load(positions_ptr + tok, mask=tok_ok, other=0) + 1) // kpool, 0)
    n_visible = tl.max(visible, axis=0)
    for p0 in range(0, n_visible, BLOCK_P):
        pools = p0 + tl.arange(0, BLOCK_P)
        pool_ok = pools < n_visible
        slot = tl.load(pool_table_ptr + b * stride_pb + pools, mask=pool_ok, other=0).to(tl.int64)
        k = tl.load(k_ptr + slot[:, None] * stride_k + d[None, :], mask=pool_ok[:, None], other=0.0)
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
            logits = logits * tl.load(ks_ptr + slot, mask=pool_ok, other=0.0)[None, :]
        logits = tl.where(pools[None, :] < visible[:, None], logits, float("-inf"))
        tl.store(
            out_ptr + (tok - tok_lo)[:, None] * stride_ot + pools[None, :],
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
    logits_ptr,
    stride_lt,
    positions_ptr,
    seq_ptr,
    rows_ptr,
    pool_table_ptr,
    stride_pb,
    req_to_token_ptr,
    stride_rt,
    out_ptr,
    stride_ot,
    k_pools,
    width,
    KPOOL: tl.constexpr,
    TAIL: tl.constexpr,
    BLOCK: tl.constexpr,
    ONE_TILE: tl.constexpr,
    BLOCK_W: tl.constexpr,
    RADIX: tl.constexpr,
    PDL: tl.constexpr,
):
    enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + t)
    b = tl.load(seq_ptr + t).to(tl.int64)
    visible = (pos + 1) // KPOOL
    row = logits_ptr + t * stride_lt
    offs = tl.arange(0, BLOCK)
    out_row = out_ptr + t * stride_ot
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
        slot = tl.load(pool_table_ptr + b * stride_pb + p, mask=sel, other=0).to(tl.int32)
        for i in tl.static_range(KPOOL):
            tl.store(out_row + dest * KPOOL + i, slot * KPOOL + i, mask=sel)
        n_sel += tl.sum(sel.to(tl.int32), axis=0)
    n_rows = n_sel * KPOOL
    if TAIL:
        j = tl.arange(0, KPOOL)
        tail_pos = visible * KPOOL + j
        tail_ok = (j < KPOOL - 1) & (tail_pos <= pos)
        tail_row = tl.load(rows_ptr + t)
        slot = tl.load(req_to_token_ptr + tail_row * stride_rt + tail_pos, mask=tail_ok, other=0).to(tl.int32)
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
        key, key.stride(0), gate_scores, gate_scores.stride(0), norm.weight, norm.bias, norm.eps, slots,
        cache.keys, cache.keys.stride(0), cache.gates, cache.gates.stride(0),
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
        keys, keys.stride(0), gates, gates.stride(0), ape, ape.stride(0), pools,
        pooled, pooled_scale if fp8 else pooled, pooled.stride(0),
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
    max_new = pad_index.shape[1]
    pad_valid = pad_valid.view(torch.uint8) if pad_valid.dtype == torch.bool else pad_valid
    grid = (batch, triton.cdiv(max_new, block_t))
    dependent = dependent_launches(q.device)
    _score_kernel[grid](
        q, q.stride(0), q.stride(1), head_weights, head_weights.stride(0),
        pooled, pooled_scale if fp8 else pooled, pooled.stride(0), pool_table, pool_table.stride(0),
        positions, pad_index, pad_valid, pad_index.stride(0), max_new, out, out.stride(0),
        num_pools, kpool, tokens.start, tokens.stop,
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
        logits, logits.stride(0), positions, token_seq, token_rows, pool_table, pool_table.stride(0),
        req_to_token, req_to_token.stride(0), out, out.stride(0), topk // kpool, width,
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
