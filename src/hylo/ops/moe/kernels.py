"""Triton grouped-GEMM experts of the MoE, bf16 and FP8 e4m3 block-scaled, with no GPU→CPU sync.

One step: `routing.align` sorts the (token, choice) pairs by expert into `block_m`-row blocks; the
gate|up GEMM gathers each block's token rows of x, computes the matching gate and up tiles of the
block's expert and writes SiLU(min(gate, L))·clamp(up, ±L) per padded row; the down GEMM reads those
rows, multiplies each by its routing weight and writes it to its pair's row of a `[T·k, D]` buffer;
summing the k rows of a token (a fixed order) makes the combine deterministic. For a few tokens
(`decode`), `down_combine_stage` sums them in the down launch itself.

Expert parallelism: the weights hold global experts `[first_expert, first_expert + E)` and the ids
are global. Only the pairs of those experts are placed (`align`), so the GEMMs compute nothing for the
others; their rows of the `[T·k, D]` buffer stay unset, and the combine (`combine`, or the one in
`down_combine_stage`) reads the ids and sums only the placed rows. Without `first_expert` the ids
index the weights, every pair is placed and the k rows are summed as they are.

FP8: weights stay e4m3 with fp32 `scale_inv [E, ceil(N/128), ceil(K/128)]`; activations are
quantised per token and group of 128 channels (x by a small kernel, once per token; the SwiGLU
output in the gate|up epilogue, whose tile holds whole groups). Each 128-deep K step multiplies its
partial product by the activation scale of the rows and the weight scale of the columns, whose loads
are issued one step ahead. (Quantising the activation tiles inside the GEMMs instead, to save the x
launch, measured 2.8x slower at decode on an H200: 210 against 74 us for one token.)

The kernels take their operands as bundles (`operands`: NamedTuples, which Triton passes as tuples and
specialises field by field as it would flat arguments): activation rows `Rows`, expert weights `Weights`, the
`routing.Alignment`, the routing's `Choices`.

Large FP8 batches (`MoeConfig.tma`) gather the quantised x into the alignment's row order once, so both
GEMMs load whole activation and weight tiles through TMA descriptors. (Gluon versions of the down GEMM, with
two products in flight or warp-specialised with a TMA producer and two consumer warpgroups, on 64- or 128-row
blocks, gave the same bits at 522-594 TFLOP/s against this kernel's 624-653 on the H200: session 7.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.dispatch import use_kernel
from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.fp8.kernels import group_scale, quantize_groups, quantize_rows, round_to_e4m3
from hylo.ops.moe import grouped_cuda
from hylo.ops.moe.operands import ExpertIds, Matrix, Rows, Weights
from hylo.ops.moe.reference import Choices, ExpertWeights, SharedExpert
from hylo.ops.moe.routing import SHARED_EXPERT, Alignment, align, placed_experts


@dataclass(frozen=True)
class Tiles:
    """Launch parameters of one grouped GEMM."""

    block_n: int
    block_k: int
    num_warps: int
    num_stages: int
    # K split of the gate|up GEMM (decode, `_gate_up_kernel`): each tile's K steps over this many programs,
    # summed by the last to finish in a fixed order; 1 elsewhere
    splits: int = 1
    # the product as weightᵀ-major (`_expert_product`): the weight tile's columns are the MMA's rows, so a
    # block of 16 activation rows is its N and FP8 x FP8 runs as Hopper's wgmma on both e4m3 operands,
    # where 16 rows as the MMA's M take mma.sync and widen every weight element to fp16 first
    swap_ab: bool = False


@dataclass(frozen=True)
class MoeConfig:
    """`block_m` is shared by both GEMMs (it is the alignment's block); `group_m` blocks of rows are
    walked together so their weight tiles stay in L2.

    `tma` (FP8, I a multiple of 128): the quantised x is first gathered into the alignment's row order,
    so that both GEMMs read whole tiles of activations and weights through TMA descriptors; each tile
    of `block_n` ≤ 128 columns then lies in one weight scale block, and its K steps scale by the rows'
    scales times one weight scale (gate|up: a gate and an up tile, `block_n` = 128, two products)."""

    block_m: int
    gate_up: Tiles
    down: Tiles
    group_m: int = 8
    tma: bool = False


def default_config(
    num_pairs: int, num_experts: int, fp8: bool, tma: bool = True, element_size: int = 2
) -> MoeConfig:
    """Decode-sized batches (≤ 16 rows per expert on average) take 16-row blocks: the GEMMs stream
    weights. Larger ones take 64-row blocks (half the padding of 128 rows; the FP8 gate|up kernel's
    two accumulators and per-K-step partial products spill registers at 128 rows on H100/H200).

    Measured on an H200 at GLM-5.3-Flash shapes (288 experts, top-8, D 4096, I 2048): FP8 decode
    takes 74 us for one token and 678 us for 16 (gate|up 64-wide tiles, 6 stages, 8 warps or down
    32/128-wide tiles were all slower); FP8 prefill of 8192 tokens 7.34 ms with 4 gate|up stages,
    within noise of 5 stages (7.33 ms), 3 stages 7.38 ms. Where the weights allow it (`tma`: see
    `MoeConfig.tma`), FP8 prefill runs the TMA kernels, bit for bit the same output: 6.21 ms against
    7.51 in the same run (S6-10; with 8-warp down tiles 6.34, 128-row blocks 7.16-8.48).

    FP8 decode tiles multiply weight-major (`Tiles.swap_ab`): native e4m3 wgmma, where 16 rows as the MMA's
    M took mma.sync on weights widened to fp16 (sm_90a builds: gate|up 255 -> 168 registers, down 80 -> 64,
    no spills). H100, the decode step with each product's own split rule (`decode.gate_up_splits`), us:
    TP1 one token 100.0 -> 95.7, 8 tokens 518 -> 509; a TP8 rank one token 35.9 -> 33.0, 8 tokens 109.1 ->
    108.8, 8 clustered (a verify block) 67.2 -> 64.1 (RESULTS S36-1).

    Unquantised weights of `element_size` 4 (fp32) take half the pipeline stages: the bf16 tiles'
    stages hold twice the bytes, past the H200's 227 KiB of shared memory per block."""
    if not fp8 and element_size > 2:
        config = default_config(num_pairs, num_experts, False, tma)
        return replace(config, gate_up=_half_stages(config.gate_up), down=_half_stages(config.down))
    if num_pairs <= 16 * num_experts:
        gate_up, down = Tiles(128 if fp8 else 64, 128, 4, 4, swap_ab=fp8), Tiles(64, 128, 4, 4, swap_ab=fp8)
        return MoeConfig(16, gate_up, down)
    if fp8 and tma:
        return MoeConfig(64, Tiles(128, 128, 8, 4), Tiles(128, 128, 4, 4), tma=True)
    if fp8:
        return MoeConfig(64, Tiles(128, 128, 8, 4), Tiles(256, 128, 8, 3))
    return MoeConfig(64, Tiles(128, 64, 8, 4), Tiles(256, 64, 8, 4))


def _half_stages(tiles: Tiles) -> Tiles:
    return replace(tiles, num_stages=max(1, tiles.num_stages // 2))


@triton.jit
def _load_rows(rows, cols, row_ok, K: tl.constexpr):
    """The `[rows, cols]` tile of a row-major matrix (zeros outside)."""
    return tl.load(rows + cols[None, :], mask=row_ok[:, None] & (cols < K)[None, :], other=0.0)


@triton.jit
def _block_of(pid, num_blocks, N: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """(row block, column tile) of a program: GROUP_M row blocks sweep the column tiles together."""
    num_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * num_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _block_expert(block_expert_ptr, pid_m, SHARED: tl.constexpr):
    """(expert, whether it is the shared expert) of row block `pid_m`; SHARED: the launch has the shared
    expert's weights (without them its blocks count as empty). Safe to skip the block when the expert
    is negative and not the shared one."""
    expert = tl.load(block_expert_ptr + pid_m)
    return expert, SHARED and expert == SHARED_EXPERT


@triton.jit
def _expert_weights(w, expert, shared, shared_w):
    """(weight, scale_inv) pointers of a row block's expert (`Weights` both): the shared expert's own
    tensors for its blocks, else expert `expert` of the stacked ones."""
    if shared:
        weight, scale = shared_w.weight, shared_w.scale
    else:
        weight, scale = (
            w.weight + expert.to(tl.int64) * w.expert_stride,
            w.scale + expert * w.scale_expert_stride,
        )
    return weight, scale


@triton.jit
def _block_slots(pid_m, block_rows_ptr, BLOCK_M: tl.constexpr):
    """(slots, which of them hold a pair) of row block `pid_m`."""
    m = tl.arange(0, BLOCK_M)
    return pid_m * BLOCK_M + m, m < tl.load(block_rows_ptr + pid_m)


@triton.jit
def _expert_product(
    a_rows, a_scales, w_cols, w_scales, row_ok, col_ok,
    K: tl.constexpr, BLOCK_M: tl.constexpr, WIDTH: tl.constexpr, BLOCK_K: tl.constexpr, FP8: tl.constexpr,
    k_first=0, K_SPAN: tl.constexpr = None, SWAP_AB: tl.constexpr = False,
):  # fmt: skip
    """fp32 `[BLOCK_M, WIDTH]` product of a block's activation rows (`a_rows`, row pointers) with its
    expert's weight columns (`w_cols`, column pointers) over depths `k_first + [0, K_SPAN)` (default:
    all K; `k_first` a multiple of 128 where FP8). FP8: each 128-deep step is scaled by the rows' and the
    columns' block scales (`a_scales`, `w_scales` at K group 0). SWAP_AB: each step multiplies the
    transposed tiles (weight tileᵀ · rowsᵀ: the weight columns as the MMA's rows, `Tiles.swap_ab`) into a
    `[WIDTH, BLOCK_M]` sum, the same sums in the same order, transposed back at the end."""
    k = tl.arange(0, BLOCK_K)
    acc = tl.zeros([WIDTH, BLOCK_M] if SWAP_AB else [BLOCK_M, WIDTH], tl.float32)
    if FP8:
        a_scale = tl.load(a_scales + k_first // 128, mask=row_ok, other=0.0)
        w_scale = tl.load(w_scales + k_first // 128, mask=col_ok, other=0.0)
    for k0 in range(k_first, k_first + (K if K_SPAN is None else K_SPAN), BLOCK_K):
        k_ok = k0 + k < K
        a = _load_rows(a_rows, k0 + k, row_ok, K)
        b = tl.load(w_cols + (k0 + k)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if FP8:
            # The pipeliner leaves these small loads synchronous: issued a step ahead of their use,
            # their latency hides behind this step's dot instead of stalling every step.
            group = (k0 + BLOCK_K) // 128
            more = k0 + BLOCK_K < K
            next_w_scale = tl.load(w_scales + group, mask=col_ok & more, other=0.0)
            next_a_scale = tl.load(a_scales + group, mask=row_ok & more, other=0.0)
            if SWAP_AB:
                acc += tl.dot(tl.trans(b), tl.trans(a)) * (w_scale[:, None] * a_scale[None, :])
            else:
                acc += tl.dot(a, b) * (a_scale[:, None] * w_scale[None, :])
            w_scale, a_scale = next_w_scale, next_a_scale
        elif SWAP_AB:
            acc = tl.dot(tl.trans(b), tl.trans(a), acc)
        else:
            acc = tl.dot(a, b, acc)
    if SWAP_AB:
        acc = tl.trans(acc)
    return acc


@triton.jit
def _gate_up_kernel(
    x,
    w,
    shared_w,
    layout,
    h,
    num_blocks,
    num_pairs,
    limit,
    TOP_K: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    QUANT_GROUP: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr,
    partials_ptr=None,
    tickets_ptr=None,
    SPLITS: tl.constexpr = 1,
    SHARED_N: tl.constexpr = None,
    SWAP_AB: tl.constexpr = False,
):
    """The SwiGLU rows `h` (`Rows`) of the pairs of each row block of `layout` (`Alignment`), from the
    activation rows `x` and the experts' gate|up `w` (`Weights`; `gate_up_stage`). SHARED: the shared
    expert's blocks (`SHARED_EXPERT`) read its own weights, and their pairs num_pairs + t are token t's;
    its intermediate is SHARED_N (default N: a routed expert's), the columns of its h rows past it are
    left unset, and its blocks' column tiles past it end at once. SPLITS > 1: each (row block, column
    tile) is SPLITS programs of K / SPLITS steps each; they store their rows' fp32 products to
    `partials_ptr` and take a ticket of the tile (`tickets_ptr`, zero between launches), and the last to
    take one sums the SPLITS products in split order, puts the counter back to zero and finishes the
    tile."""
    enter(PDL)
    split = tl.program_id(0) % SPLITS
    pid_m, pid_n = _block_of(tl.program_id(0) // SPLITS, num_blocks, N, BLOCK_N, GROUP_M)
    expert, shared = _block_expert(layout.block_expert, pid_m, SHARED)
    width = N if SHARED_N is None else tl.where(shared, SHARED_N, N)  # this block's expert's intermediate
    if (expert < 0 and not shared) or pid_n * BLOCK_N >= width:
        return
    slot, row_ok = _block_slots(pid_m, layout.block_rows, BLOCK_M)
    pair = tl.load(layout.pairs + slot, mask=row_ok, other=0)
    token = tl.where(shared, pair - num_pairs, pair // TOP_K)
    # one [K, 2·BLOCK_N] weight tile per step, gate rows then the matching up rows: one dot (and for
    # FP8 one wait for its result before the scales apply) instead of two
    j = tl.arange(0, 2 * BLOCK_N)
    w_row = pid_n * BLOCK_N + j % BLOCK_N + (j // BLOCK_N) * width
    w_row_ok = pid_n * BLOCK_N + j % BLOCK_N < width
    x_rows = x.data + token.to(tl.int64)[:, None] * x.stride
    weight, scale = _expert_weights(w, expert, shared, shared_w)  # the shared expert's strides are w's
    w_cols = weight + w_row[None, :] * w.row_stride
    a_scales = x.scales + token * x.scale_stride
    w_scales = scale + (w_row // 128) * w.scale_row_stride
    acc = _expert_product(
        x_rows, a_scales, w_cols, w_scales, row_ok, w_row_ok, K, BLOCK_M, 2 * BLOCK_N, BLOCK_K, FP8,
        split * (K // SPLITS), K // SPLITS, SWAP_AB,
    )  # fmt: skip
    if SPLITS == 1:
        _swiglu_store(acc, slot, row_ok, pid_n, h, limit, width, BLOCK_M, BLOCK_N, FP8, QUANT_GROUP)
    else:
        tile = pid_m * tl.cdiv(N, BLOCK_N) + pid_n
        m = tl.arange(0, BLOCK_M)
        # this tile's products: [SPLITS, BLOCK_M, 2·BLOCK_N] fp32, of the rows that hold a pair only
        rows = (tile * SPLITS * BLOCK_M + m[:, None]).to(tl.int64)
        first = partials_ptr + rows * (2 * BLOCK_N) + j[None, :]
        step = BLOCK_M * 2 * BLOCK_N
        tl.store(first + split * step, acc, mask=row_ok[:, None])
        tl.debug_barrier()  # all of this program's rows are stored before its ticket releases them
        if tl.atomic_add(tickets_ptr + tile, 1, sem="acq_rel") == SPLITS - 1:
            tl.store(tickets_ptr + tile, 0)
            total = tl.zeros([BLOCK_M, 2 * BLOCK_N], tl.float32)
            for s in tl.static_range(SPLITS):  # in split order: every run sums alike
                total += tl.load(first + s * step, mask=row_ok[:, None], other=0.0, cache_modifier=".cg")
            _swiglu_store(total, slot, row_ok, pid_n, h, limit, width, BLOCK_M, BLOCK_N, FP8, QUANT_GROUP)


@triton.jit
def _swiglu_store(
    acc, slot, row_ok, pid_n, h, limit, N,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8: tl.constexpr, QUANT_GROUP: tl.constexpr,
):  # fmt: skip
    """The SwiGLU rows of a gate|up product `acc [BLOCK_M, gate BLOCK_N | up BLOCK_N]` at column tile
    `pid_n` of an expert of intermediate N, stored to the rows `slot` of h (`Rows`; FP8: quantised by
    groups of QUANT_GROUP, with their scales)."""
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    acc_gate, acc_up = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    gate = tl.minimum(acc_gate, limit)
    rows = gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(acc_up, -limit), limit)
    h_rows = h.data + slot.to(tl.int64)[:, None] * h.stride
    out_ok = row_ok[:, None] & n_ok[None, :]
    if FP8:
        grouped = tl.reshape(
            tl.where(n_ok[None, :], rows, 0.0), [BLOCK_M, BLOCK_N // QUANT_GROUP, QUANT_GROUP]
        )
        scale = group_scale(tl.max(tl.abs(grouped), axis=2))
        q = round_to_e4m3(tl.math.div_rn(grouped, tl.broadcast_to(scale[:, :, None], grouped.shape)))
        tl.store(
            h_rows + n[None, :], tl.reshape(q, [BLOCK_M, BLOCK_N]).to(h.data.dtype.element_ty), mask=out_ok
        )
        group = (pid_n * BLOCK_N) // 128 + tl.arange(0, BLOCK_N // QUANT_GROUP)
        group_ok = row_ok[:, None] & (group < tl.cdiv(N, 128))[None, :]  # a tile may reach past I
        tl.store(h.scales + slot[:, None] * h.scale_stride + group[None, :], scale, mask=group_ok)
    else:
        tl.store(h_rows + n[None, :], rows.to(h.data.dtype.element_ty), mask=out_ok)


@triton.jit
def _down_rows(
    h, weight, scale, strides, layout, weights_ptr, out, pid_m, pid_n, shared,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    FP8: tl.constexpr, SWAP_AB: tl.constexpr,
):  # fmt: skip
    """Row block `pid_m` of h (`Rows`) times its column tile `pid_n` of its expert's weight (`weight`,
    `scale`: `_expert_weights`, addressed with the row strides of `strides`, a `Weights`), weighted by
    the pair's routing weight (`weights_ptr [T·k]`), to each pair's row of `out` (`Matrix`); the shared
    expert's pairs (`shared`) have no routing weight and take 1."""
    slot, row_ok = _block_slots(pid_m, layout.block_rows, BLOCK_M)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N
    h_rows = h.data + slot.to(tl.int64)[:, None] * h.stride
    w_cols = weight + n[None, :] * strides.row_stride
    a_scales = h.scales + slot * h.scale_stride
    w_scales = scale + (n // 128) * strides.scale_row_stride
    acc = _expert_product(
        h_rows, a_scales, w_cols, w_scales, row_ok, n_ok, K, BLOCK_M, BLOCK_N, BLOCK_K, FP8, 0, None, SWAP_AB
    )  # fmt: skip
    pair = tl.load(layout.pairs + slot, mask=row_ok, other=0)
    if not shared:
        acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    dst = out.data + pair.to(tl.int64)[:, None] * out.stride + n[None, :]
    tl.store(dst, acc.to(out.data.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(
    h,
    w,
    layout,
    weights_ptr,
    out,
    num_blocks,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    SWAP_AB: tl.constexpr = False,
):
    """Each pair's weighted row of its expert's down product (`down_stage`): h `Rows`, w `Weights`,
    `layout` the `Alignment`, the pairs' rows `out [T·k, N]` a `Matrix`."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(layout.block_expert + pid_m)
    if expert < 0:
        return
    weight, scale = _expert_weights(w, expert, False, w)
    _down_rows(
        h, weight, scale, w, layout, weights_ptr, out, pid_m, pid_n, False, N, K, BLOCK_M, BLOCK_N, BLOCK_K,
        FP8, SWAP_AB,
    )  # fmt: skip


@triton.jit
def _sum_pairs(
    routed, ids, t, t_ok, n,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N: tl.constexpr, E: tl.constexpr, PARTIAL: tl.constexpr,
):  # fmt: skip
    """fp32 `[len(t), len(n)]`: Σ_k of tokens `t`'s rows of `routed [T·k, N]` (`Matrix`), in a fixed order.
    PARTIAL: only the rows of the pairs of the weights' E experts (`ids`, `ExpertIds`; the others were never
    placed and their rows are unset). The rows are read past this SM's L1
    (`.cg`): in `_down_combine_kernel` other programs of the launch wrote them."""
    j = tl.arange(0, K_PAD)
    pair = t[:, None] * TOP_K + j[None, :]
    ok = t_ok[:, None] & (j < TOP_K)[None, :]
    if PARTIAL:
        _, ok = placed_experts(ids.ids, pair, ok, ids.first, E)
    rows = routed.data + pair.to(tl.int64)[:, :, None] * routed.stride + n[None, None, :]
    mask = ok[:, :, None] & (n < N)[None, None, :]
    return tl.sum(tl.load(rows, mask=mask, other=0.0, cache_modifier=".cg").to(tl.float32), axis=1)


@triton.jit
def _combine_kernel(
    routed, ids, out, num_tokens,
    TOP_K: tl.constexpr, K_PAD: tl.constexpr, N: tl.constexpr, E: tl.constexpr, BLOCK_T: tl.constexpr,
    BLOCK_N: tl.constexpr,
):  # fmt: skip
    """`BLOCK_T` tokens × `BLOCK_N` columns of `combine` (`routed`, `out`: `Matrix`; `ids`: `ExpertIds`)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    t_ok = t < num_tokens
    total = _sum_pairs(routed, ids, t, t_ok, n, TOP_K, K_PAD, N, E, True)
    dst = out.data + t.to(tl.int64)[:, None] * out.stride + n[None, :]
    tl.store(dst, total.to(out.data.dtype.element_ty), mask=t_ok[:, None] & (n < N)[None, :])


@triton.jit
def _down_combine_kernel(
    h,
    w,
    shared_w,
    layout,
    weights_ptr,
    routed,
    ids,
    addend,
    out,
    tickets_ptr,
    num_blocks,
    num_tokens,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    T_PAD: tl.constexpr,
    N: tl.constexpr,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    FP8: tl.constexpr,
    E: tl.constexpr,
    PARTIAL: tl.constexpr,
    ADD: tl.constexpr,
    SHARED: tl.constexpr,
    PDL: tl.constexpr,
    SHARED_K: tl.constexpr = None,
    SWAP_AB: tl.constexpr = False,
):
    """`_down_kernel` into the pairs' rows `routed`, then the combine of its column tile by the tile's last
    program to finish: every row block of the tile takes a ticket (empty blocks too), and the last ticket
    sums each token's k rows (PARTIAL: its placed ones, `ids` an `ExpertIds`, `_sum_pairs`) in a fixed
    order, rounds the sum to the output dtype (ADD: then adds the `addend`'s row and rounds again, as a
    separate add of the two would) into `out` and puts the ticket counter back to zero (`routed`,
    `addend`, `out`: `Matrix`). SHARED: the shared expert's blocks read its own weights and write
    its rows after the routed pairs' (row T·k + t: the addend the host points ADD at); SHARED_K: its
    intermediate where it is not a routed expert's K (a tensor-parallel slice), read with its own row
    strides (`shared_w`'s; otherwise they are `w`'s)."""
    enter(PDL)
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert, shared = _block_expert(layout.block_expert, pid_m, SHARED)
    if expert >= 0 or shared:
        weight, scale = _expert_weights(w, expert, shared, shared_w)
        if SHARED_K is not None and shared:
            _down_rows(
                h, weight, scale, shared_w, layout, weights_ptr, routed, pid_m, pid_n, True, N, SHARED_K,
                BLOCK_M, BLOCK_N, BLOCK_K, FP8, SWAP_AB,
            )  # fmt: skip
        else:
            _down_rows(
                h, weight, scale, w, layout, weights_ptr, routed, pid_m, pid_n, shared, N, K, BLOCK_M,
                BLOCK_N, BLOCK_K, FP8, SWAP_AB,
            )  # fmt: skip
    tl.debug_barrier()  # all of this program's rows are stored before its ticket releases them
    if tl.atomic_add(tickets_ptr + pid_n, 1, sem="acq_rel") == num_blocks - 1:
        tl.store(tickets_ptr + pid_n, 0)
        t = tl.arange(0, T_PAD)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        t_ok = t < num_tokens
        total = _sum_pairs(routed, ids, t, t_ok, n, TOP_K, K_PAD, N, E, PARTIAL)
        inside = t_ok[:, None] & (n < N)[None, :]
        result = total.to(out.data.dtype.element_ty)
        if ADD:
            # `.cg`: with SHARED, the addend rows are the shared expert's, which other programs of this
            # launch wrote
            addend_rows = addend.data + t[:, None].to(tl.int64) * addend.stride + n[None, :]
            added = tl.load(addend_rows, mask=inside, other=0.0, cache_modifier=".cg")
            result = (result.to(tl.float32) + added.to(tl.float32)).to(out.data.dtype.element_ty)
        tl.store(out.data + t[:, None].to(tl.int64) * out.stride + n[None, :], result, mask=inside)


@triton.jit
def _gather_rows_kernel(
    x, layout, out, num_slots,
    TOP_K: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, ROWS: tl.constexpr, GROUPS: tl.constexpr,
):  # fmt: skip
    """`ROWS` slots from `program_id(0)·ROWS`, channel groups `program_id(1)·GROUPS + [0, GROUPS)`: the
    token row of each valid slot of `layout` (quantised `x` and its scales, `Rows`) copied to the slot's
    row of `out` (`Rows`), zeros to the
    padding rows of real blocks (whole tiles go through the GEMMs: zeros keep their rows finite); the
    rows of the blocks past the real count stay unset, no GEMM program reads them."""
    slot = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    in_range = slot < num_slots
    rows = tl.load(layout.block_rows + slot // BLOCK_M, mask=in_range, other=0)
    ok = slot % BLOCK_M < rows
    real = in_range & (rows > 0)
    token = tl.load(layout.pairs + slot, mask=ok, other=0) // TOP_K
    group = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    cols = tl.program_id(1) * GROUPS * 128 + tl.arange(0, GROUPS * 128)
    q = tl.load(x.data + token.to(tl.int64)[:, None] * x.stride + cols[None, :], mask=ok[:, None], other=0.0)
    tl.store(out.data + slot.to(tl.int64)[:, None] * out.stride + cols[None, :], q, mask=real[:, None])
    scale = tl.load(x.scales + token[:, None] * x.scale_stride + group[None, :], mask=ok[:, None], other=0.0)
    tl.store(out.scales + slot[:, None] * out.scale_stride + group[None, :], scale, mask=real[:, None])


@triton.jit
def _gate_up_tma_kernel(
    x_desc, x, w_desc, w, layout, h, num_blocks, limit,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """`_gate_up_kernel` (FP8) on x already in slot order (`x_desc` over `[slots, K]`, `w_desc` over the
    weights as `[E·2N, K]`; their scales from `x` (`Rows`) and `w` (`Weights`), whose values the
    descriptors read): a gate and an up tile of BLOCK_N = 128 columns, each one weight scale block, as two
    products (one [2·BLOCK_N, BLOCK_K] tile and one product per step measured slower on the H200: 6.26
    against 6.17 ms for the FP8 step at M = 8192)."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(layout.block_expert + pid_m)
    if expert < 0:
        return
    slot, row_ok = _block_slots(pid_m, layout.block_rows, BLOCK_M)
    gate_row = expert * (2 * N) + pid_n * BLOCK_N
    a_scales = x.scales + slot * x.scale_stride
    gate_scales = w.scale + expert * w.scale_expert_stride + (pid_n * BLOCK_N // 128) * w.scale_row_stride
    up_scales = gate_scales + (N // 128) * w.scale_row_stride
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = x_desc.load([pid_m * BLOCK_M, k0])
        w_gate = w_desc.load([gate_row, k0])
        w_up = w_desc.load([gate_row + N, k0])
        # after the first step, the scales come from the cache lines the first one brought into L1
        group = k0 // 128
        a_scale = tl.load(a_scales + group)
        gate_scale = tl.load(gate_scales + group)
        up_scale = tl.load(up_scales + group)
        acc_gate += tl.dot(a, w_gate.T) * (a_scale * gate_scale)[:, None]
        acc_up += tl.dot(a, w_up.T) * (a_scale * up_scale)[:, None]
    gate = tl.minimum(acc_gate, limit)
    q, scale = quantize_rows(gate * tl.sigmoid(gate) * tl.minimum(tl.maximum(acc_up, -limit), limit))
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    h_rows = h.data + slot.to(tl.int64)[:, None] * h.stride
    # padding rows stay unset (storing their zeros spilled registers into the loop): the down kernel
    # reads them in whole tiles, and only its own masked-off rows see them
    tl.store(h_rows + n[None, :], q.to(h.data.dtype.element_ty), mask=row_ok[:, None])
    tl.store(h.scales + slot * h.scale_stride + pid_n, scale, mask=row_ok)


@triton.jit
def _down_tma_kernel(
    h_desc, h, w_desc, w, layout, weights_ptr, out, num_blocks,
    N: tl.constexpr, K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
):  # fmt: skip
    """`_down_kernel` (FP8) through TMA descriptors (`h_desc` over h `[slots, K]`, `w_desc` over the
    weights as `[E·N, K]`; their scales from `h` and `w`), tiles of BLOCK_N ≤ 128 columns in one weight
    scale block; the pairs' rows `out` a `Matrix`."""
    pid_m, pid_n = _block_of(tl.program_id(0), num_blocks, N, BLOCK_N, GROUP_M)
    expert = tl.load(layout.block_expert + pid_m)
    if expert < 0:
        return
    slot, row_ok = _block_slots(pid_m, layout.block_rows, BLOCK_M)
    w_row = expert * N + pid_n * BLOCK_N
    a_scales = h.scales + slot * h.scale_stride
    w_scales = w.scale + expert * w.scale_expert_stride + (pid_n * BLOCK_N // 128) * w.scale_row_stride
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = h_desc.load([pid_m * BLOCK_M, k0])
        scale = tl.load(a_scales + k0 // 128) * tl.load(w_scales + k0 // 128)  # see `_gate_up_tma_kernel`
        acc += tl.dot(a, w_desc.load([w_row, k0]).T) * scale[:, None]
    pair = tl.load(layout.pairs + slot, mask=row_ok, other=0)
    acc = acc * tl.load(weights_ptr + pair, mask=row_ok, other=0.0)[:, None]
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dst = out.data + pair.to(tl.int64)[:, None] * out.stride + n[None, :]
    tl.store(dst, acc.to(out.data.dtype.element_ty), mask=row_ok[:, None] & (n < N)[None, :])


def _check(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
):
    if x.ndim != 2 or gate_up.ndim != 3 or down.ndim != 3:
        raise ValueError(
            f"experts: x {tuple(x.shape)}, gate_up {tuple(gate_up.shape)}, down {tuple(down.shape)} "
            "must be [T, D], [E, 2I, D], [E, D, I]"
        )
    e, two_i, d = gate_up.shape
    if d != x.shape[1] or two_i % 2 or down.shape != (e, d, two_i // 2):
        raise ValueError(
            f"experts: gate_up {tuple(gate_up.shape)} and down {tuple(down.shape)} do not match "
            f"D = {x.shape[1]} as [E, 2I, D] and [E, D, I]"
        )
    if ids.ndim != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ValueError(f"experts: ids {tuple(ids.shape)} and weights {tuple(weights.shape)} must be [T, k]")


def _check_scale(name: str, scale: torch.Tensor, weight: torch.Tensor) -> None:
    e, n, k = weight.shape
    expected = (e, triton.cdiv(n, FP8_BLOCK), triton.cdiv(k, FP8_BLOCK))
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"experts (FP8): {name} must be float8_e4m3fn, got {weight.dtype}")
    if scale.shape != expected or scale.dtype != torch.float32:
        raise ValueError(
            f"experts (FP8): {name}_scale_inv must be fp32 {expected}, got {scale.dtype} {tuple(scale.shape)}"
        )


def _check_config(
    config: MoeConfig, hidden: int, intermediate: int, fp8: bool, weights: tuple[torch.Tensor, torch.Tensor]
) -> None:
    for name, tiles in (("gate_up", config.gate_up), ("down", config.down)):
        if fp8 and FP8_BLOCK % tiles.block_k:
            raise ValueError(f"experts (FP8): {name}.block_k {tiles.block_k} must divide {FP8_BLOCK}")
    if config.tma:
        _check_tma_config(config, hidden, intermediate, fp8, weights)
    for name, tiles, width in (
        ("gate_up", config.gate_up, 2 * config.gate_up.block_n),
        ("down", config.down, config.down.block_n),
    ):
        if tiles.swap_ab and (config.tma or width % 64 or config.block_m % 8):
            raise ValueError(
                f"experts: {name}.swap_ab takes the pointer kernels, a weight tile of whole 64-row MMA "
                f"blocks (here {width}) and row blocks of whole 8-column ones (block_m {config.block_m})"
            )
    block_n = config.gate_up.block_n
    if fp8 and block_n % FP8_BLOCK and block_n < intermediate:
        raise ValueError(
            f"experts (FP8): gate_up.block_n {block_n} must be a multiple of {FP8_BLOCK} or cover I = "
            f"{intermediate}: its epilogue quantises whole groups of {FP8_BLOCK}"
        )


def _tma_refusal(hidden: int, intermediate: int, weights: tuple[torch.Tensor, torch.Tensor]) -> str | None:
    """What the TMA kernels would need of the weights `(gate_up, down)` and they lack, or None."""
    if hidden % FP8_BLOCK or intermediate % FP8_BLOCK:
        return f"D {hidden} and I {intermediate} to be multiples of {FP8_BLOCK}"
    for name, t in zip(("gate_up", "down"), weights, strict=True):
        if not t.is_contiguous():  # its descriptor views it as [E·N, K]
            return f"{name} contiguous, strides {t.stride()}"
    return None


def _check_tma_config(
    config: MoeConfig, hidden: int, intermediate: int, fp8: bool, weights: tuple[torch.Tensor, torch.Tensor]
) -> None:
    if not fp8:
        raise ValueError("experts: config.tma applies to FP8 weights only")
    refusal = _tma_refusal(hidden, intermediate, weights)
    if refusal:
        raise ValueError(f"experts (FP8): config.tma needs {refusal}")
    if config.gate_up.block_n != FP8_BLOCK:
        raise ValueError(
            f"experts (FP8): config.tma needs gate_up.block_n = {FP8_BLOCK}, got {config.gate_up.block_n}"
        )
    if FP8_BLOCK % config.down.block_n:
        raise ValueError(
            f"experts (FP8): config.tma needs down.block_n to divide {FP8_BLOCK}, got {config.down.block_n}"
        )


def check_experts(x: torch.Tensor, w: ExpertWeights, choices: Choices, config: MoeConfig | None) -> MoeConfig:
    """The configuration a step runs with (`config` or the default), after a ValueError naming any
    argument that does not fit: FP8 when the scales are given, else weights in x's dtype."""
    gate_up, down = w.gate_up, w.down
    gate_up_scale, down_scale = w.scales or (None, None)
    _check(x, gate_up, down, *choices)
    fp8 = w.scales is not None
    if fp8:
        _check_scale("gate_up", gate_up_scale, gate_up)
        _check_scale("down", down_scale, down)
    elif gate_up.dtype != x.dtype or down.dtype != x.dtype:
        raise ValueError(
            f"experts: gate_up {gate_up.dtype} and down {down.dtype} must be x's dtype {x.dtype}"
        )
    tokens, top_k = choices.ids.shape
    num_experts, two_i, hidden = gate_up.shape
    tma = _tma_refusal(hidden, two_i // 2, (gate_up, down)) is None
    config = config or default_config(tokens * top_k, num_experts, fp8, tma, x.element_size())
    _check_config(config, hidden, two_i // 2, fp8, (gate_up, down))
    for name, t in (
        ("gate_up", gate_up),
        ("down", down),
        ("gate_up_scale_inv", gate_up_scale),
        ("down_scale_inv", down_scale),
    ):
        if t is not None and t.stride(-1) != 1:  # weights are too large to copy on every call
            raise ValueError(
                f"experts: {name} must be contiguous in its last dimension, strides {t.stride()}"
            )
    return config


def _run(
    x: torch.Tensor,
    w: ExpertWeights,
    choices: Choices,
    limit: float,
    config: MoeConfig | None,
    first_expert: int | None,
) -> torch.Tensor:
    config = check_experts(x, w, choices, config)
    ids, weights = choices
    gate_up_scale, down_scale = w.scales or (None, None)
    tokens, top_k = ids.shape
    num_experts, _, hidden = w.gate_up.shape
    if tokens == 0:
        return torch.zeros(0, hidden, dtype=x.dtype, device=x.device)
    x = x.contiguous()
    out_dtype, x_scale = x.dtype, None
    if gate_up_scale is not None:
        x, x_scale = quantize_groups(x)
    layout = align(ids, num_experts, config.block_m, first_expert)
    h, h_scale = gate_up_stage(x, x_scale, w.gate_up, gate_up_scale, layout, top_k, limit, config)
    routed = down_stage(h, h_scale, w.down, down_scale, layout, weights, out_dtype, config)
    if first_expert is None:  # every row was written
        return routed.view(tokens, top_k, hidden).sum(1)
    return combine(routed, ids, first_expert, num_experts)


def combine(routed: torch.Tensor, ids: torch.Tensor, first_expert: int, num_experts: int) -> torch.Tensor:
    """`[T, D]`: Σ_k of each token's rows of `routed [T·k, D]` whose global expert (`ids [T, k]`) lies
    in `[first_expert, first_expert + num_experts)`, summed in fp32 in a fixed order (the rows of the
    other pairs are never read: they were not computed). One launch of 8-token × 128-column tiles."""
    tokens, top_k = ids.shape
    hidden = routed.shape[1]
    out = torch.empty(tokens, hidden, dtype=routed.dtype, device=routed.device)
    block_t, block_n = 8, min(128, triton.next_power_of_2(hidden))
    _combine_kernel[(triton.cdiv(tokens, block_t), triton.cdiv(hidden, block_n))](
        Matrix.of(routed), ExpertIds(ids.contiguous(), first_expert), Matrix.of(out), tokens,
        TOP_K=top_k, K_PAD=triton.next_power_of_2(top_k), N=hidden, E=num_experts, BLOCK_T=block_t,
        BLOCK_N=block_n,
    )  # fmt: skip
    return out


def gather_rows(
    x: torch.Tensor,
    x_scale: torch.Tensor,
    layout: Alignment,
    top_k: int,
    rows: int = 16,
    groups: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The quantised x and its scales in the alignment's row order (`[slots, K]`, `[slots, K/128]`): each
    valid slot a copy of its token's row (see `_gather_rows_kernel`, `rows` slots and `groups` channel
    groups per program, by default up to 8 groups: 16 × 1024 tiles took 112 us at M = 8192, top-8 on the
    H200, 32 × 128 tiles 170 us). K is a multiple of 128·groups."""
    slots = layout.pairs.numel()
    groups = groups or math.gcd(x_scale.shape[1], 8)
    if x_scale.shape[1] % groups:
        raise ValueError(f"gather_rows: groups {groups} must divide the {x_scale.shape[1]} channel groups")
    out = torch.empty(slots, x.shape[1], dtype=x.dtype, device=x.device)
    out_scale = torch.empty(slots, x_scale.shape[1], dtype=x_scale.dtype, device=x.device)
    _gather_rows_kernel[(triton.cdiv(slots, rows), x_scale.shape[1] // groups)](
        Rows.of(x, x_scale), layout, Rows.of(out, out_scale), slots,
        TOP_K=top_k, K=x.shape[1], BLOCK_M=layout.block_m, ROWS=rows, GROUPS=groups,
    )  # fmt: skip
    return out, out_scale


def gate_up_stage(
    x: torch.Tensor,
    x_scale: torch.Tensor | None,
    gate_up: torch.Tensor,
    gate_up_scale: torch.Tensor | None,
    layout: Alignment,
    top_k: int,
    limit: float,
    config: MoeConfig,
    shared: SharedExpert | None = None,
    tickets: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The first grouped GEMM (one launch): SwiGLU rows `h [rows, I]` in the alignment's order. FP8
    weights take x quantised (e4m3 with `x_scale`, see `quantize_groups`) and give h quantised with
    its group scales; bf16 weights take and give x's dtype and no scales. `shared`: the weights of the
    shared expert's blocks, when the layout places them (`decode.prologue`; `shared_refusal` of the
    weights is None). `config.gate_up.splits` > 1 splits K over that many programs a tile, which need
    `tickets` (int32 zeros, one per (row block, column tile), left zero)."""
    fp8 = gate_up_scale is not None
    if fp8 != (x_scale is not None):
        raise ValueError("gate_up_stage: x_scale and gate_up_scale come together (FP8) or not at all")
    if shared is not None and config.tma:
        raise ValueError("gate_up_stage: config.tma has no shared expert")
    num_blocks = layout.block_expert.numel()
    intermediate = gate_up.shape[1] // 2
    up = config.gate_up
    split_operands = _split_operands(up, num_blocks, intermediate, gate_up.shape[2], fp8, config, tickets, x)
    h = torch.empty(layout.pairs.numel(), intermediate, dtype=x.dtype, device=x.device)
    h_scale = (
        torch.empty(h.shape[0], triton.cdiv(intermediate, FP8_BLOCK), dtype=torch.float32, device=x.device)
        if fp8
        else None
    )
    programs = num_blocks * triton.cdiv(intermediate, up.block_n) * up.splits
    launch = _tile_arguments(config, up, intermediate, gate_up.shape[2])
    if config.tma:
        x, x_scale = gather_rows(x, x_scale, layout, top_k)
        if _grouped_cuda(x, gate_up, gate_up_scale, layout):
            return grouped_cuda.gate_up(x, x_scale, gate_up, gate_up_scale, layout, limit)
        _gate_up_tma_kernel[(programs,)](
            TensorDescriptor.from_tensor(x, [config.block_m, up.block_k]),
            Rows.of(x, x_scale),
            TensorDescriptor.from_tensor(gate_up.view(-1, gate_up.shape[2]), [up.block_n, up.block_k]),
            Weights.of(gate_up, gate_up_scale),
            layout,
            Rows.of(h, h_scale),
            num_blocks,
            float(limit),
            **launch,
        )
        return h, h_scale
    dependent = dependent_launches(x.device)
    _gate_up_kernel[(programs,)](
        Rows.of(x, x_scale),
        Weights.of(gate_up, gate_up_scale),
        _shared_operand(shared, 0, gate_up, gate_up_scale),
        layout,
        Rows.of(h, h_scale),
        num_blocks,
        x.shape[0] * top_k,
        float(limit),
        TOP_K=top_k,
        FP8=fp8,
        QUANT_GROUP=min(up.block_n, FP8_BLOCK),
        SHARED=shared is not None,
        SHARED_N=_narrower_shared(shared, intermediate),
        **launch,
        **split_operands,
        PDL=dependent,
        launch_pdl=dependent,
    )
    return h, h_scale


def _split_operands(
    tiles: Tiles, num_blocks: int, n: int, k: int, fp8: bool, config: MoeConfig, tickets, like: torch.Tensor
) -> dict[str, object]:
    """The split-K keywords of `_gate_up_kernel` for `tiles.splits` (none for 1), after a ValueError
    naming what the split needs: K steps it divides evenly (FP8: whole scale groups a split), no TMA,
    and a ticket per (row block, column tile)."""
    if tiles.splits == 1:
        return {}
    span, tiles_n = k // tiles.splits, num_blocks * triton.cdiv(n, tiles.block_n)
    if config.tma or k % tiles.splits or span % tiles.block_k or (fp8 and span % FP8_BLOCK):
        raise ValueError(
            f"gate_up_stage: splits {tiles.splits} must cut K = {k} into whole {tiles.block_k}-deep steps"
            f"{f' and {FP8_BLOCK}-deep scale groups' if fp8 else ''}, without TMA (tma={config.tma})"
        )
    if tickets is None or tickets.dtype != torch.int32 or tickets.numel() < tiles_n:
        raise ValueError(
            f"gate_up_stage: splits {tiles.splits} need int32 tickets, one per (row block, column tile): "
            f"{tiles_n}, got {None if tickets is None else (tickets.dtype, tuple(tickets.shape))}"
        )
    partials = torch.empty(tiles_n * tiles.splits * config.block_m, 2 * tiles.block_n, dtype=torch.float32,
                           device=like.device)  # fmt: skip
    return {"partials_ptr": partials, "tickets_ptr": tickets, "SPLITS": tiles.splits}


def shared_refusal(w: ExpertWeights, shared: SharedExpert) -> str | None:
    """Why the grouped GEMMs cannot compute `shared` as one more expert beside `w`'s, or None: it must
    have the format of `w` (dtype, FP8 or not) and a routed expert's hidden size and gate|up row
    strides, and an intermediate of at most a routed expert's (a tensor-parallel slice of the shared
    expert is narrower; whole scale blocks of it where FP8), its down row-major where narrower (the
    combining down launch takes its strides then) and else a routed expert's strides too."""
    if (w.scales is None) != (shared.scales is None):
        return "the shared expert and the routed experts are not both FP8 or both unscaled"
    inter, hidden, width = w.down.shape[2], w.down.shape[1], shared.down.shape[1]
    if width > inter or (w.scales is not None and width % FP8_BLOCK):
        whole = f" in whole {FP8_BLOCK}-wide scale blocks" if w.scales is not None else ""
        return f"the shared expert's intermediate {width} is not at most a routed expert's ({inter}){whole}"
    names = ("gate_up", "down", "gate_up_scale_inv", "down_scale_inv")
    routed = (w.gate_up, w.down, *(w.scales or ()))
    blocks = -(-hidden // FP8_BLOCK), width // FP8_BLOCK
    shapes = ((2 * width, hidden), (hidden, width), (2 * blocks[1], blocks[0]), blocks)
    count = len(routed)  # the weights, and their scales where FP8
    tensors = (*shared[:2], *(shared.scales or ()))
    for name, one, stacked, shape in zip(names[:count], tensors, routed, shapes[:count], strict=True):
        row_major = (shape[1], 1)
        strides = stacked.stride()[1:] if name.startswith("gate_up") or width == inter else row_major
        if one.dtype != stacked.dtype or tuple(one.shape) != shape or one.stride() != strides:
            return (
                f"the shared expert's {name} {one.dtype} {tuple(one.shape)} strides {one.stride()} is not "
                f"{stacked.dtype} {shape} strides {strides} (a routed expert's layout at its width)"
            )
    return None


def _narrower_shared(shared: SharedExpert | None, intermediate: int) -> int | None:
    """The shared expert's intermediate where it is narrower than a routed expert's (the kernels'
    SHARED_N / SHARED_K), else None."""
    return None if shared is None or shared.down.shape[1] == intermediate else shared.down.shape[1]


def _shared_operand(
    shared: SharedExpert | None, part: int, weight: torch.Tensor, scale: torch.Tensor | None
) -> Weights:
    """The shared expert's gate_up (`part` 0) or down (1) as a launch takes it (`Weights`): a stand-in
    without one (the routed `weight` and its `scale`, never read)."""
    if shared is None:
        return Weights.of(weight, scale)
    return Weights.of(shared[part], None if shared.scales is None else shared.scales[part])


def _tile_arguments(config: MoeConfig, tiles: Tiles, n: int, k: int) -> dict[str, object]:
    """The shape and launch keywords every grouped-GEMM launch takes (an `[n, k]` weight per expert)."""
    return {
        "N": n,
        "K": k,
        "BLOCK_M": config.block_m,
        "BLOCK_N": tiles.block_n,
        "BLOCK_K": tiles.block_k,
        "GROUP_M": config.group_m,
        "num_warps": tiles.num_warps,
        "num_stages": tiles.num_stages,
        **({"SWAP_AB": True} if tiles.swap_ab else {}),  # the pointer kernels only (`check_experts`)
    }


def _down_arguments(
    h: torch.Tensor,
    h_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor | None,
    layout: Alignment,
    weights: torch.Tensor,
    config: MoeConfig,
) -> tuple[int, dict[str, object]]:
    """(programs, keyword arguments) the two down kernels share."""
    fp8 = down_scale is not None
    if fp8 != (h_scale is not None):
        raise ValueError("down_stage: h_scale and down_scale come together (FP8) or not at all")
    num_blocks = layout.block_expert.numel()
    hidden = down.shape[1]
    dn = config.down
    arguments = {
        "h": Rows.of(h, h_scale),
        "w": Weights.of(down, down_scale),
        "layout": layout,
        "weights_ptr": weights.float().contiguous(),
        "num_blocks": num_blocks,
        "FP8": fp8,
        **_tile_arguments(config, dn, hidden, h.shape[1]),
    }
    return num_blocks * triton.cdiv(hidden, dn.block_n), arguments


def down_stage(
    h: torch.Tensor,
    h_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor | None,
    layout: Alignment,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    config: MoeConfig,
) -> torch.Tensor:
    """The second grouped GEMM (one launch): each pair's weighted expert output, `[T·k, D]`; with FP8
    weights, h comes quantised with `h_scale`."""
    routed = torch.empty(weights.numel(), down.shape[1], dtype=out_dtype, device=h.device)
    if config.tma:
        _down_tma(h, h_scale, down, down_scale, layout, weights, routed, config)
        return routed
    programs, arguments = _down_arguments(h, h_scale, down, down_scale, layout, weights, config)
    _down_kernel[(programs,)](**arguments, out=Matrix.of(routed))
    return routed


# The CUDA down kernel's K (the intermediate, per rank) from which it runs instead of the Triton TMA kernel:
# at GLM-5.3-Flash's 2048 it took 2661 us against 2845 at 13312 tokens; at a TP8 rank's 256 it lost at 13312
# tokens (883 against 781) and won by 5% at 1664 (RESULTS S43-2); between them it is unmeasured.
CUDA_DOWN_MIN_K = 2048


def _down_tma(
    h: torch.Tensor,
    h_scale: torch.Tensor,
    down: torch.Tensor,
    down_scale: torch.Tensor,
    layout: Alignment,
    weights: torch.Tensor,
    routed: torch.Tensor,
    config: MoeConfig,
) -> None:
    hidden, intermediate = down.shape[1:]
    if intermediate >= CUDA_DOWN_MIN_K and _grouped_cuda(h, down, down_scale, layout):
        grouped_cuda.down(h, h_scale, down, down_scale, layout, weights, routed)
        return
    num_blocks = layout.block_expert.numel()
    dn = config.down
    _down_tma_kernel[(num_blocks * triton.cdiv(hidden, dn.block_n),)](
        TensorDescriptor.from_tensor(h, [config.block_m, dn.block_k]),
        Rows.of(h, h_scale),
        TensorDescriptor.from_tensor(down.view(-1, intermediate), [dn.block_n, dn.block_k]),
        Weights.of(down, down_scale),
        layout,
        weights.float().contiguous(),
        Matrix.of(routed),
        num_blocks,
        **_tile_arguments(config, dn, hidden, intermediate),
    )


def _grouped_cuda(rows: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, layout: Alignment) -> bool:
    """The dispatch rule of the TMA configuration's GEMMs: the CUDA grouped kernels (`grouped_cuda`) where
    they take the operands and passed their check on this GPU, else the Triton TMA kernels."""
    return use_kernel(
        "moe.grouped_cuda",
        rows,
        lambda: grouped_cuda.refusal(rows, weight, scale, layout),
        kernel="the CUDA grouped GEMMs",
        fallback="the Triton TMA kernels",
    )


def down_combine_stage(
    h: torch.Tensor,
    h_scale: torch.Tensor | None,
    down: torch.Tensor,
    down_scale: torch.Tensor | None,
    layout: Alignment,
    weights: torch.Tensor,
    out_dtype: torch.dtype,
    config: MoeConfig,
    tickets: torch.Tensor,
    ids: torch.Tensor | None = None,
    first_expert: int | None = None,
    addend: torch.Tensor | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """`down_stage` and the combine in one launch, for a few tokens: Σ_k of each token's weighted rows
    (each rounded to `out_dtype`, summed in fp32 in a fixed order), `[T, D]`. `tickets`: int32
    zeros, at least one per column tile of the output, left zero. With `first_expert` (the layout
    placed only the pairs of the weights' experts, `align`), only the rows of the pairs whose global
    expert id in `ids [T, k]` lies in `[first_expert, first_expert + E)` are summed. With `addend`
    (`[T, D]` in `out_dtype`, unit last stride: the shared expert's output), the result is the sum
    plus it, bit for bit what adding the two afterwards gives, without that launch. With `shared`
    instead (the layout places its blocks, `decode.prologue`), the shared expert's own rows, rounded
    to `out_dtype`, are that addend."""
    if config.tma:
        raise ValueError("down_combine_stage: config.tma has no combining down kernel")
    if shared is not None and addend is not None:
        raise ValueError("down_combine_stage: the shared expert's rows are the addend; pass one of the two")
    tokens, top_k = weights.shape
    hidden = down.shape[1]
    column_tiles = triton.cdiv(hidden, config.down.block_n)
    if tickets.dtype != torch.int32 or tickets.numel() < column_tiles:
        raise ValueError(
            f"down_combine_stage: tickets must be int32 with at least {column_tiles} counters (D {hidden} / "
            f"down.block_n {config.down.block_n}), got {tickets.dtype} {tuple(tickets.shape)}"
        )
    partial = first_expert is not None
    if partial and (ids is None or ids.shape != weights.shape):
        raise ValueError(f"down_combine_stage: first_expert needs the ids [{tokens}, {top_k}] of the pairs")
    if addend is not None and (
        addend.shape != (tokens, hidden) or addend.dtype != out_dtype or addend.stride(-1) != 1
    ):
        raise ValueError(
            f"down_combine_stage: addend must be [{tokens}, {hidden}] {out_dtype} with a unit last stride, "
            f"got {addend.dtype} {tuple(addend.shape)}"
        )
    programs, arguments = _down_arguments(h, h_scale, down, down_scale, layout, weights, config)
    # the routed pairs' rows, then (with the shared expert) one row per token: pair T·k + t
    routed = torch.empty(tokens * (top_k + (shared is not None)), hidden, dtype=out_dtype, device=h.device)
    out = torch.empty(tokens, hidden, dtype=out_dtype, device=h.device)
    if shared is not None:
        addend = routed[tokens * top_k :]
    dependent = dependent_launches(out.device)
    _down_combine_kernel[(programs,)](
        **arguments,
        shared_w=_shared_operand(shared, 1, down, down_scale),
        routed=Matrix.of(routed),
        ids=ExpertIds(ids.contiguous() if partial else layout.pairs, first_expert or 0),  # read where PARTIAL
        addend=Matrix(out, 0) if addend is None else Matrix.of(addend),  # read only where ADD says so
        out=Matrix.of(out),
        tickets_ptr=tickets,
        num_tokens=tokens,
        TOP_K=top_k,
        K_PAD=triton.next_power_of_2(top_k),
        T_PAD=triton.next_power_of_2(tokens),
        E=down.shape[0],
        PARTIAL=partial,
        ADD=addend is not None,
        SHARED=shared is not None,
        SHARED_K=_narrower_shared(shared, down.shape[2]),
        PDL=dependent,
        launch_pdl=dependent,
    )
    return out


def experts(
    x: torch.Tensor, w: ExpertWeights, choices: Choices, limit: float,
    config: MoeConfig | None = None, first_expert: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """Same contract as `reference.experts` (`first_expert` included); FP8 weights (`w.scales`) take x
    quantised per token and group of 128, others must be in x's dtype."""
    return _run(x, w, choices, limit, config, first_expert)
