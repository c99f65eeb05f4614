"""The Triton `top_k` of short k: one program per row, the row read once in chunks.

Each entry becomes one int64 key that orders it as the reference does: its fp32 value's bits made
order-preserving as a signed int32 (negative values have their magnitude bits flipped) in the high half,
and `2^31 - 1 - index` in the low half, so a larger key is a larger value or, at equal values, a lower
index, and no two keys of a row are equal (-0.0 counts as +0.0, as the reference compares them). A program
keeps the row's best k keys so far in registers (`best`: k distinct keys below every entry's to start,
padded to a power of two with keys above every entry's). Per chunk it counts the chunk's keys above the
k-th best (usually none after the first chunks of real logits) and offers that many (at most k) of the
chunk's largest, largest first, each taking the current k-th best's slot if above it: a max and a min per
offer. The k kept keys are then stored largest first and the values read back from x at their indices
(x's own bits).

`torch.topk` on the GPU runs a radix select and a sort, several launches (30 us for [7, 8192] bf16 on
the H100, RESULTS S27-2); this is one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.topk.reference import TopK

CHUNK = 4096  # entries of a row per inner step (4 warps: 32 a thread)
# below every entry's key (-inf's is about -2^63 + 2^55), with room above it for k distinct starting keys
LOWEST = tl.constexpr(-(2**63) + 1)
HIGHEST = tl.constexpr(2**63 - 1)  # above every entry's key: the padding slots of `best`, never replaced


@triton.jit
def _keys(x, cols, ok):
    """int64 keys of the values `x` (fp32) at indices `cols`, `_LOWEST` where not `ok`."""
    bits = (x + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 is +0.0
    ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # monotone in the value, as a signed int32
    key = (ordered.to(tl.int64) << 32) | (0x7FFFFFFF - cols).to(tl.int64)
    return tl.where(ok, key, LOWEST)


@triton.jit
def _top_k_kernel(x_ptr, values_ptr, indices_ptr, n, stride_x, K: tl.constexpr, K_PAD: tl.constexpr,
                  CHUNK: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    slot = tl.arange(0, K_PAD)
    best = tl.where(slot < K, LOWEST + slot.to(tl.int64), HIGHEST)
    kth = tl.min(best, axis=0)
    for start in range(0, n, CHUNK):
        cols = start + tl.arange(0, CHUNK)
        ok = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
        keys = _keys(x, cols, ok)
        moves = tl.minimum(tl.sum((keys > kth).to(tl.int32), axis=0), K)
        for _ in range(moves):
            top = tl.max(keys, axis=0)
            # keys are distinct: one slot holds the k-th. A move counted against an earlier k-th can
            # fall below the current one (the chunk's largest come first): then it and the rest keep out
            best = tl.where((best == kth) & (top > kth), top, best)
            keys = tl.where(keys == top, LOWEST, keys)
            kth = tl.min(best, axis=0)
    out = row * K
    for i in tl.static_range(K):
        top = tl.max(tl.where(slot < K, best, LOWEST), axis=0)
        index = 0x7FFFFFFF - (top & 0xFFFFFFFF).to(tl.int32)
        tl.store(indices_ptr + out + i, index.to(tl.int64))
        tl.store(values_ptr + out + i, tl.load(x_ptr + row * stride_x + index))
        best = tl.where(best == top, LOWEST, best)


def top_k(x: torch.Tensor, k: int) -> TopK:
    """`reference.top_k` in one launch (rows of x `[..., n]` with a unit last stride; see `refusal`)."""
    n = x.shape[-1]
    rows = x.reshape(-1, n)
    values = torch.empty(rows.shape[0], k, dtype=x.dtype, device=x.device)
    indices = torch.empty(rows.shape[0], k, dtype=torch.int64, device=x.device)
    if rows.shape[0]:
        _top_k_kernel[(rows.shape[0],)](
            rows, values, indices, n, rows.stride(0), K=k, K_PAD=triton.next_power_of_2(k),
            CHUNK=min(CHUNK, triton.next_power_of_2(n)), num_warps=4,
        )  # fmt: skip
    return TopK(values.view(*x.shape[:-1], k), indices.view(*x.shape[:-1], k))
