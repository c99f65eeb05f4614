"""The routed experts of a step of a few tokens (decode, verify blocks: at most `MAX_PAIRS` (token,
choice) pairs) in two launches, reading each distinct expert's weights once.

1. `decode.prologue` with one alignment block per placed expert (`block_m` = T rounded up to a power of
   two ≥ any expert's pair count): router logits, x quantised (FP8), routing, and block b = the b-th
   placed expert in id order with its pairs, for min(E, T·k) blocks (the bound of distinct experts).
2. `_experts_kernel`: program (b, s) takes block b's expert and slice s of `SLICE` = 128 intermediate
   columns. For every token routed to that expert (chunks of `BLOCK_M` pairs, one chunk up to 16
   tokens) it computes h = SiLU(min(x·W_gateᵀ, L))·clamp(x·W_upᵀ, ±L) for the slice (FP8: quantised per
   row, the slice being one 128-group, as the general path's gate|up epilogue does), then for each
   128-column tile of D the weighted partial row w·(h·W_down[:, slice]ᵀ) in fp32 to
   `partial [T·k, slices, D]` at its pair's row. The expert's tokens share one read of its weights: the
   gate|up rows of the slice (2·128·D) and the down columns (D·128).

Combine, deterministic: after storing a tile of its pairs' partial rows, a program takes a ticket per
(token, column tile) of its rows; the program that brings a counter to (the token's placed pairs) ×
slices, the last to write that token's tile, sums the token's partial rows of the tile in a fixed order
(choices in order, each choice's slices by one `tl.sum`), writes the tile of `out` in x's dtype and puts
the counter back to zero. Every token's tile is summed once, by whichever program arrives last, in the
same order, so two runs give the same bits (fp32 atomics would add in arrival order). The tickets spread
the sums over the programs as they finish their tiles instead of leaving them to one last program.

Invariants (safe to use when): the tickets of the stream (`decode.tickets`) are zero at launch and left
zero (graph replays work); the grid is min(E, T·k) × slices whatever the routing, blocks past the
placed experts exit at once (a CUDA graph captures a fixed grid); at expert parallelism
(`first_expert`), pairs of other ranks' experts are never computed, and a token none of whose experts
is this rank's gets a zero row (written by the program of its index modulo the grid).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.moe import decode, kernels
from hylo.ops.moe.kernels import ExpertMatrix, Rows, quantize_swiglu, swiglu_tile
from hylo.ops.moe.reference import Routing
from hylo.ops.moe.routing import Alignment, placed_experts

MAX_PAIRS = decode.PROLOGUE_PAIRS  # 64 tokens at top-8
SLICE = FP8_BLOCK  # intermediate columns per program: one weight scale block, one activation group
BLOCK_M = 16  # pairs per chunk: the smallest tensor-core tile
BLOCK_N = FP8_BLOCK  # columns of D per down tile and per ticket: one weight scale block
NUM_WARPS = 4


def gate_up_steps(weight_bytes: int) -> tuple[int, int]:
    """(depth of a gate|up step, pipeline stages) for weights of `weight_bytes` bytes an element: a stage
    holds a [16, depth] x tile and a [depth, 256] weight tile. FP8 takes 128-deep steps (one scale
    block, 105 KB of shared memory in 4 stages, 255 registers, no spills compiled offline for sm_90a);
    wider weights 64-deep ones (bf16: 92 bytes of spills, 416 at 128-deep steps), fp32 in 2 stages
    (shared memory)."""
    if weight_bytes == 1:
        return FP8_BLOCK, 4
    return 64, 4 if weight_bytes == 2 else 2


def fits(tokens: int, top_k: int, hidden: int) -> bool:
    """Whether a step of `tokens` tokens takes this path (its tickets fit the stream's counters)."""
    return tokens * top_k <= MAX_PAIRS and tokens * triton.cdiv(hidden, BLOCK_N) <= decode.TICKET_SLOTS


@triton.jit
def _placed_counts(ids_ptr, token, ok, first_expert, num_experts, TOP_K: tl.constexpr, K_PAD: tl.constexpr):
    """Pairs of tokens `token` (`ok`: real ones) whose global expert lies in [first_expert, first_expert +
    num_experts)."""
    j = tl.arange(0, K_PAD)
    pair = token[:, None] * TOP_K + j[None, :]
    _, placed = placed_experts(ids_ptr, pair, ok[:, None] & (j < TOP_K)[None, :], first_expert, num_experts)
    return tl.sum(placed.to(tl.int32), axis=1)


@triton.jit
def _zero_unplaced_tokens(
    ids_ptr, out_ptr, num_tokens, first_expert, num_experts, stride_o,
    D: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
):  # fmt: skip
    """Zero rows of `out` for the tokens of this program (index ≡ program id modulo the grid) with no pair
    on this rank's experts: no program computes anything for them."""
    n = tl.arange(0, BLOCK_N)
    for t in range(tl.program_id(0), num_tokens, tl.num_programs(0)):
        token = t + tl.zeros([1], tl.int32)
        if tl.sum(_placed_counts(ids_ptr, token, token >= 0, first_expert, num_experts, TOP_K, K_PAD)) == 0:
            for n0 in range(0, D, BLOCK_N):
                dst = out_ptr + t * stride_o + n0 + n  # t < 64 tokens: no int32 overflow
                tl.store(dst, tl.zeros([BLOCK_N], out_ptr.dtype.element_ty), mask=n0 + n < D)


@triton.jit
def _sum_token_tile(
    partial_ptr, ids_ptr, out_ptr, t, n, first_expert, num_experts, stride_o,
    D: tl.constexpr, TOP_K: tl.constexpr, SLICES: tl.constexpr, S_PAD: tl.constexpr, BLOCK_N: tl.constexpr,
    PARTIAL: tl.constexpr,
):  # fmt: skip
    """Token t's columns `n` of `out`: Σ over its placed choices (in order) of Σ over the slices (one
    `tl.sum`) of its partial rows, fp32, in x's dtype. The rows are read past this SM's L1 (`.cg`): other
    programs of the launch wrote them."""
    s = tl.arange(0, S_PAD)
    total = tl.zeros([BLOCK_N], tl.float32)
    for j in tl.static_range(TOP_K):
        pair = t * TOP_K + j
        ok = s < SLICES
        if PARTIAL:
            local = tl.load(ids_ptr + pair).to(tl.int32) - first_expert
            ok = ok & (local >= 0) & (local < num_experts)
        rows = partial_ptr + (pair * SLICES + s).to(tl.int64)[:, None] * D + n[None, :]
        tile = tl.load(rows, mask=ok[:, None] & (n < D)[None, :], other=0.0, cache_modifier=".cg")
        total += tl.sum(tile, axis=0)
    tl.store(out_ptr + t.to(tl.int64) * stride_o + n, total.to(out_ptr.dtype.element_ty), mask=n < D)


@triton.jit
def _experts_kernel(
    x: Rows, gate_up: ExpertMatrix, down: ExpertMatrix, layout: Alignment, ids_ptr, weights_ptr, partial_ptr,
    out_ptr, tickets_ptr, num_tokens, first_expert, num_experts, limit, capacity, stride_o,
    D: tl.constexpr, INTER: tl.constexpr, TOP_K: tl.constexpr, K_PAD: tl.constexpr,
    SLICE: tl.constexpr, SLICES: tl.constexpr, S_PAD: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    """Program (block, slice) of the module docstring; `layout` holds one block per placed expert
    (`capacity` slots each). FP8: SLICE and BLOCK_N are 128, so a down tile lies in one weight scale block."""
    pid = tl.program_id(0)
    block, s = pid // SLICES, pid % SLICES
    if PARTIAL:
        _zero_unplaced_tokens(
            ids_ptr, out_ptr, num_tokens, first_expert, num_experts, stride_o, D, TOP_K, K_PAD, BLOCK_N
        )
    expert = tl.load(layout.block_expert + block)
    if expert >= 0:
        rows = tl.load(layout.block_rows + block)
        i = s * SLICE + tl.arange(0, SLICE)  # this slice's intermediate columns
        w_cols = down.w + expert.to(tl.int64) * down.stride_e + i[:, None]
        w_scales = down.scale + expert * down.scale_stride_e + (s * SLICE) // 128
        num_tiles: tl.constexpr = (D + BLOCK_N - 1) // BLOCK_N
        for c0 in range(0, rows, BLOCK_M):
            m = c0 + tl.arange(0, BLOCK_M)
            row_ok = m < rows
            pair = tl.load(layout.pairs + block * capacity + m, mask=row_ok, other=0)
            token = pair // TOP_K
            h, i_ok = swiglu_tile(
                x.data + token.to(tl.int64)[:, None] * x.stride, x.scale + token * x.scale_stride, gate_up,
                expert, s, row_ok, limit, INTER, D, BLOCK_M, SLICE, BLOCK_K, FP8,
            )  # fmt: skip
            if FP8:
                q, h_scale = quantize_swiglu(h, i_ok, BLOCK_M, SLICE, SLICE)  # the slice is one group
                a = q.to(down.w.dtype.element_ty)
                a_scale = tl.reshape(h_scale, [BLOCK_M])
            else:
                a = h.to(x.data.dtype.element_ty)  # h in x's dtype, as the general path stores it
            weight = tl.load(weights_ptr + pair, mask=row_ok, other=0.0)
            expected = SLICES * _placed_counts(
                ids_ptr, token, row_ok, first_expert, num_experts, TOP_K, K_PAD
            )
            # The tickets keep the compiler from pipelining this loop: each tile's weights are loaded
            # one tile ahead by hand, so their latency hides behind the previous tile's work.
            n = tl.arange(0, BLOCK_N)
            w_ok = i_ok[:, None] & (n < D)[None, :]
            w_next = tl.load(w_cols + n[None, :] * down.stride_n, mask=w_ok, other=0.0)
            for tile in range(0, num_tiles):
                w = w_next
                n_next = n + BLOCK_N  # past D after the last tile: masked off, nothing is read
                w_ok = i_ok[:, None] & (n_next < D)[None, :]
                w_next = tl.load(w_cols + n_next[None, :] * down.stride_n, mask=w_ok, other=0.0)
                y = tl.dot(a, w)
                if FP8:
                    w_scale = tl.load(w_scales + (tile * BLOCK_N) // 128 * down.scale_stride_n)
                    y = y * (a_scale[:, None] * w_scale)
                y = y * weight[:, None]
                dst = partial_ptr + (pair * SLICES + s).to(tl.int64)[:, None] * D + n[None, :]
                tl.store(dst, y, mask=row_ok[:, None] & (n < D)[None, :])
                tl.debug_barrier()  # the tile's rows are stored before its tickets release them
                ticket = tickets_ptr + token * num_tiles + tile
                last = row_ok & (tl.atomic_add(ticket, 1, mask=row_ok, sem="acq_rel") == expected - 1)
                if tl.max(last.to(tl.int32), axis=0) > 0:  # rare: a token's tile is complete
                    for r in range(0, BLOCK_M):
                        pick = tl.arange(0, BLOCK_M) == r
                        if tl.max((pick & last).to(tl.int32), axis=0) > 0:
                            t = tl.sum(tl.where(pick, token, 0), axis=0)
                            _sum_token_tile(
                                partial_ptr, ids_ptr, out_ptr, t, n, first_expert, num_experts, stride_o,
                                D, TOP_K, SLICES, S_PAD, BLOCK_N, PARTIAL,
                            )  # fmt: skip
                            tl.store(tickets_ptr + t * num_tiles + tile, 0)
                n = n_next


def routed_experts(
    x: torch.Tensor,
    routing: Routing,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    first_expert: int | None = None,
) -> torch.Tensor:
    """`hylo.ops.moe.routed_experts` for at most `MAX_PAIRS` pairs in two launches (module docstring):
    gate_up `[E, 2I, D]`, down `[E, D, I]` in x's dtype, or FP8 e4m3 with `scales` = (gate_up_scale_inv,
    down_scale_inv); `first_expert`: the global id of the weights' first expert (None: all of them)."""
    tokens, hidden = x.shape
    top_k = routing.top_k
    if not fits(tokens, top_k, hidden):
        raise ValueError(
            f"fused.routed_experts: x has {tokens} tokens, more than {MAX_PAIRS // top_k} at top-{top_k} "
            f"or {decode.TICKET_SLOTS // triton.cdiv(hidden, BLOCK_N)} at D {hidden}"
        )
    gate_up_scale, down_scale = scales if scales is not None else (None, None)
    pairs_shape = torch.empty(tokens, top_k, device="meta")  # the ids and weights the prologue makes
    kernels.check_weights(x, gate_up, gate_up_scale, down, down_scale, pairs_shape, pairs_shape)
    fp8, local, intermediate = scales is not None, gate_up.shape[0], down.shape[2]
    capacity = triton.next_power_of_2(tokens)  # ≥ any expert's pairs: one block per placed expert
    ids, weights, layout, q, q_scale = decode.prologue(
        x, routing, capacity, fp8, first_expert=first_expert, num_experts=local,
        num_blocks=min(local, tokens * top_k),
    )  # fmt: skip
    out = torch.empty(tokens, hidden, dtype=x.dtype, device=x.device)
    if tokens == 0:
        return out
    slices = triton.cdiv(intermediate, SLICE)
    block_k, num_stages = gate_up_steps(gate_up.element_size())
    _experts_kernel[(layout.block_expert.numel() * slices,)](
        Rows.of(x.contiguous(), None) if q is None else Rows.of(q, q_scale),
        ExpertMatrix.of(gate_up, gate_up_scale),
        ExpertMatrix.of(down, down_scale),
        layout,
        ids,
        weights,
        torch.empty(tokens * top_k * slices * hidden, dtype=torch.float32, device=x.device),  # partial
        out,
        decode.tickets(x.device),
        tokens,
        first_expert or 0,
        local,
        float(limit),
        capacity,
        out.stride(0),
        D=hidden,
        INTER=intermediate,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        SLICE=SLICE,
        SLICES=slices,
        S_PAD=triton.next_power_of_2(slices),
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        BLOCK_K=block_k,
        FP8=fp8,
        PARTIAL=first_expert is not None,
        num_warps=NUM_WARPS,
        num_stages=num_stages,
    )
    return out
