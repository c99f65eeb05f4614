"""The MoE step of a few tokens (decode, short verify) in three launches instead of seven.

1. `prologue`: the router logits, one program a (block of `block_e` router rows, token) (many programs
   read the router's 2.4 MB at bandwidth, each token's programs side by side, and every logit is one
   program's dot product, so nothing is reduced across programs), the FP8 quantisation of x (one
   128-channel group per program); the program that arrives last among a token's (an atomic ticket per
   token, no waiting) routes that token (`routing.route_tokens`), and the last token routed aligns every
   pair (at expert parallelism, the pairs of the experts the weights hold only: `first_expert`). The
   alignment reads the ids the routing stored back, one pair a lane, and runs in registers: a pair's
   rank within its expert and its expert's first block come from comparisons of every pair with every
   other (at most `MAX_PAIRS`² of them), with no atomics. (Placing from the routing's own `[T, k]`
   registers, reshaped to one pair a lane, placed some pairs wrongly on an H100 at 64 experts and 64
   pairs.)
2. `kernels.gate_up_stage`, as in the general path, its K split over programs (`gate_up_splits`): one
   token at a TP8/EP8 rank reaches about one of its 36 experts, whose 16 column tiles would otherwise
   stream 17 MB on 16 SMs (split 8 ways: the rank's B = 1 step -13.7% on an H100, RESULTS S34-2); the
   last program of each tile sums the splits in a fixed order.
3. `kernels.down_combine_stage`: the down GEMM, whose last program of each column tile sums every
   token's k weighted rows (its placed ones, at expert parallelism) in a fixed order (the combine).

The shared expert (`SharedExpert`, its own tensors; `kernels.shared_refusal` None: one routed expert's
layout, at most as wide) may join as one more pair of weight 1 per token: the prologue places its blocks
first, the two GEMM launches read its tensors for those blocks, and the combine adds its rows as the
addend. A MoE layer's decode then runs these three launches instead of six (its gate|up GEMM,
activation and down GEMM apart): at a TP8/EP8 rank, with the shared expert's tensor slice, 126
launches fewer a step of the 45-layer model, -3.2% (S34-2).

The ticket counters are zero between launches: the last program of each counter puts it back, so a
CUDA graph replays the launches as they are. Each CUDA stream gets its own counters (`tickets`), so
launches on different streams never share one; launches of one stream run one after another.

H200, GLM-5.3-Flash shapes, FP8 experts, graph replays (`benchmarks/kernels/moe.py`): one token
65.4 us against 82.1 for the general path (prologue 4.7 us where the router GEMM, routing kernel, x
quantisation and alignment took 16.7; down with the combine 20.8 against 19.3 + 2.2); four tokens
214.0 against 221.9. Launched as programmatic dependents (`ops.dependent_launch`), gate|up alone once
measured +4 us at one FP8 token and within ±1.4 us otherwise (H200); with every kernel of the decode
step a dependent the whole step measured 0.2% (one token) and 0.8% (eight) faster on the H100 (RESULTS
S32-2), so all three launches are dependents like the rest; the MoE launches alone were not re-measured.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import triton
import triton.language as tl

from hylo.ops.dependent_launch import dependent_launches
from hylo.ops.dependent_launch_jit import enter
from hylo.ops.fp8 import FP8_BLOCK
from hylo.ops.fp8.kernels import quantize_tile
from hylo.ops.moe import kernels
from hylo.ops.moe.kernels import MoeConfig
from hylo.ops.moe.operands import Fp8Rows, Matrix, Placement, Router
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert
from hylo.ops.moe.routing import (
    SHARED_EXPERT,
    Alignment,
    check_route,
    choice_constants,
    max_blocks,
    placed_experts,
    route_tokens,
)

MAX_PAIRS = 64  # (token, choice) pairs of a step on this path: the alignment's [pairs, pairs] fits registers
# counters per stream: the down launch takes one per column tile (D / block_n), a split gate|up one per (row
# block, column tile): up to (MAX_PAIRS / 16 + MAX_PAIRS + 1) x I / 128 = 1104 at GLM-5.3-Flash's sizes
TICKET_SLOTS = 2048
_SPARE_STREAMS = 8  # counter sets made at once, so a stream first seen during a graph capture finds one
_TICKETS: dict[tuple[torch.device, int], torch.Tensor] = {}
_SPARE: dict[torch.device, list[torch.Tensor]] = {}


def fits(tokens: int, top_k: int) -> bool:
    """Whether a step of `tokens` tokens takes this path."""
    return tokens * top_k <= MAX_PAIRS


def tickets(device: torch.device) -> torch.Tensor:
    """The int32 ticket counters of the current stream of `device`, zero between launches. Counter
    sets are zeroed outside graph captures, a few at a time, and never freed: a captured graph keeps
    using the set of the stream it was captured on."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    key = (device, stream)
    if key not in _TICKETS:
        spare = _SPARE.setdefault(device, [])
        if not spare:
            if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
                # zeros made inside a capture would only be written when the graph replays
                raise RuntimeError(
                    "MoE decode: run one step on this device before capturing a CUDA graph, "
                    "so its ticket counters are zeroed outside the capture"
                )
            sets = torch.zeros(_SPARE_STREAMS, TICKET_SLOTS, dtype=torch.int32, device=device)
            spare.extend(sets.unbind())
        _TICKETS[key] = spare.pop()
    return _TICKETS[key]


@triton.jit
def _place_pairs(
    ids_ptr,
    num_pairs,
    layout,
    placement,
    PAIRS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
):
    """`routing.align` of the `num_pairs` global ids at `ids_ptr` (this program wrote them: they are
    read back after a barrier, one pair a lane) from registers, into `layout` (`Alignment`) as `placement`
    says (`Placement`): only the pairs of its experts, numbered from 0; a pair's rank is the number of
    earlier pairs of its expert, its expert's first block the blocks of all smaller placed experts
    (counted once, at each expert's first pair). The shared expert's pairs of `shared_tokens` tokens
    (at most PAIRS) come first: token t's pair num_pairs + t in slot t, cdiv(shared_tokens, BLOCK_M)
    blocks of `SHARED_EXPERT`."""
    shared_tokens = placement.shared_tokens
    lane = tl.arange(0, PAIRS)  # pair index t·k + j; for the shared expert, token t
    shared_blocks = (shared_tokens + BLOCK_M - 1) // BLOCK_M
    mine = lane < shared_tokens
    tl.store(layout.pairs + lane, num_pairs + lane, mask=mine)
    # the lanes of one block all write its expert and row count
    tl.store(layout.block_expert + lane // BLOCK_M, tl.full([PAIRS], SHARED_EXPERT, tl.int32), mask=mine)
    shared_rows = tl.minimum(shared_tokens - (lane // BLOCK_M) * BLOCK_M, BLOCK_M)
    tl.store(layout.block_rows + lane // BLOCK_M, shared_rows, mask=mine)
    expert, valid = placed_experts(
        ids_ptr, lane, lane < num_pairs, placement.first_expert, placement.num_experts
    )
    same = (expert[:, None] == expert[None, :]) & valid[None, :]
    rank = tl.sum((same & (lane[None, :] < lane[:, None])).to(tl.int32), axis=1)
    count = tl.sum(same.to(tl.int32), axis=1)
    blocks = tl.where(valid & (rank == 0), (count + BLOCK_M - 1) // BLOCK_M, 0)
    smaller = tl.sum(tl.where(expert[None, :] < expert[:, None], blocks[None, :], 0), axis=1)
    first_block = shared_blocks + smaller
    tl.store(layout.pairs + first_block * BLOCK_M + rank, lane, mask=valid)
    block = rank // BLOCK_M
    # the pairs of one block all write its expert and row count
    tl.store(layout.block_expert + first_block + block, expert, mask=valid)
    rows = tl.minimum(count - block * BLOCK_M, BLOCK_M)
    tl.store(layout.block_rows + first_block + block, rows, mask=valid)
    b = tl.arange(0, BLOCKS_PAD)
    unused = (b >= shared_blocks + tl.sum(blocks, axis=0)) & (b < placement.num_blocks)
    tl.store(layout.block_expert + b, tl.full([BLOCKS_PAD], -1, tl.int32), mask=unused)
    tl.store(layout.block_rows + b, tl.zeros([BLOCKS_PAD], tl.int32), mask=unused)


@triton.jit
def _prologue_kernel(
    x,
    router,
    logits_ptr,
    choices,
    x_fp8,
    layout,
    tickets_ptr,
    num_tokens,
    placement,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    BLOCK_E: tl.constexpr,
    E_BLOCKS: tl.constexpr,
    T_PAD: tl.constexpr,
    QUANTIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCKS_PAD: tl.constexpr,
    E: tl.constexpr,
    E_PAD: tl.constexpr,
    TOP_K: tl.constexpr,
    K_PAD: tl.constexpr,
    N_GROUP: tl.constexpr,
    G_PAD: tl.constexpr,
    TOPK_GROUP: tl.constexpr,
    NORMALIZE: tl.constexpr,
    PDL: tl.constexpr,
):
    """`prologue`'s launch: one program a (`BLOCK_E` rows of the `router`, token): that token's logits of
    those experts (x `[T, D]` a `Matrix`, the logits `[T, E]` fp32), and x's FP8 groups (`x_fp8`, `Fp8Rows`)
    in the first programs; the last program of each token (a ticket per token) routes it into `choices`
    (`Choices`: ids and weights), and the last token routed places every pair into `layout` (`Alignment`)
    as `placement` says. Tokens route in parallel, one bitonic top-k each: 8 tokens routed by
    one program took ~6 of the launch's 17 us on an H100 (RESULTS S35-1)."""
    enter(PDL)
    pid = tl.program_id(0)
    if QUANTIZE:  # noqa: SIM102 (a constexpr test: the kernel compiles without the branch)
        if pid < tl.cdiv(D, 128):
            tokens = tl.arange(0, T_PAD)
            quantize_tile(
                x.data, x_fp8.data, x_fp8.scales, tokens, pid, num_tokens, x.stride, D, tl.cdiv(D, 128), D
            )
    # a token's programs are its row blocks; the programs past them (there for the FP8 groups) stop here
    if pid < E_BLOCKS * num_tokens:
        token = pid % num_tokens  # one router block's programs side by side: its rows are read from L2
        e = (pid // num_tokens) * BLOCK_E + tl.arange(0, BLOCK_E)
        e_ok = e < E
        d = tl.arange(0, D_PAD)
        w_rows = router.weight + e[:, None].to(tl.int64) * router.row_stride + d[None, :]
        w = tl.load(w_rows, mask=e_ok[:, None] & (d < D)[None, :], other=0.0).to(tl.float32)
        x_row = tl.load(x.data + token * x.stride + d, mask=d < D, other=0.0).to(tl.float32)
        tl.store(logits_ptr + token * E + e, tl.sum(w * x_row[None, :], axis=1), mask=e_ok)
        tl.debug_barrier()  # all of this program's logits are stored before its ticket releases them
        if tl.atomic_add(tickets_ptr + 1 + token, 1, sem="acq_rel") == E_BLOCKS - 1:
            tl.store(tickets_ptr + 1 + token, 0)
            t = token + tl.arange(0, 1)
            route_tokens(
                logits_ptr, router.bias, choices.ids, choices.weights, t, t < num_tokens, router.scaling,
                E, E_PAD, TOP_K, K_PAD, N_GROUP, G_PAD, TOPK_GROUP, NORMALIZE,
            )  # fmt: skip
            tl.debug_barrier()  # this token's ids are stored before its ticket releases them
            last = num_tokens == 1  # one token's last program is the launch's: no second ticket
            if num_tokens > 1:
                last = tl.atomic_add(tickets_ptr, 1, sem="acq_rel") == num_tokens - 1
                if last:
                    tl.store(tickets_ptr, 0)
            if last:
                _place_pairs(
                    choices.ids, num_tokens * TOP_K, layout, placement, T_PAD * K_PAD, BLOCK_M, BLOCKS_PAD
                )


def _placed_span(first_expert: int | None, num_experts: int | None, all_experts: int) -> tuple[int, int]:
    """(first global id, count) of the experts the alignment places, out of the router's `all_experts`."""
    if first_expert is None:
        if num_experts not in (None, all_experts):
            raise ValueError(
                f"MoE decode: {num_experts} experts without first_expert, but the router has {all_experts}"
            )
        return 0, all_experts
    if num_experts is None or not (first_expert >= 0 and first_expert + num_experts <= all_experts):
        raise ValueError(
            f"MoE decode: experts [{first_expert}, {first_expert} + {num_experts}) are not among the "
            f"router's {all_experts}"
        )
    return first_expert, num_experts


def prologue(
    x: torch.Tensor,
    routing: Routing,
    block_m: int,
    quantize: bool,
    block_e: int | None = None,
    num_warps: int | None = None,
    first_expert: int | None = None,
    num_experts: int | None = None,
    shared: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, Alignment, torch.Tensor | None, torch.Tensor | None]:
    """One launch: (global ids `[T, k]`, weights `[T, k]`, alignment into `block_m`-row blocks, and with
    `quantize` x as e4m3 `[T, D]` with its fp32 group scales `[T, ceil(D/128)]`, else None, None).
    Every token is routed over all of routing's experts; the alignment places the pairs of the
    `num_experts` experts from global id `first_expert` (a rank's, split by expert), numbered from 0,
    or with `first_expert` None every pair; with `shared`, after one pair per token of the shared
    expert, in the first blocks (`Alignment`). `block_e` router rows per program and `num_warps`, where
    not given, by the token count (`prologue_tiles`)."""
    check_route(x, routing)
    tokens, hidden = x.shape
    rule_e, rule_warps = prologue_tiles(tokens)
    block_e, num_warps = block_e or rule_e, num_warps or rule_warps
    all_experts, top_k = routing.weight.shape[0], routing.top_k
    first_expert, num_experts = _placed_span(first_expert, num_experts, all_experts)
    if not fits(tokens, top_k):
        raise ValueError(f"prologue: x has {tokens} tokens, more than {MAX_PAIRS // top_k} at top-{top_k}")
    x = x.contiguous()
    device = x.device
    ids = torch.empty(tokens, top_k, dtype=torch.int64, device=device)
    weights = torch.empty(tokens, top_k, dtype=torch.float32, device=device)
    num_blocks = layout_blocks(tokens, top_k, num_experts, block_m, shared)
    layout = Alignment(
        torch.empty(num_blocks * block_m, dtype=torch.int32, device=device),
        torch.empty(num_blocks, dtype=torch.int32, device=device),
        torch.empty(num_blocks, dtype=torch.int32, device=device),
        block_m,
    )
    groups = triton.cdiv(hidden, FP8_BLOCK)
    q = torch.empty(tokens, hidden, dtype=torch.float8_e4m3fn, device=device) if quantize else None
    q_scale = torch.empty(tokens, groups, dtype=torch.float32, device=device) if quantize else None
    if tokens == 0:
        return ids, weights, layout, q, q_scale
    programs = max(triton.cdiv(all_experts, block_e) * tokens, groups if quantize else 1)
    dependent = dependent_launches(device)
    _prologue_kernel[(programs,)](
        Matrix.of(x),
        Router.of(routing),
        torch.empty(tokens, all_experts, dtype=torch.float32, device=device),  # the logits
        Choices(ids, weights),
        Fp8Rows(x, weights) if q is None else Fp8Rows(q, q_scale),  # read only where QUANTIZE says so
        layout,
        tickets(device),
        tokens,
        Placement(num_blocks, first_expert, num_experts, tokens if shared else 0),
        D=hidden,
        D_PAD=triton.next_power_of_2(hidden),
        BLOCK_E=block_e,
        E_BLOCKS=triton.cdiv(all_experts, block_e),
        T_PAD=triton.next_power_of_2(tokens),
        QUANTIZE=quantize,
        BLOCK_M=block_m,
        BLOCKS_PAD=triton.next_power_of_2(num_blocks),
        **choice_constants(all_experts, top_k, routing.n_group, routing.topk_group, routing.normalize),
        num_warps=num_warps,
        PDL=dependent,
        launch_pdl=dependent,
    )
    return ids, weights, layout, q, q_scale


def prologue_tiles(tokens: int) -> tuple[int, int]:
    """(router rows a program, warps) of `prologue` for `tokens` tokens: the fastest of
    `benchmarks/kernels/moe.py --only prologue` alone on an H100 (RESULTS S37-1, us): one token (1, 8)
    5.16 against (1, 4) 5.52; two and four tokens (1, 4) 6.15 and 7.10; eight tokens (4, 8) 11.42 against
    (1, 4) 16.07 (one-row programs: 2304 of them at 8 tokens)."""
    if tokens == 1:
        return 1, 8
    return (1, 4) if tokens < 8 else (4, 8)


def layout_blocks(tokens: int, top_k: int, num_experts: int, block_m: int, shared: bool) -> int:
    """Row blocks of `prologue`'s alignment: the bound for the step's pairs over `num_experts` experts,
    plus the shared expert's blocks (its pair per token, first) with `shared`."""
    return max_blocks(tokens * top_k, num_experts, block_m) + shared * triton.cdiv(tokens, block_m)


# the K depth a split gate|up program streams at least, by its tiles' product: row-major (mma.sync on
# weights widened to fp16) 512, 8 splits of GLM-5.3-Flash's 4096, as fast as no split or faster at every
# measured step, 256 slower where many experts are reached (RESULTS S35-1); weight-major (`Tiles.swap_ab`,
# wgmma on e4m3) 1024, its programs' stream being faster: 4 splits against 8 at a TP8 rank's 8 tokens
# 108.8 against 116.3 us, one token 33.0 against 33.5 (H100, RESULTS S36-1)
MIN_SPLIT_DEPTH = {False: 512, True: 1024}


def gate_up_splits(num_blocks: int, gate_up_shape: torch.Size, config: MoeConfig) -> int:
    """K splits of the gate|up launch (`kernels.gate_up_stage`) with weights `gate_up_shape` `[E, 2I, D]` and
    a layout of `num_blocks` row blocks: the most that leave every program `MIN_SPLIT_DEPTH` (of the
    tiles' product) or more of K, in whole 128-deep steps (powers of two), with a ticket per (row block,
    column tile) within the stream's counters. Splitting whatever the routing: a graph's launch is fixed
    before its steps are routed, and a step reaches anywhere from one expert of a TP8/EP8 rank's 36 (16
    column tiles would stream its 17 MB on 16 SMs) to 64 of 288 (H100, rank 0 of TP8 at 8 clustered
    tokens, a verify block's routing: 73.7 us unsplit, 64.8 split 8 ways; 8 random tokens at TP1 91.5% of
    the copy rate split, 90.7 not, RESULTS S35-1; measured with FP8 weights, bf16 ones take the same rule
    unmeasured)."""
    _, two_i, hidden = gate_up_shape
    n_tiles = triton.cdiv(two_i // 2, config.gate_up.block_n)
    if num_blocks * n_tiles > TICKET_SLOTS:
        return 1
    splits = 1
    min_depth = MIN_SPLIT_DEPTH[config.gate_up.swap_ab]
    while hidden % (splits * 2 * FP8_BLOCK) == 0 and hidden // (splits * 2) >= min_depth:
        splits *= 2
    return splits


def routed_experts(
    x: torch.Tensor,
    routing: Routing,
    w: ExpertWeights,
    limit: float,
    config: MoeConfig | None = None,
    first_expert: int | None = None,
    addend: torch.Tensor | None = None,
    shared: SharedExpert | None = None,
) -> torch.Tensor:
    """`route` then `kernels.experts` for at most `MAX_PAIRS` pairs, in three launches (module
    docstring). `first_expert`: as in `kernels.experts` (the weights hold global experts from
    `first_expert` on, and only their pairs are computed); None: the weights hold all of routing's
    experts. `addend [T, D]` (x's dtype): added to the result in the combine (`down_combine_stage`).
    `shared` (in place of an addend; `kernels.shared_refusal` None): the shared expert, one more pair
    of weight 1 per token in the same launches, its output the combine's addend (`reference.experts`
    with `shared`)."""
    tokens, top_k = x.shape[0], routing.top_k
    gate_up_scale, down_scale = w.scales or (None, None)
    shape = torch.empty(tokens, top_k, device="meta")  # the ids and weights `prologue` will make
    explicit = config
    config = kernels.check_experts(x, w, Choices(shape, shape), config)
    if shared is not None:
        if addend is not None:
            raise ValueError("MoE decode: the shared expert's output is the addend; pass one of the two")
        refusal = kernels.shared_refusal(w, shared)
        if refusal is not None:
            raise ValueError(f"MoE decode: {refusal}")
    fp8, local = w.scales is not None, w.gate_up.shape[0]
    ids, weights, layout, q, q_scale = prologue(
        x,
        routing,
        config.block_m,
        fp8,
        first_expert=first_expert,
        num_experts=local,
        shared=shared is not None,
    )
    if tokens == 0:
        return torch.zeros(0, x.shape[1], dtype=x.dtype, device=x.device) if addend is None else addend
    activations = x.contiguous() if q is None else q
    if explicit is None:
        splits = gate_up_splits(layout.block_expert.numel(), w.gate_up.shape, config)
        # split tiles walk the row blocks one by one, so the live blocks' programs launch first (TP8/EP8
        # rank, one token: 38.4 -> 36.4 us a step, H100, RESULTS S35-1)
        group_m = 1 if splits > 1 else config.group_m
        config = replace(config, gate_up=replace(config.gate_up, splits=splits), group_m=group_m)
    counters = tickets(x.device)
    h, h_scale = kernels.gate_up_stage(
        activations, q_scale, w.gate_up, gate_up_scale, layout, top_k, limit, config, shared, counters
    )
    return kernels.down_combine_stage(
        h, h_scale, w.down, down_scale, layout, weights, x.dtype, config, counters, ids,
        first_expert, addend, shared,
    )  # fmt: skip
