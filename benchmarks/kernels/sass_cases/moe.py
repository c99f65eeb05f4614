"""The MoE family (`ops/moe/decode.py`, `kernels.py`, `routing.py`) at GLM-5.3-Flash's shapes (hidden 4096,
288 experts top-8, intermediate 2048; weights allocated, never read): the decode path's three launches FP8
with the shared expert at 1 and 8 tokens, at an EP8 rank (placed pairs only, the shared expert's narrower
tensor slice), bf16 with an addend and FP8 with neither; the general path's routing, alignment (one program
and the count / place pair), gate|up and down GEMMs (weight-major, row-major, bf16, TMA with the row gather)
and the expert-parallel combine."""

from __future__ import annotations

import torch
from code_size import EXPERTS, HIDDEN, TOP_K

from hylo.ops.moe import decode, kernels, routing
from hylo.ops.moe.kernels import MoeConfig, Tiles
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing, SharedExpert

INTERMEDIATE = 2048
BF16 = torch.bfloat16
MODULES = (decode, kernels)
ROUTER = Routing(torch.zeros(EXPERTS, HIDDEN, dtype=BF16), torch.zeros(EXPERTS), TOP_K, 1, 1, True, 2.5)


def expert_weights(local: int, fp8: bool) -> ExpertWeights:
    """`local` experts' gate|up `[E, 2I, D]` and down `[E, D, I]`, e4m3 with their block scales or bf16."""
    dtype = torch.float8_e4m3fn if fp8 else BF16
    scales = (
        (
            torch.empty(local, 2 * INTERMEDIATE // 128, HIDDEN // 128),
            torch.empty(local, HIDDEN // 128, INTERMEDIATE // 128),
        )
        if fp8
        else None
    )
    return ExpertWeights(
        torch.empty(local, 2 * INTERMEDIATE, HIDDEN, dtype=dtype),
        torch.empty(local, HIDDEN, INTERMEDIATE, dtype=dtype),
        scales,
    )


def shared_expert(width: int, fp8: bool) -> SharedExpert:
    """The shared expert's tensors at intermediate `width` (a tensor-parallel slice where narrower)."""
    dtype = torch.float8_e4m3fn if fp8 else BF16
    scales = (torch.empty(2 * width // 128, HIDDEN // 128), torch.empty(HIDDEN // 128, width // 128))
    return SharedExpert(
        torch.empty(2 * width, HIDDEN, dtype=dtype),
        torch.empty(HIDDEN, width, dtype=dtype),
        scales if fp8 else None,
    )


def decode_step(
    tokens: int,
    fp8: bool = True,
    shared: int = INTERMEDIATE,
    ranks: int = 1,
    rank: int = 0,
    addend: bool = False,
) -> None:
    """`decode.routed_experts` at rank `rank` of `ranks` splitting the experts by expert (ranks 1: every
    expert, no `first_expert`), with the shared expert at intermediate `shared` (0: none) or an addend."""
    local = EXPERTS // ranks
    x = torch.zeros(tokens, HIDDEN, dtype=BF16)
    decode.routed_experts(
        x,
        ROUTER,
        expert_weights(local, fp8),
        10.0,
        first_expert=None if ranks == 1 else rank * local,
        addend=torch.zeros(tokens, HIDDEN, dtype=BF16) if addend else None,
        shared=shared_expert(shared, fp8) if shared else None,
    )


def general(tokens: int, fp8: bool = True, ranks: int = 1, config: MoeConfig | None = None) -> None:
    """`kernels.experts` on fixed choices (rank 1 of `ranks` where more than 1), `config` or the default."""
    local = EXPERTS // ranks
    choices = Choices(torch.zeros(tokens, TOP_K, dtype=torch.int64), torch.ones(tokens, TOP_K))
    x = torch.zeros(tokens, HIDDEN, dtype=BF16)
    first = None if ranks == 1 else local
    kernels.experts(x, expert_weights(local, fp8), choices, 10.0, config, first)


ROW_MAJOR = MoeConfig(64, Tiles(128, 128, 8, 4), Tiles(256, 128, 8, 3))  # FP8 prefill without TMA
TMA = MoeConfig(64, Tiles(128, 128, 8, 4), Tiles(128, 128, 4, 4), tma=True)

CASES = {
    "route_t8": lambda: routing.route(torch.zeros(8, HIDDEN, dtype=BF16), ROUTER),
    "decode_fp8_shared_t1": lambda: decode_step(1),
    "decode_fp8_shared_t8": lambda: decode_step(8),
    "decode_fp8_ep8_rank1_t1": lambda: decode_step(1, shared=INTERMEDIATE // 8, ranks=8, rank=1),
    "decode_fp8_plain_t4": lambda: decode_step(4, shared=0),
    "decode_bf16_ep8_addend_t2": lambda: decode_step(2, fp8=False, shared=0, ranks=8, addend=True),
    "experts_fp8_t8": lambda: general(8),
    "experts_fp8_ep8_t8": lambda: general(8, ranks=8),
    "experts_bf16_ep8_t8": lambda: general(8, fp8=False, ranks=8),
    "experts_fp8_row_major_t40": lambda: general(40, config=ROW_MAJOR),
    "experts_fp8_tma_t8": lambda: general(8, config=TMA),
}
