"""MoE kernels on the GPU: real-shape parity, then timings of hylo's routed-expert step (routing +
permutation + grouped GEMMs + combine), bf16 and FP8 block-scaled, against the eager torch
reference, the copy ceiling on the weight bytes a decode step reads, and the FP8 / bf16 matmul
ceilings measured in the same run.

    python benchmarks/kernels/moe.py [--sweep] [--only SECTIONS] [--out DIR]
    python benchmarks/kernels/moe.py --dry-run   # CPU, Triton interpreter, tiny sizes, fake timers

Shapes follow GLM-5.3-Flash: hidden 4096, expert intermediate 2048, 288 experts, top-8, scaling 2.5,
SwiGLU limit 10 (the shared expert is not part of the step). Decode steps (M = 1, 4, 16 tokens) are
CUDA-graph replays that cycle through 4 batches routed to different experts, so weights come from
HBM, not L2; their floor is (distinct experts × 3·I·D bytes + scales) / copy bandwidth, the copy
bandwidth counting read + write bytes of a 1 GiB device copy. Prefill is M = 8192 tokens.
Steps of at most `moe_decode.MAX_PAIRS` (token, choice) pairs (M = 1, 4) run by default as the three
launches of `hylo.ops.moe.decode` (fused routing prologue, gate|up, down with the combine); the
general path (router GEMM, routing, x quantisation, alignment, the two GEMMs, combine) is timed beside
them as `*_general_*`. `--sweep` times candidate tile configurations (checked for parity first); the
`breakdown` section (`--only breakdown`) times each launch of an FP8 decode step on its own, both
paths, and the prologue's variants, and lists the kernels of an FP8 prefill step (torch.profiler).
`--only rank_decode [--ranks 1,8]` times rank 0's FP8 decode step at TP/EP 1 and 8 (at 8 its 36
experts and the shared expert's slice) in each K split of the gate|up launch (`rank_configs`).
`--only prologue` times the decode prologue alone at 1-8 tokens with its router read cold, in each
(router rows a program, warps) of `PROLOGUE_VARIANTS`.
`--only prefill_sweep` times the FP8 prefill step in each of `PREFILL_VARIANTS` (compiled first in
parallel processes) against the FP8 matmul ceiling measured after the compiles, with each variant's
output against the default's and its per-kernel times. Prints a table last and writes `moe.json` to
--out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
if DRY:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from interpreter import use_interpreter

    use_interpreter()

from harness import RESULTS, bench, bench_graph, fp8_ceiling, rec, section  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.ops import fp8 as fp8_ops  # noqa: E402
from hylo.ops.fp8 import kernels as fp8_kernels  # noqa: E402
from hylo.ops.moe import decode as moe_decode  # noqa: E402
from hylo.ops.moe import kernels, reference, routing  # noqa: E402
from hylo.ops.moe.kernels import MoeConfig, Tiles  # noqa: E402
from hylo.ops.moe.reference import Choices, ExpertWeights, Routing  # noqa: E402

DEV = "cpu" if DRY else "cuda"
# the interpreter's bf16 dot is wrong: the dry run's "bf16" path runs on fp32
ACT = torch.float32 if DRY else torch.bfloat16
HIDDEN, INTER, EXPERTS, TOP_K = (128, 128, 16, 4) if DRY else (4096, 2048, 288, 8)
LIMIT, SCALING = 10.0, 2.5
DECODE_TOKENS = (1, 4, 8, 16)  # 8: a batch of 8, or one DFlash verify block
FUSED_TOKENS = tuple(t for t in DECODE_TOKENS if moe_decode.fits(t, TOP_K))
PREFILL_TOKENS = 48 if DRY else 8192
ROTATE = 4  # decode batches per timed call, each routed to its own experts
START = time.time()
SWEEP_UNTIL_S = [540]  # seconds after the start (--sweep-until-s): the device stops a command at 600


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


class Model:
    """Random router and experts: bf16, their block-FP8 quantisation and its dequantisation (the
    FP8 reference), built a few experts at a time to bound the fp32 temporaries."""

    def __init__(self, seed: int = 0):
        torch.manual_seed(seed)
        self.router = torch.randn(EXPERTS, HIDDEN, device=DEV, dtype=ACT) * HIDDEN**-0.5
        self.bias = torch.randn(EXPERTS, device=DEV) * 0.01
        self.routing = Routing(self.router, self.bias, TOP_K, 1, 1, True, SCALING)
        self.gate_up = torch.empty(EXPERTS, 2 * INTER, HIDDEN, device=DEV, dtype=ACT)
        self.down = torch.empty(EXPERTS, HIDDEN, INTER, device=DEV, dtype=ACT)
        self.fp8: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.dequantized: dict[str, torch.Tensor] = {}
        for name, weight in (("gate_up", self.gate_up), ("down", self.down)):
            q = torch.empty(weight.shape, device=DEV, dtype=torch.float8_e4m3fn)
            s = torch.empty(EXPERTS, -(-weight.shape[1] // 128), -(-weight.shape[2] // 128), device=DEV)
            deq = torch.empty_like(weight)
            for e in range(0, EXPERTS, 16):
                chunk = slice(e, e + 16)
                weight[chunk] = (
                    torch.randn(weight[chunk].shape, device=DEV, dtype=ACT) * weight.shape[2] ** -0.5
                )
                q[chunk], s[chunk] = fp8_ops.quantize_fp8_blocks(weight[chunk])
                deq[chunk] = fp8_ops.dequantize_fp8_blocks(q[chunk], s[chunk], ACT)
            self.fp8[name], self.dequantized[name] = (q, s), deq

    def route(self, x):
        return routing.route(x, self.routing)

    def expert_weights(self, fp8: bool) -> ExpertWeights:
        """The experts' weights as the kernels take them: bf16, or e4m3 with their block scales."""
        if fp8:
            (gate_up, gate_up_scale), (down, down_scale) = self.fp8["gate_up"], self.fp8["down"]
            return ExpertWeights(gate_up, down, (gate_up_scale, down_scale))
        return ExpertWeights(self.gate_up, self.down)

    def experts(self, x, ids, weights, fp8: bool, config: MoeConfig | None = None):
        return kernels.experts(x, self.expert_weights(fp8), Choices(ids, weights), LIMIT, config)

    def step(self, x, fp8: bool, config: MoeConfig | None = None):
        """The general path: routing, then the experts."""
        return self.experts(x, *self.route(x), fp8, config)

    def fused_step(self, x, fp8: bool):
        """The decode path (`moe_decode.routed_experts`)."""
        return moe_decode.routed_experts(x, self.routing, self.expert_weights(fp8), LIMIT)

    def reference(self, x, ids, weights, fp8: bool):
        gate_up, down = (
            (self.dequantized["gate_up"], self.dequantized["down"]) if fp8 else (self.gate_up, self.down)
        )
        return reference.experts(x, ExpertWeights(gate_up, down), Choices(ids, weights), LIMIT)

    def bytes_read(self, ids: torch.Tensor, fp8: bool) -> int:
        """Weight bytes of the distinct experts `ids` names (+ their scales for FP8)."""
        per_expert = 3 * INTER * HIDDEN * (1 if fp8 else 2)
        if fp8:
            per_expert += 4 * sum(s[0].numel() for _, s in self.fp8.values())
        return int(ids.unique().numel()) * per_expert


def batch(tokens: int, seed: int, spread: float | None = None) -> torch.Tensor:
    """`tokens` random rows; with `spread`, one random row plus `spread` x noise per token, so that
    the tokens share experts as a verify block's do (0.5: 8 tokens reach ~25 of 288, not ~57)."""
    gen = torch.Generator(device=DEV).manual_seed(seed)
    if spread is None:
        return torch.randn(tokens, HIDDEN, device=DEV, dtype=ACT, generator=gen)
    common = torch.randn(1, HIDDEN, device=DEV, generator=gen)
    return (common + spread * torch.randn(tokens, HIDDEN, device=DEV, generator=gen)).to(ACT)


# ---------------------------------------------------------------- ceilings


def ceilings() -> None:
    x = torch.randn(1 << (16 if DRY else 29), device=DEV, dtype=torch.bfloat16)  # 1 GiB
    y = torch.empty_like(x)
    t = bench(lambda: y.copy_(x))
    rec("copy_TBps", round(2 * x.numel() * 2 / (t * 1e-6) / 1e12, 3))
    n = 256 if DRY else 8192
    a = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=DEV, dtype=torch.bfloat16)
    rec("bf16_matmul_TFLOPs", round(2 * n**3 / (bench(lambda: a @ b) * 1e-6) / 1e12, 1))
    fp8_ceiling()


# ---------------------------------------------------------------- parity


def parity(model: Model) -> None:
    for tokens in (1, 16, 300, PREFILL_TOKENS):
        x = batch(tokens, seed=tokens)
        ids, weights = model.route(x)
        ref_ids, ref_weights = reference.route(x, model.routing)
        same = ids == ref_ids
        rec(f"parity_route_T{tokens}_ids_equal_share", round(float(same.float().mean()), 5))
        rows = same.all(-1)  # tokens whose choice agrees (near-ties may flip with the summation order)
        if rows.any():
            rec(f"parity_route_T{tokens}_weights_maxdiff", float((weights - ref_weights)[rows].abs().max()))
        for fp8 in (False, True):
            tag = "fp8" if fp8 else "bf16"
            out = model.experts(x, ref_ids, ref_weights, fp8)
            rec(
                f"parity_{tag}_T{tokens}_relerr",
                round(rel_err(out, model.reference(x, ref_ids, ref_weights, fp8)), 5),
            )
        rec(
            f"parity_fp8_vs_bf16_weights_T{tokens}_relerr",
            round(rel_err(out, model.reference(x, ref_ids, ref_weights, False)), 5),
        )
        q, s = fp8_kernels.quantize_groups(x)
        ref_q, ref_s = fp8_ops.quantize_fp8_groups(x)
        rec(
            f"parity_quantize_T{tokens}_equal",
            bool(torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s)),
        )
    for tokens in (1, 4, 8):  # up to the decode path's largest step at top-8
        if moe_decode.fits(tokens, TOP_K):
            fused_parity(model, tokens)


def fused_parity(model: Model, tokens: int) -> None:
    """The decode path's routing, quantised x and alignment against the references, and its output
    against the general path's on the same routing (random routings: most tokens' experts differ)."""
    tag = f"parity_fused_T{tokens}"
    x = batch(tokens, seed=1000 + tokens)
    config = kernels.default_config(tokens * TOP_K, EXPERTS, True)
    ids, weights, layout, q, s = moe_decode.prologue(x, model.routing, config.block_m, quantize=True)
    ref_ids, ref_weights = reference.route(x, model.routing)
    rec(f"{tag}_route_ids_equal", bool(torch.equal(ids, ref_ids)))
    rec(f"{tag}_route_weights_maxdiff", float((weights - ref_weights).abs().max()))
    # against the general path's kernel: on the GPU the torch reference divides by 448 as a multiply
    ref_q, ref_s = fp8_kernels.quantize_groups(x)
    rec(
        f"{tag}_quantize_equal_general", bool(torch.equal(q.float(), ref_q.float()) and torch.equal(s, ref_s))
    )
    general = routing.align(ids, EXPERTS, config.block_m)
    rec(
        f"{tag}_blocks_equal",
        bool(torch.equal(layout.block_expert, general.block_expert))
        and bool(torch.equal(layout.block_rows, general.block_rows)),
    )
    for fp8 in (False, True):
        kind = "fp8" if fp8 else "bf16"
        out = model.fused_step(x, fp8)
        rec(f"{tag}_{kind}_relerr_vs_general", round(rel_err(out, model.experts(x, ids, weights, fp8)), 6))
        rec(
            f"{tag}_{kind}_relerr_vs_reference",
            round(rel_err(out, model.reference(x, ref_ids, ref_weights, fp8)), 5),
        )
        rec(f"{tag}_{kind}_repeats_bitwise", bool(torch.equal(out, model.fused_step(x, fp8))))


# ---------------------------------------------------------------- timings


def decode(model: Model) -> None:
    """`step`: the default path of the step's size (the decode path up to `moe_decode.MAX_PAIRS` pairs),
    `general_step`: the general path, `experts`: the general path's experts without the routing."""
    bandwidth = RESULTS["copy_TBps"] * 1e12
    for tokens in DECODE_TOKENS:
        xs = [batch(tokens, seed=100 * tokens + r) for r in range(ROTATE)]
        routes = [model.route(x) for x in xs]
        for fp8 in (True, False):
            tag = f"decode_T{tokens}_{'fp8' if fp8 else 'bf16'}"
            floor_us = sum(model.bytes_read(ids, fp8) for ids, _ in routes) / bandwidth * 1e6 / ROTATE
            rec(f"{tag}_floor_us", round(floor_us, 2))

            def general_step(fp8=fp8, xs=xs):
                for x in xs:
                    model.step(x, fp8)

            def fused_step(fp8=fp8, xs=xs):
                for x in xs:
                    model.fused_step(x, fp8)

            def experts_only(fp8=fp8, xs=xs, routes=routes):
                for x, (ids, weights) in zip(xs, routes, strict=True):
                    model.experts(x, ids, weights, fp8)

            variants = {"general_step": general_step, "experts": experts_only}
            variants["step"] = fused_step if tokens in FUSED_TOKENS else general_step
            for name, fn in variants.items():
                t = bench_graph(fn) / ROTATE
                rec(f"{tag}_{name}_us", round(t, 2))
                rec(f"{tag}_{name}_pct_of_copy_ceiling", round(100 * floor_us / t, 1))
        ids, weights = routes[0]
        rec(
            f"decode_T{tokens}_eager_reference_bf16_us",
            round(
                bench(lambda xs=xs, ids=ids, weights=weights: model.reference(xs[0], ids, weights, False)), 1
            ),
        )


def prefill(model: Model) -> None:
    tokens = PREFILL_TOKENS
    x = batch(tokens, seed=7)
    ids, weights = model.route(x)
    flops = 6 * tokens * TOP_K * INTER * HIDDEN  # useful work: no padding rows
    for fp8 in (True, False):
        tag = f"prefill_T{tokens}_{'fp8' if fp8 else 'bf16'}"
        ceiling = RESULTS["fp8_scaled_mm_TFLOPs" if fp8 else "bf16_matmul_TFLOPs"]
        for name, fn in (
            ("step", lambda fp8=fp8: model.step(x, fp8)),
            ("experts", lambda fp8=fp8: model.experts(x, ids, weights, fp8)),
        ):
            t = bench(fn, rep=300)
            tflops = flops / (t * 1e-6) / 1e12
            rec(f"{tag}_{name}_ms", round(t / 1e3, 3))
            rec(f"{tag}_{name}_TFLOPs", round(tflops, 1))
            rec(f"{tag}_{name}_pct_of_{'fp8' if fp8 else 'bf16'}_matmul", round(100 * tflops / ceiling, 1))
    rec(
        f"prefill_T{tokens}_eager_reference_bf16_ms",
        round(bench(lambda: model.reference(x, ids, weights, False), rep=50) / 1e3, 2),
    )


def decode_launches(model: Model, tokens: int) -> dict[str, object]:
    """Each launch of an FP8 decode step of the general path (default configuration) on its own,
    over ROTATE batches."""
    xs = [batch(tokens, seed=200 * tokens + r) for r in range(ROTATE)]
    routes = [model.route(x) for x in xs]
    config = kernels.default_config(tokens * TOP_K, EXPERTS, True)
    gemm_inputs = [fp8_kernels.quantize_groups(x) for x in xs]
    layouts = [routing.align(ids, EXPERTS, config.block_m) for ids, _ in routes]
    (gate_up, gate_up_scale), (down, down_scale) = model.fp8["gate_up"], model.fp8["down"]

    def gate_up_stage():
        return [
            kernels.gate_up_stage(q, s, gate_up, gate_up_scale, layout, TOP_K, LIMIT, config)
            for (q, s), layout in zip(gemm_inputs, layouts, strict=True)
        ]

    hs = gate_up_stage()

    def down_stage():
        return [
            kernels.down_stage(h, h_scale, down, down_scale, layout, w, ACT, config)
            for (h, h_scale), layout, (_, w) in zip(hs, layouts, routes, strict=True)
        ]

    routed = down_stage()
    return {
        "router_logits": lambda: [routing.router_logits(x, model.router) for x in xs],
        "route": lambda: [model.route(x) for x in xs],
        "quantize": lambda: [fp8_kernels.quantize_groups(x) for x in xs],
        "align": lambda: [routing.align(ids, EXPERTS, config.block_m) for ids, _ in routes],
        "gate_up": gate_up_stage,
        "down": down_stage,
        "combine": lambda: [r.view(tokens, TOP_K, HIDDEN).sum(1) for r in routed],
    }


# (block_e, num_warps) of the prologue: router rows per program and warps; first, the rule by token count
# (`prologue_tiles`)
PROLOGUE_VARIANTS = ((None, None), (1, 4), (2, 4), (1, 8), (2, 8), (4, 8))


def fused_launches(model: Model, tokens: int) -> dict[str, object]:
    """Each launch of an FP8 decode step of the decode path on its own (the prologue in each of its
    `PROLOGUE_VARIANTS`, the first the default), over ROTATE batches."""
    xs = [batch(tokens, seed=300 * tokens + r) for r in range(ROTATE)]
    config = kernels.default_config(tokens * TOP_K, EXPERTS, True)
    prologues = [moe_decode.prologue(x, model.routing, config.block_m, quantize=True) for x in xs]
    (gate_up, gate_up_scale), (down, down_scale) = model.fp8["gate_up"], model.fp8["down"]
    hs = [
        kernels.gate_up_stage(q, s, gate_up, gate_up_scale, layout, TOP_K, LIMIT, config)
        for _, _, layout, q, s in prologues
    ]
    device = xs[0].device
    names = [f"prologue_e{e}_w{w}" if e else "prologue_rule" for e, w in PROLOGUE_VARIANTS]
    launches = {
        name: lambda block_e=block_e, warps=warps: [
            moe_decode.prologue(x, model.routing, config.block_m, True, block_e, warps) for x in xs
        ]
        for name, (block_e, warps) in zip(names, PROLOGUE_VARIANTS, strict=True)
    }
    launches["gate_up"] = lambda: [
        kernels.gate_up_stage(q, s, gate_up, gate_up_scale, layout, TOP_K, LIMIT, config)
        for _, _, layout, q, s in prologues
    ]
    launches["down_combine"] = lambda: [
        kernels.down_combine_stage(
            h, h_scale, down, down_scale, layout, weights, ACT, config, moe_decode.tickets(device)
        )
        for (h, h_scale), (_, weights, layout, _, _) in zip(hs, prologues, strict=True)
    ]
    return launches


def breakdown(model: Model) -> None:
    """Graph-replayed time of each launch of an FP8 decode step, general path (router GEMM, routing
    kernel, x quantisation, alignment, the two GEMMs, combine) and decode path (prologue, gate|up,
    down with the combine): where the step's time beyond the floor goes."""
    for tokens in (1, 8, 16):
        for name, fn in decode_launches(model, tokens).items():
            rec(f"breakdown_T{tokens}_fp8_general_{name}_us", round(bench_graph(fn) / ROTATE, 2))
    for tokens in FUSED_TOKENS:
        for name, fn in fused_launches(model, tokens).items():
            rec(f"breakdown_T{tokens}_fp8_fused_{name}_us", round(bench_graph(fn) / ROTATE, 2))
    x = batch(PREFILL_TOKENS, seed=7)
    rec(f"breakdown_T{PREFILL_TOKENS}_fp8_kernels_us", kernel_times(lambda: model.step(x, True)))


PROLOGUE_TOKENS = (1, 2, 4, 8)
# router copies the timed call cycles through: 77 MB, past the L2, read cold as in a step
PROLOGUE_ROUTERS = 32


def prologue(model: Model) -> None:
    """The decode prologue alone (router logits, x's FP8 groups, routing and alignment, the shared
    expert's blocks), µs a call at `PROLOGUE_TOKENS` tokens of a verify block's spread (`batch`), over
    `PROLOGUE_ROUTERS` copies of the router so that each call reads its router from HBM as a decode step
    does (the weights the step streamed have evicted it): what the rank's B = 8 step spends 17 us a layer
    on (RESULTS S35-1), in its default (block_e, num_warps) and each of `PROLOGUE_VARIANTS` (the default
    first). Each token count's ids are checked against `reference.route`."""
    copies = [model.router.clone() for _ in range(PROLOGUE_ROUTERS)]
    routings = [model.routing._replace(weight=w) for w in copies]
    for tokens in PROLOGUE_TOKENS:
        x = batch(tokens, 900 + tokens, spread=0.5)
        for block_e, warps in PROLOGUE_VARIANTS:

            def step(x=x, block_e=block_e, warps=warps):
                return [moe_decode.prologue(x, r, 16, True, block_e, warps, shared=True) for r in routings]

            ids = step()[0][0]
            variant = "" if (block_e, warps) == PROLOGUE_VARIANTS[0] else f"_e{block_e}_w{warps}"
            tag = f"prologue_T{tokens}{variant}"
            rec(f"{tag}_ids_equal_reference", bool(torch.equal(ids, reference.route(x, model.routing)[0])))
            rec(f"{tag}_us", round(bench_graph(step) / PROLOGUE_ROUTERS, 2))


def kernel_times(fn, steps: int = 3) -> dict[str, float]:
    """GPU time per call of `fn` of each kernel it launches (torch.profiler, `steps` calls), slowest
    first, with the sum as "total"; on the CPU (dry run) the profiler's CPU times of the top ops."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    with profile(activities=[ProfilerActivity.CPU if DRY else ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            fn()
        if not DRY:
            torch.cuda.synchronize()
    times: dict[str, float] = {}
    for event in prof.key_averages():
        if DRY or event.device_type.name == "CUDA":
            total = event.self_cpu_time_total if DRY else event.device_time_total
            name = short_kernel_name(event.key)
            times[name] = times.get(name, 0.0) + total / steps
    ranked = dict(sorted(((k, round(v, 1)) for k, v in times.items()), key=lambda kv: -kv[1])[:12])
    return {**ranked, "total": round(sum(times.values()), 1)}


def short_kernel_name(name: str) -> str:
    """A kernel's name without C++ return type, namespaces and template arguments."""
    name = name.removeprefix("void ").split("<")[0].split("(")[0]
    return name.rsplit("::", 1)[-1][:48]


# Candidates that compile for sm_90a without register spills (ptxas -v). Decode streams weights:
# 16-row blocks, deeper pipelines, narrower or wider column tiles. Prefill is register-bound: the
# gate|up kernel holds two accumulators, 64-row blocks at 8 warps are the largest that fit.
DECODE_UP = (Tiles(32, 128, 4, 6), Tiles(64, 128, 4, 6), Tiles(128, 128, 4, 4), Tiles(64, 128, 8, 4))
DECODE_DOWN = (Tiles(32, 128, 4, 4), Tiles(64, 128, 4, 6), Tiles(128, 128, 4, 4))
PREFILL_UP = (Tiles(128, 128, 8, 3), Tiles(128, 128, 8, 5))
PREFILL_DOWN = (Tiles(128, 128, 4, 4), Tiles(128, 128, 8, 4), Tiles(256, 128, 8, 4))


def sweep_configs(tokens: int, fp8: bool) -> list[MoeConfig]:
    """The default, then gate|up tiles (down at its default), then down tiles (gate|up at its
    default), prefill also more row blocks walked together (group_m: L2 reuse of the weight tiles)."""
    default = kernels.default_config(tokens * TOP_K, EXPERTS, fp8)
    if default.block_m == 16:
        up, down = DECODE_UP, DECODE_DOWN
    else:  # bf16 prefill keeps its default block_k (64)
        up, down = (
            [Tiles(t.block_n, default.gate_up.block_k, t.num_warps, t.num_stages) for t in tiles]
            for tiles in (PREFILL_UP, PREFILL_DOWN)
        )
    configs = [default]
    # the FP8 gate|up epilogue quantises whole groups: narrower tiles are refused
    configs += [replace(default, gate_up=t) for t in up if not fp8 or t.block_n % fp8_ops.FP8_BLOCK == 0]
    configs += [replace(default, down=t) for t in down]
    if default.block_m > 16:
        configs += [replace(default, group_m=g) for g in (4, 16, 32)]
    return list(dict.fromkeys(configs))


def sweep(model: Model, tokens_list: list[int], dtypes: list[str]) -> None:
    """Each candidate must reproduce the default configuration's output (the same quantisation, only
    the fp32 summation order differs) before it is timed."""
    deadline = START + SWEEP_UNTIL_S[0]
    for tokens, fp8 in itertools.product(tokens_list, [d == "fp8" for d in dtypes]):
        tag = f"sweep_T{tokens}_{'fp8' if fp8 else 'bf16'}"
        x = batch(tokens, seed=11)
        ids, weights = model.route(x)
        baseline = model.experts(x, ids, weights, fp8)
        rec(
            f"{tag}_default_relerr_vs_reference",
            round(rel_err(baseline, model.reference(x, ids, weights, fp8)), 5),
        )
        timed = []
        for config in sweep_configs(tokens, fp8)[: 3 if DRY else None]:
            if time.time() > deadline:
                rec(f"{tag}_stopped_at_deadline", str(config))
                break

            def run(config=config, x=x, ids=ids, weights=weights, fp8=fp8):
                return model.experts(x, ids, weights, fp8, config)

            try:
                err = rel_err(run(), baseline)
                if err > 1e-2:
                    rec(f"{tag}_{config}_relerr_vs_default", round(err, 4))
                    continue
                t = bench_graph(run) if tokens <= 16 else bench(run, rep=100)
            except Exception as exc:  # out of shared memory / registers: not a candidate
                rec(f"{tag}_{config}_skipped", type(exc).__name__)
                continue
            timed.append((round(t, 2), str(config)))
        timed.sort()
        rec(f"{tag}_timed_us", timed)  # fastest first


# FP8 prefill candidates (issue #7: M = 8192 at 38% of the FP8 matmul ceiling). The pointer kernels
# gather x row by row with cp.async and convert the per-column weight scales through shared memory
# every K step; the `tma` kernels take x gathered into slot order once, load both operands through
# TMA descriptors and scale by one weight scale per tile. Registers from an offline sm_90a compile
# (Triton 3.6), gate|up / down: pointer 248 / 215; tma (the default) 154 / 150, no spills; 4-warp 64-row and
# 128-row gate|up tiles hold two accumulators and a partial product: 255 with a few spills. Shared
# memory per stage: (block_m + 2·128) · 128 bytes for gate|up, (block_m + 128) · 128 for down. Hopper
# warp specialisation (`tl.range(..., warp_specialize=True)`, 4 warps + a producer) compiled but hung
# on the H200 in every variant (S6-9).
def _prefill_variants() -> dict[str, MoeConfig]:
    tma_m64 = kernels.default_config(PREFILL_TOKENS * TOP_K, EXPERTS, True)
    return {  # S7: the gate|up kernel's 4 stages of 40 KB leave one program per SM
        "default": tma_m64,
        "pointer": kernels.default_config(PREFILL_TOKENS * TOP_K, EXPERTS, True, tma=False),
        "tma_m64_up_s3": replace(tma_m64, gate_up=Tiles(128, 128, 8, 3)),
        "tma_m64_up_s2": replace(tma_m64, gate_up=Tiles(128, 128, 8, 2)),
        "tma_m64_up_k64_s4": replace(tma_m64, gate_up=Tiles(128, 64, 8, 4)),
        "tma_m64_up_k64_s6": replace(tma_m64, gate_up=Tiles(128, 64, 8, 6)),
        "tma_m64_down_k64_s6": replace(tma_m64, down=Tiles(128, 64, 4, 6)),
        "tma_m64_down_s3": replace(tma_m64, down=Tiles(128, 128, 4, 3)),
    }


PREFILL_VARIANTS = _prefill_variants()


def _warm_one(name: str) -> str:
    """Compile variant `name`'s two GEMMs at the real step's constants (fills Triton's on-disk cache):
    2 experts of zero weights, but the alignment's block bound of the real step, which the kernels
    specialise on."""
    config = PREFILL_VARIANTS[name]
    start = time.time()
    try:
        _compile(config)
    except Exception as exc:  # refused or failed to compile: reported, the step then skips it
        return f"{name}: {type(exc).__name__}: {str(exc)[:200]}"
    return f"{name}: {time.time() - start:.0f}s"


def _compile(config: MoeConfig) -> None:
    tokens, experts = PREFILL_TOKENS, 2

    def fp8_zeros(*shape):
        return torch.zeros(shape, device=DEV).to(torch.float8_e4m3fn)

    def scale_ones(rows, *dims):
        return torch.ones(rows, *(-(-d // fp8_ops.FP8_BLOCK) for d in dims), device=DEV)

    gate_up, gate_up_scale = fp8_zeros(experts, 2 * INTER, HIDDEN), scale_ones(experts, 2 * INTER, HIDDEN)
    down, down_scale = fp8_zeros(experts, HIDDEN, INTER), scale_ones(experts, HIDDEN, INTER)
    x, x_scale = fp8_zeros(tokens, HIDDEN), scale_ones(tokens, HIDDEN)
    ids = torch.randint(0, experts, (tokens, TOP_K), device=DEV)
    layout = routing.align(ids, EXPERTS, config.block_m)
    h, h_scale = kernels.gate_up_stage(x, x_scale, gate_up, gate_up_scale, layout, TOP_K, LIMIT, config)
    weights = torch.ones(tokens, TOP_K, device=DEV)
    kernels.down_stage(h, h_scale, down, down_scale, layout, weights, ACT, config)
    if not DRY:
        torch.cuda.synchronize()


def warm_prefill_variants():
    """Start compiling every variant in parallel spawned processes; (pool, futures)."""
    import concurrent.futures
    import multiprocessing

    pool = concurrent.futures.ProcessPoolExecutor(
        max_workers=min(len(PREFILL_VARIANTS), max(1, (os.cpu_count() or 2) - 2)),
        mp_context=multiprocessing.get_context("spawn"),
    )
    return pool, [pool.submit(_warm_one, name) for name in PREFILL_VARIANTS]


WARM: list = []  # (pool, futures) of warm_prefill_variants, started before the model is built
WARM_LIMIT_S = 300  # a variant whose compile and first launch take longer is reported (S6-7: one hung)


def _finished(job, name: str, unfinished: set[str]) -> str:
    """The warm-up report of variant `name`, or, past the limit, its name added to `unfinished`."""
    import concurrent.futures

    try:
        return job.result(timeout=WARM_LIMIT_S)
    except concurrent.futures.TimeoutError:
        unfinished.add(name)
        return f"{name}: not done in {WARM_LIMIT_S} s, not timed"


def prefill_sweep(model: Model) -> None:
    """Every `PREFILL_VARIANTS` entry as a whole FP8 step at M = PREFILL_TOKENS (routing, quantisation,
    alignment, both GEMMs, combine): output against the default's, median time, % of the FP8 matmul
    ceiling measured here after the compiles, and the per-kernel times (torch.profiler)."""
    unfinished: set[str] = set()
    if WARM:
        pool, jobs = WARM[0]
        named = zip(jobs, PREFILL_VARIANTS, strict=True)
        rec("prefill_sweep_compiled", [_finished(job, name, unfinished) for job, name in named])
        pool.shutdown(wait=False, cancel_futures=True)  # a hung worker must not hold the sweep
    else:
        rec("prefill_sweep_compiled", [_warm_one(name) for name in PREFILL_VARIANTS])
    ceiling = fp8_ceiling()
    tokens = PREFILL_TOKENS
    x = batch(tokens, seed=7)
    ids, weights = model.route(x)
    flops = 6 * tokens * TOP_K * INTER * HIDDEN
    baseline = model.step(x, True)
    reference_err = rel_err(baseline, model.reference(x, ids, weights, True))
    rec("prefill_sweep_default_relerr_vs_reference", round(reference_err, 5))
    timed = []
    for name, config in PREFILL_VARIANTS.items():
        tag = f"prefill_sweep_T{tokens}_{name}"
        rec(f"{tag}_config", str(config))
        if name in unfinished:
            continue

        def step(config=config):
            return model.step(x, True, config)

        try:
            err = rel_err(step(), baseline)
            rec(f"{tag}_relerr_vs_default", round(err, 6))
            if err > 1e-3:  # more than the fp32 summation order: not the same arithmetic, not timed
                rec(f"{tag}_rejected", f"relerr {err:.2e} > 1e-3")
                continue
            t = bench(step, rep=200)
        except Exception as exc:  # out of shared memory / registers
            rec(f"{tag}_skipped", f"{type(exc).__name__}: {str(exc)[:200]}")
            continue
        pct = round(100 * flops / (t * 1e-6) / 1e12 / ceiling, 1)
        rec(f"{tag}_ms", round(t / 1e3, 3))
        rec(f"{tag}_pct_of_fp8_matmul", pct)
        rec(f"{tag}_kernels_us", kernel_times(step))
        timed.append((round(t / 1e3, 3), pct, name))
    rec(f"prefill_sweep_T{tokens}_ranked_ms_pct", sorted(timed))


# ---------------------------------------------------------------- main


RANKS = [8]  # rank_decode (--ranks): rank 0 of TP/EP that many ways (the first EXPERTS / ranks experts)
RANK_SPLITS = (1, 2, 4, 8, 16)
# the token batches of rank_decode: (name, tokens, spread of `batch`): 8 independent rows (a batch of 8
# decode rows) and 8 clustered ones (a verify block of one request, whose tokens share experts)
RANK_BATCHES = (("T1", 1, None), ("T8", 8, None), ("T8v", 8, 0.5))


def rank_configs(tokens: int, ranks: int) -> dict[str, MoeConfig | None]:
    """The decode path's configurations a rank's step is timed in: the default (with the K splits
    `gate_up_splits` picks), then each power-of-two split (those that cut K into whole 128-deep steps)
    with the row blocks walked one by one (group_m 1: a block's programs, live first, launch first) or
    in groups of 8 (the default), and the split gate|up at 2 pipeline stages instead of 4 (2 CTAs a
    SM fit its shared memory)."""
    base = kernels.default_config(tokens * TOP_K, EXPERTS // ranks, True, tma=False)
    configs: dict[str, MoeConfig | None] = {"default": None}
    for splits in RANK_SPLITS:
        if HIDDEN % (splits * fp8_ops.FP8_BLOCK):
            continue
        up = replace(base.gate_up, splits=splits)
        configs[f"split{splits}"] = replace(base, gate_up=up)
        configs[f"split{splits}_group1"] = replace(base, gate_up=up, group_m=1)
        if splits > 1:
            configs[f"split{splits}_stages2"] = replace(base, gate_up=replace(up, num_stages=2))
        if splits == 8:  # the rank's one-token split with more warps per program
            configs["split8_group1_warps8"] = replace(base, gate_up=replace(up, num_warps=8), group_m=1)
    for block_n, stages in ((32, 4), (128, 4), (64, 2), (64, 6)):
        configs[f"down{block_n}_stages{stages}"] = replace(
            base, down=replace(base.down, block_n=block_n, num_stages=stages)
        )
    return configs


def rank_decode(model: Model) -> None:
    """A TP/EP rank's FP8 decode MoE step for each of `RANKS` (`routed_experts` with `first_expert`: at
    8, the rank's 36 of the 288 experts and the shared expert's tensor slice, intermediate I / 8, in the
    same launches; at 1, every expert and the whole shared expert) at 1 and 8 tokens, in each of
    `rank_configs`, over ROTATE batches routed alike for every configuration: µs a step, the floor (the
    rank's distinct experts reached plus the shared expert's part, at the copy rate) and each
    configuration's output against the default's. The rule's split is recorded beside them."""
    for ranks in RANKS:
        rank_step(model, ranks)


def rank_step(model: Model, ranks: int) -> None:
    bandwidth = RESULTS["copy_TBps"] * 1e12
    local, first = EXPERTS // ranks, None if ranks == 1 else 0  # one rank holds every expert, as TP1
    (gate_up, gate_up_scale), (down, down_scale) = model.fp8["gate_up"], model.fp8["down"]
    w = ExpertWeights(gate_up[:local], down[:local], (gate_up_scale[:local], down_scale[:local]))
    width = INTER // ranks if (INTER // ranks) % fp8_ops.FP8_BLOCK == 0 else INTER  # dry run: whole
    gen = torch.Generator(device=DEV).manual_seed(11)
    shared_bf16 = (
        torch.randn(2 * width, HIDDEN, device=DEV, dtype=ACT, generator=gen) * HIDDEN**-0.5,
        torch.randn(HIDDEN, width, device=DEV, dtype=ACT, generator=gen) * width**-0.5,
    )
    (sg, ss), (sd, sds) = (fp8_ops.quantize_fp8_blocks(t) for t in shared_bf16)
    shared = reference.SharedExpert(sg, sd, (ss, sds))
    shared_bytes = sum(t.numel() * t.element_size() for t in (sg, sd, ss, sds))
    per_expert = model.bytes_read(torch.zeros(1, dtype=torch.long), True)
    for batch_name, tokens, spread in RANK_BATCHES:
        xs = [batch(tokens, 500 * tokens + r, spread) for r in range(ROTATE)]
        reached = [int((model.route(x)[0].unique() < local).sum()) for x in xs]
        floor_us = (sum(reached) * per_expert / ROTATE + shared_bytes) / bandwidth * 1e6
        tag = f"rank{ranks}_{batch_name}_fp8"
        rec(f"{tag}_local_experts_reached", reached)
        rec(f"{tag}_floor_us", round(floor_us, 2))
        base = kernels.default_config(tokens * TOP_K, local, True, tma=False)
        blocks = moe_decode.layout_blocks(tokens, TOP_K, local, base.block_m, shared=True)
        splits = moe_decode.gate_up_splits(blocks, w.gate_up.shape, base)
        rec(f"{tag}_rule_splits", splits)
        expected = None
        for name, config in rank_configs(tokens, ranks).items():

            def step(config=config, xs=xs):
                return [
                    moe_decode.routed_experts(x, model.routing, w, LIMIT, config, first, shared=shared)
                    for x in xs
                ]

            try:
                outputs = step()
            except Exception as exc:  # out of shared memory / registers
                rec(f"{tag}_{name}_skipped", f"{type(exc).__name__}: {str(exc)[:200]}")
                continue
            if expected is None:
                expected = outputs
            err = max(
                rel_err(o, e) if e.norm() > 0 else float(o.norm())
                for o, e in zip(outputs, expected, strict=True)
            )
            t = bench_graph(step) / ROTATE
            rec(f"{tag}_{name}_us", round(t, 2))
            rec(f"{tag}_{name}_pct_of_copy_ceiling", round(100 * floor_us / t, 1))
            rec(f"{tag}_{name}_rel_err_vs_default", f"{err:.1e}")


def table() -> None:
    print("\n| case | hylo step | general path step | experts only | floor / ceiling | % |")
    print("|---|---|---|---|---|---|")
    for tokens in DECODE_TOKENS:
        for tag in ("fp8", "bf16"):
            key = f"decode_T{tokens}_{tag}"
            if f"{key}_step_us" in RESULTS:
                step, experts = RESULTS[f"{key}_step_us"], RESULTS[f"{key}_experts_us"]
                general = RESULTS[f"{key}_general_step_us"]
                floor, pct = RESULTS[f"{key}_floor_us"], RESULTS[f"{key}_step_pct_of_copy_ceiling"]
                print(
                    f"| decode M={tokens} {tag} | {step} us | {general} us | {experts} us | {floor} us (copy)"
                    f" | {pct} |"
                )
    for ranks, (batch_name, tokens, _) in itertools.product(RANKS, RANK_BATCHES):
        key = f"rank{ranks}_{batch_name}_fp8"
        for name in rank_configs(tokens, ranks) if f"{key}_floor_us" in RESULTS else ():
            if f"{key}_{name}_us" in RESULTS:
                print(
                    f"| TP{ranks} rank 0 decode {batch_name} fp8, {name} "
                    f"(rule: {RESULTS[f'{key}_rule_splits']}) | "
                    f"{RESULTS[f'{key}_{name}_us']} us | | | {RESULTS[f'{key}_floor_us']} us (copy) | "
                    f"{RESULTS[f'{key}_{name}_pct_of_copy_ceiling']} |"
                )
    for tag in ("fp8", "bf16"):
        key = f"prefill_T{PREFILL_TOKENS}_{tag}"
        if f"{key}_step_ms" in RESULTS:
            ceiling = RESULTS["fp8_scaled_mm_TFLOPs" if tag == "fp8" else "bf16_matmul_TFLOPs"]
            print(
                f"| prefill M={PREFILL_TOKENS} {tag} | {RESULTS[f'{key}_step_TFLOPs']} TFLOP/s | "
                f" | {RESULTS[f'{key}_experts_TFLOPs']} TFLOP/s | {ceiling} TFLOP/s (matmul)"
                f" | {RESULTS[f'{key}_step_pct_of_{tag}_matmul']} |"
            )


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--sweep", action="store_true", help="add the tile sweep to the sections")
    parser.add_argument("--only", help="comma-separated sections: " + ",".join(SECTIONS))
    parser.add_argument(
        "--sweep-tokens", default=f"1,16,{PREFILL_TOKENS}", help="token counts the sweep tunes"
    )
    parser.add_argument("--sweep-dtypes", default="fp8,bf16", help="weight formats the sweep tunes")
    parser.add_argument(
        "--sweep-until-s",
        type=float,
        default=SWEEP_UNTIL_S[0],
        help="stop sweeping this long after the start",
    )
    parser.add_argument("--ranks", default="8", help="rank_decode: TP/EP sizes whose rank 0 is timed")
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    SWEEP_UNTIL_S[0] = args.sweep_until_s
    RANKS[:] = [int(r) for r in args.ranks.split(",")]
    chosen = args.only.split(",") if args.only else [*DEFAULT_SECTIONS, *(["sweep"] if args.sweep else [])]
    if unknown := set(chosen) - set(SECTIONS):
        parser.error(f"unknown sections {sorted(unknown)}")
    if {"decode", "prefill", "rank_decode"} & set(chosen) and "ceilings" not in chosen:
        chosen.insert(0, "ceilings")  # their percentages divide by the ceilings
    if "prefill_sweep" in chosen and not DRY:
        WARM.append(warm_prefill_variants())  # compiles while the model is built
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if not DRY:
        rec("gpu", torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    for tokens in (1, 16, PREFILL_TOKENS):
        for fp8 in (True, False):
            config = kernels.default_config(tokens * TOP_K, EXPERTS, fp8)
            rec(f"default_config_T{tokens}_{'fp8' if fp8 else 'bf16'}", str(config))
    model = Model()
    sweep_args = ([int(t) for t in args.sweep_tokens.split(",")], args.sweep_dtypes.split(","))
    for name in chosen:
        section(
            name,
            SECTIONS[name],
            *([] if name == "ceilings" else [model]),
            *(sweep_args if name == "sweep" else []),
        )
        # written after every section: a run stopped at the device's time limit keeps what it measured
        (out / "moe.json").write_text(json.dumps(RESULTS, indent=1, default=str))
    table()


SECTIONS = {
    "ceilings": ceilings,
    "parity": parity,
    "decode": decode,
    "prefill": prefill,
    "breakdown": breakdown,
    "sweep": sweep,
    "prefill_sweep": prefill_sweep,
    "rank_decode": rank_decode,
    "prologue": prologue,
}
DEFAULT_SECTIONS = ("ceilings", "parity", "decode", "prefill")

if __name__ == "__main__":
    main()
