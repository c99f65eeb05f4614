"""Triton routing and token permutation of the MoE, with no GPU→CPU synchronisation.

`route`: router logits by one cuBLAS GEMM (fp32 output from bf16 inputs), then one kernel per block
of tokens: sigmoid, correction bias, group-limited choice, top-k by repeated arg-max (lowest index
first on ties), normalisation and scaling.

`align`: the (token, choice) pairs sorted by expert, each expert's run padded to the GEMM's
`block_m`; given the global id of the first expert the weights hold, only the pairs of the weights'
experts are placed (a rank of expert parallelism), numbered from 0. Counts and offsets live on the
device: an atomic increment per pair gives its rank within its expert (so the order inside an
expert is arbitrary, which changes nothing: every GEMM row is computed and written on its own), and
per-expert block offsets come from a cumulative sum over the counts that every placing program
recomputes. The number of blocks is only known on the
device, so the arrays are sized by the bound cdiv(T·k, block_m) + min(E, T·k); blocks past the real
count get expert -1 and their GEMM programs return at once.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from hylo.ops.moe.operands import ExpertBlocks
from hylo.ops.moe.reference import Choices, Routing

# Up to this many pairs (decode and verify batches) one program counts and places them, one launch
# instead of a fill and two launches, holding every pair and block in one vector.
SMALL_PAIRS = 256
CHUNK = 32  # pairs or blocks per step of the placing loops: a [CHUNK, E_PAD] one-hot stays in registers


# `block_expert` of the shared expert's blocks, which only the decode path places (`decode.prologue` with
# the shared expert): negative, so kernels launched without the shared expert's weights skip them.
SHARED_EXPERT = tl.constexpr(-2)


class Alignment(NamedTuple):
    """`pairs [num_blocks·block_m]`: pair index t·k + j per row (rows past an expert's count are
    unset); `block_expert [num_blocks]`: expert of each block, -1 past the real count;
    `block_rows [num_blocks]`: valid rows of each block. With the shared expert (decode only), its
    blocks come first: `block_expert` `SHARED_EXPERT`, token t's pair index T·k + t in slot t."""

    pairs: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    block_m: int


def max_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Upper bound of Σ_e cdiv(count_e, block_m): at most min(E, pairs) experts have a partial block."""
    return triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)


# ---------------------------------------------------------------- routing


@triton.jit
def choose_experts(
    logits_ptr,
    bias_ptr,
    t,
    t_ok,
    scaling,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORMALIZE: tl.constexpr,
):
    """(ids int64, weights fp32, valid) `[len(t), K_PAD]` of tokens `t` from their fp32 logits
    `[T, E]`: the routing of `reference.route`. The logits are read past this SM's L1 (`.cg`): the
    decode prologue reads logits that other programs of its launch wrote."""
    e = tl.arange(0, E_PAD)
    e_ok = e < E
    rows = logits_ptr + t[:, None] * E
    logits = tl.load(rows + e[None, :], mask=t_ok[:, None] & e_ok[None, :], other=0.0, cache_modifier=".cg")
    biased = tl.sigmoid(logits) + tl.load(bias_ptr + e, mask=e_ok, other=0.0)[None, :]
    biased = tl.where(e_ok[None, :], biased, float("-inf"))
    if N_GROUP > 1:
        group_of = e // (E // N_GROUP)
        g = tl.arange(0, G_PAD)
        strength = tl.full([t.shape[0], G_PAD], float("-inf"), tl.float32)
        for group in tl.static_range(N_GROUP):
            members = tl.where((group_of == group)[None, :], biased, float("-inf"))
            first = tl.argmax(members, axis=1)
            second = tl.max(tl.where(e[None, :] == first[:, None], float("-inf"), members), axis=1)
            top_two = tl.max(members, axis=1) + second
            strength = tl.where(g[None, :] == group, top_two[:, None], strength)
        keep = tl.zeros([t.shape[0], E_PAD], tl.int1)
        for _ in tl.static_range(TOPK_GROUP):
            best = tl.argmax(strength, axis=1)
            keep = keep | (group_of[None, :] == best[:, None])
            strength = tl.where(g[None, :] == best[:, None], float("-inf"), strength)
        biased = tl.where(keep, biased, float("-inf"))
    j = tl.arange(0, K_PAD)
    if t.shape[0] == 1:
        # one token (decode): one bitonic top-k of (score, lowest index first) keys. On an H200 it
        # takes one program 2.3 us against 3.4 for TOP_K arg-max reductions, which win from 4 tokens
        # (5.0 against 5.6 us).
        bits = biased.to(tl.int32, bitcast=True)
        ordered = bits ^ ((bits >> 31) & 0x7FFFFFFF)  # signed-integer order of the floats
        keys = ordered.to(tl.int64) * 4294967296 + (E_PAD - 1 - e)[None, :]
        ids = (E_PAD - 1 - (tl.topk(keys, K_PAD) & 0xFFFFFFFF)).to(tl.int64)
    else:
        ids = tl.zeros([t.shape[0], K_PAD], tl.int64)
        # a loop, not unrolled: unrolled, the decode prologue was 7.2k instructions at 8 tokens, and a
        # decode step, which fetches each kernel's code cold, ran it in 34 us against 17 (H100, S33-2)
        for choice in range(TOP_K):
            pick = tl.argmax(biased, axis=1)
            ids = tl.where(j[None, :] == choice, pick.to(tl.int64)[:, None], ids)
            biased = tl.where(e[None, :] == pick[:, None], float("-inf"), biased)
    ok = t_ok[:, None] & (j < TOP_K)[None, :]
    # the chosen scores gathered from the logits (cached) rather than reduced out of the one-hot
    # choice: one load instead of one cross-warp reduction per choice
    chosen = tl.load(rows + ids, mask=ok, other=0.0, cache_modifier=".cg")
    weights = tl.where(ok, tl.sigmoid(chosen), 0.0)  # the padding choices stay out of the sum
    if NORMALIZE:
        weights = weights / (tl.sum(weights, axis=1)[:, None] + 1e-20)
    return ids, weights * scaling, ok


@triton.jit
def route_tokens(
    logits_ptr, bias_ptr, ids_ptr, weights_ptr, t, t_ok, scaling,
    E: tl.constexpr, E_PAD: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr, TOPK_GROUP: tl.constexpr, NORMALIZE: tl.constexpr,
):  # fmt: skip
    """`choose_experts` of tokens `t`, stored at ids / weights `[T, k]`."""
    ids, weights, ok = choose_experts(
        logits_ptr, bias_ptr, t, t_ok, scaling, E, E_PAD, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP, NORMALIZE
    )
    pair = t[:, None] * TOP_K + tl.arange(0, K_PAD)[None, :]
    tl.store(ids_ptr + pair, ids, mask=ok)
    tl.store(weights_ptr + pair, weights, mask=ok)


@triton.jit
def _route_kernel(
    logits_ptr,
    bias_ptr,
    ids_ptr,
    weights_ptr,
    num_tokens,
    scaling,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORMALIZE: tl.constexpr,
    BLOCK_T: tl.constexpr,
):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    route_tokens(
        logits_ptr, bias_ptr, ids_ptr, weights_ptr, t, t < num_tokens, scaling,
        E, E_PAD, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP, NORMALIZE,
    )  # fmt: skip


def router_logits(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """fp32 `x · weightᵀ`; 16-bit operands go to cuBLAS as they are, with an fp32 output."""
    if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == x.dtype:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def check_route(x: torch.Tensor, routing: Routing) -> None:
    """ValueError naming the argument that does not fit `route`'s contract."""
    weight, bias, top_k = routing.weight, routing.correction_bias, routing.top_k
    n_group, topk_group = routing.n_group, routing.topk_group
    num_experts = weight.shape[0]
    if x.ndim != 2 or weight.ndim != 2 or weight.shape[1] != x.shape[1]:
        raise ValueError(
            f"route: x {tuple(x.shape)} and weight {tuple(weight.shape)} must be [T, D] and [E, D]"
        )
    if bias.shape != (num_experts,):
        raise ValueError(f"route: correction_bias {tuple(bias.shape)} must be [{num_experts}]")
    if num_experts % n_group or not 1 <= topk_group <= n_group:
        raise ValueError(
            f"route: n_group {n_group} / topk_group {topk_group} do not split {num_experts} experts"
        )
    if not 1 <= top_k <= topk_group * num_experts // n_group:
        raise ValueError(f"route: top_k {top_k} exceeds the experts of {topk_group} groups")


def choice_constants(
    num_experts: int, top_k: int, n_group: int, topk_group: int, normalize: bool
) -> dict[str, int | bool]:
    """The compile-time arguments of `choose_experts`."""
    return {
        "E": num_experts,
        "E_PAD": triton.next_power_of_2(num_experts),
        "TOP_K": top_k,
        "K_PAD": triton.next_power_of_2(top_k),
        "N_GROUP": n_group,
        "G_PAD": triton.next_power_of_2(n_group),
        "TOPK_GROUP": topk_group,
        "NORMALIZE": normalize,
    }


def route(x: torch.Tensor, routing: Routing) -> Choices:
    """Same contract as `reference.route`: ids int64 `[T, k]`, weights fp32 `[T, k]`."""
    check_route(x, routing)
    num_experts, top_k = routing.weight.shape[0], routing.top_k
    logits = router_logits(x, routing.weight)
    tokens = x.shape[0]
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=x.device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=x.device)
    if tokens == 0:
        return Choices(ids, weights)
    block_t = 4 if num_experts > 128 else 16
    _route_kernel[(triton.cdiv(tokens, block_t),)](
        logits,
        routing.correction_bias.float().contiguous(),
        ids,
        weights,
        tokens,
        float(routing.scaling),
        **choice_constants(num_experts, top_k, routing.n_group, routing.topk_group, routing.normalize),
        BLOCK_T=block_t,
    )
    return Choices(ids, weights)


# ---------------------------------------------------------------- permutation


@triton.jit
def placed_experts(ids_ptr, i, ok, first_expert, num_experts):
    """(expert numbered from the weights' first, whether the pair is placed) of pairs `i` (`ok`: real
    pairs): a pair is placed when its global expert id lies in [first_expert, first_expert +
    num_experts)."""
    # past this SM's L1: the decode prologue places ids that other programs of its launch stored
    expert = tl.load(ids_ptr + i, mask=ok, other=0, cache_modifier=".cg").to(tl.int32) - first_expert
    return expert, ok & (expert >= 0) & (expert < num_experts)


@triton.jit
def _count_chunk(
    ids_ptr, counts_ptr, ranks_ptr, start, num_pairs, first_expert, E: tl.constexpr, CHUNK_SIZE: tl.constexpr
):
    """Each placed pair's rank within its expert: the old value of its expert's counter."""
    i = start + tl.arange(0, CHUNK_SIZE)
    expert, placed = placed_experts(ids_ptr, i, i < num_pairs, first_expert, E)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=placed)
    tl.store(ranks_ptr + i, rank, mask=placed)


@triton.jit
def _expert_blocks(counts_ptr, E: tl.constexpr, E_PAD: tl.constexpr, BLOCK_M: tl.constexpr):
    """Every expert's counts, first and end blocks (`ExpertBlocks`), padded to E_PAD with empty experts."""
    e = tl.arange(0, E_PAD)
    counts = tl.load(counts_ptr + e, mask=e < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(blocks, axis=0)
    return ExpertBlocks(counts, ends - blocks, ends)


@triton.jit
def _place_chunk(
    ids_ptr,
    ranks_ptr,
    layout,
    blocks,
    start,
    num_pairs,
    num_blocks,
    first_expert,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
):
    """Placed pairs start..start+CHUNK to their padded rows of `layout` (`Alignment`), and its blocks
    start..start+CHUNK to their expert, by the experts' `blocks` (`ExpertBlocks`)."""
    e = tl.arange(0, E_PAD)
    i = start + tl.arange(0, CHUNK_SIZE)
    expert, placed = placed_experts(ids_ptr, i, i < num_pairs, first_expert, E)
    first_block = tl.sum(tl.where(e[None, :] == expert[:, None], blocks.starts[None, :], 0), axis=1)
    rank = tl.load(ranks_ptr + i, mask=placed, other=0)
    tl.store(layout.pairs + first_block * BLOCK_M + rank, i.to(tl.int32), mask=placed)

    b = i  # the same chunk indices, now as block numbers
    # the owner of block b is the number of experts whose blocks all end at or before b
    owner = tl.sum((blocks.ends[None, :] <= b[:, None]).to(tl.int32), axis=1)
    owned = e[None, :] == owner[:, None]
    first = tl.sum(tl.where(owned, blocks.starts[None, :], 0), axis=1)
    count = tl.sum(tl.where(owned, blocks.counts[None, :], 0), axis=1)
    rows = tl.minimum(count - (b - first) * BLOCK_M, BLOCK_M)
    real = owner < E
    b_ok = b < num_blocks
    tl.store(layout.block_expert + b, tl.where(real, owner, -1), mask=b_ok)
    tl.store(layout.block_rows + b, tl.where(real, rows, 0), mask=b_ok)


@triton.jit
def _count_kernel(
    ids_ptr, counts_ptr, ranks_ptr, num_pairs, first_expert, E: tl.constexpr, CHUNK_SIZE: tl.constexpr
):
    start = tl.program_id(0) * CHUNK_SIZE
    _count_chunk(ids_ptr, counts_ptr, ranks_ptr, start, num_pairs, first_expert, E, CHUNK_SIZE)


@triton.jit
def _place_kernel(
    ids_ptr,
    ranks_ptr,
    counts_ptr,
    pairs_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_pairs,
    num_blocks,
    first_expert,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK_SIZE: tl.constexpr,
):
    _place_chunk(
        ids_ptr,
        ranks_ptr,
        Alignment(pairs_ptr, block_expert_ptr, block_rows_ptr, BLOCK_M),
        _expert_blocks(counts_ptr, E, E_PAD, BLOCK_M),
        tl.program_id(0) * CHUNK_SIZE,
        num_pairs,
        num_blocks,
        first_expert,
        E,
        E_PAD,
        BLOCK_M,
        CHUNK_SIZE,
    )


@triton.jit
def _align_small_kernel(
    ids_ptr,
    counts_ptr,
    starts_ptr,
    pairs_ptr,
    block_expert_ptr,
    block_rows_ptr,
    num_pairs,
    num_blocks,
    first_expert,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
):
    """Count and place every placed pair in one program, with no one-hot reductions: each pair keeps its
    rank in a register, gathers its expert's first block from `starts` and writes its row, its
    block's expert and row count (the pairs of one block write the same values). Barriers order the
    phases (one CTA sees its own global writes after a barrier)."""
    e = tl.arange(0, E_PAD)
    tl.store(counts_ptr + e, tl.zeros([E_PAD], tl.int32), mask=e < E)
    tl.debug_barrier()
    i = tl.arange(0, PAIRS_PAD)
    expert, ok = placed_experts(ids_ptr, i, i < num_pairs, first_expert, E)
    rank = tl.atomic_add(counts_ptr + expert, 1, mask=ok)
    tl.debug_barrier()
    _, starts, ends = _expert_blocks(counts_ptr, E, E_PAD, BLOCK_M)
    tl.store(starts_ptr + e, starts, mask=e < E)
    b = tl.arange(0, BLOCKS_PAD)
    unused = (b >= tl.max(ends, axis=0)) & (b < num_blocks)
    tl.store(block_expert_ptr + b, tl.full([BLOCKS_PAD], -1, tl.int32), mask=unused)
    tl.store(block_rows_ptr + b, tl.zeros([BLOCKS_PAD], tl.int32), mask=unused)
    tl.debug_barrier()
    first_block = tl.load(starts_ptr + expert, mask=ok, other=0)
    count = tl.load(counts_ptr + expert, mask=ok, other=0)
    tl.store(pairs_ptr + first_block * BLOCK_M + rank, i, mask=ok)
    block = rank // BLOCK_M
    tl.store(block_expert_ptr + first_block + block, expert, mask=ok)
    tl.store(block_rows_ptr + first_block + block, tl.minimum(count - block * BLOCK_M, BLOCK_M), mask=ok)


def align(ids: torch.Tensor, num_experts: int, block_m: int, first_expert: int | None = None) -> Alignment:
    """Sort the pairs of `ids [T, k]` by expert into `block_m`-row blocks (see the module docstring).
    `num_experts` experts are placed: with `first_expert`, the pairs of global experts
    `[first_expert, first_expert + num_experts)` as experts 0.., the others left out of every block;
    None: ids in [0, num_experts), every pair placed."""
    if ids.ndim != 2 or ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"align: ids must be an int32/int64 [T, k] tensor, got {ids.dtype} {tuple(ids.shape)}"
        )
    first_expert = first_expert or 0
    flat = ids.reshape(-1)
    num_pairs = flat.numel()
    num_blocks = max_blocks(num_pairs, num_experts, block_m)
    device = ids.device
    counts = torch.empty(num_experts, dtype=torch.int32, device=device)
    pairs = torch.empty(num_blocks * block_m, dtype=torch.int32, device=device)
    block_expert = torch.empty(num_blocks, dtype=torch.int32, device=device)
    block_rows = torch.empty(num_blocks, dtype=torch.int32, device=device)
    buffers = (pairs, block_expert, block_rows)
    e_pad = triton.next_power_of_2(num_experts)
    if num_pairs <= SMALL_PAIRS:
        bucket = triton.next_power_of_2(num_pairs)  # vectors sized per power of two: few compiled variants
        _align_small_kernel[(1,)](
            flat,
            counts,
            torch.empty(num_experts, dtype=torch.int32, device=device),  # each expert's first block
            *buffers,
            num_pairs,
            num_blocks,
            first_expert,
            E=num_experts,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            PAIRS_PAD=bucket,
            BLOCKS_PAD=triton.next_power_of_2(max_blocks(bucket, num_experts, block_m)),
            num_warps=4,
        )
    else:
        ranks = torch.empty(num_pairs, dtype=torch.int32, device=device)
        counts.zero_()
        _count_kernel[(triton.cdiv(num_pairs, 256),)](
            flat, counts, ranks, num_pairs, first_expert, E=num_experts, CHUNK_SIZE=256
        )
        _place_kernel[(triton.cdiv(max(num_pairs, num_blocks), CHUNK),)](
            flat,
            ranks,
            counts,
            *buffers,
            num_pairs,
            num_blocks,
            first_expert,
            E=num_experts,
            E_PAD=e_pad,
            BLOCK_M=block_m,
            CHUNK_SIZE=CHUNK,
            num_warps=8,
        )
    return Alignment(pairs, block_expert, block_rows, block_m)
