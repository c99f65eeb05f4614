r"""The CUDA grouped FP8 GEMMs (`hylo.ops.moe.grouped_cuda`: gate|up and down) against the Triton TMA
kernels they would replace, at prefill sizes on one GPU, same process, interleaved.

    python benchmarks/kernels/moe_grouped_cuda.py [--tokens 8192,13312] [--variants NAME,...|all] [--out DIR]
    ncu --kernel-name regex:grouped_kernel --launch-skip 2 --launch-count 1 --section SpeedOfLight python \
        benchmarks/kernels/moe_grouped_cuda.py --tokens 13312 --for-profiler [VARIANT]

GLM-5.3-Flash's routed experts (288, top-8, D 4096, I 2048), random e4m3 weights with block scales, tokens
routed uniformly at random; the down GEMMs read h from hylo's Triton gate|up stage. Outputs are compared
(down: `routed [T·k, D]`; gate|up: h times its scales on the slots that hold a pair: relative L2, worst
element against the row's largest, the share of equal elements) and timed as CUDA-graph medians, interleaved
over `--reps` rounds. TFLOP/s count the real pairs only (2·T·k·D·I), against the FP8 matmul ceiling measured
in the same run. `--variants` also builds the kernel one CTA a tile (S42's build), with other ring depths
and pair groups, or as probes that take its time apart (`HYLO_GROUPED_*`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from harness import RESULTS, bench_graph, fp8_ceiling, rec, section

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.ops.fp8.kernels import quantize_groups
from hylo.ops.moe import grouped_cuda, kernels, routing

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 4096, 2048, 288, 8, 10.0
VARIANTS = {
    # the shipped build is persistent (one CTA a SM, its next tile from a global counter) with 256-column down
    # tiles; S42's: one CTA a tile, 128-column down tiles
    "one_tile_a_cta": ("HYLO_GROUPED_PERSISTENT=0",),
    "strided": ("HYLO_GROUPED_DYNAMIC=0",),
    "narrow_down": ("HYLO_GROUPED_WIDE_DOWN=0",),
    "s42": ("HYLO_GROUPED_PERSISTENT=0", "HYLO_GROUPED_WIDE_DOWN=0"),
    "stages4": ("HYLO_GROUPED_STAGES=4",),
    "stages6": ("HYLO_GROUPED_STAGES=6",),
    "group4": ("HYLO_GROUPED_GROUP=4",),
    "group16": ("HYLO_GROUPED_GROUP=16",),
    "gate_up_stages3": ("HYLO_GROUPED_GATE_UP_STAGES=3",),
    "mixed_sequential": ("HYLO_GROUPED_MIXED_SEQUENTIAL=1",),
    "early_release": ("HYLO_GROUPED_EARLY_RELEASE=1",),
    "fast_epilogue": ("HYLO_GROUPED_FAST_EPILOGUE=1",),
    "early_fast": ("HYLO_GROUPED_EARLY_RELEASE=1", "HYLO_GROUPED_FAST_EPILOGUE=1"),
    # bounds, not kernels (their outputs are wrong): the loads alone, the math alone on stale slots
    "probe_loads": ("HYLO_GROUPED_PROBE=1",),
    "probe_math": ("HYLO_GROUPED_PROBE=2",),
    # the math alone, taken apart (gate|up; down's chained products serialise, its figures mean nothing):
    # one consumer alone, no promotion, the MMAs never waited on inside a tile
    "probe_one_consumer": ("HYLO_GROUPED_PROBE=3",),
    "probe_no_promotion": ("HYLO_GROUPED_PROBE=4",),
    "probe_mma_only": ("HYLO_GROUPED_PROBE=5",),
    # the same with every tile's K steps walked twice: against the probe's own time, a tile's fixed cost
    # (setup, the ring's first fill, the epilogue) apart from its steps'
    "probe_math_k2": ("HYLO_GROUPED_PROBE=2", "HYLO_GROUPED_PROBE_REPEAT=2"),
    "probe_mma_only_k2": ("HYLO_GROUPED_PROBE=5", "HYLO_GROUPED_PROBE_REPEAT=2"),
}


def fp8_weights(shape: tuple[int, int, int], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 experts (normal values, scaled into e4m3's range) and block scales around K^-0.5 / 64."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    e, n, k = shape
    weight = torch.empty(shape, dtype=torch.float8_e4m3fn, device="cuda")
    for first in range(0, e, 16):
        chunk = torch.randn((min(16, e - first), n, k), generator=gen, device="cuda") * 64
        weight[first : first + 16] = chunk.clamp(-448, 448).to(torch.float8_e4m3fn)
    scale = (0.5 + torch.rand((e, n // 128, k // 128), generator=gen, device="cuda")) * k**-0.5 / 64
    return weight, scale


def triton_only(fn, *args):
    """`fn(*args)` with the CUDA grouped kernels switched off (the stages' dispatch reads the switch)."""
    os.environ[grouped_cuda.SWITCH] = "0"
    try:
        return fn(*args)
    finally:
        del os.environ[grouped_cuda.SWITCH]


def pair_kinds(layout) -> torch.Tensor:
    """Per slot: which block of its pair it is (0, 1) plus 2 where the pair's blocks have different experts
    (or the second is past the real count): where a kernel bug would show."""
    expert = layout.block_expert
    other = torch.where(torch.arange(expert.numel(), device=expert.device) % 2 == 0,
                        torch.roll(expert, -1), torch.roll(expert, 1))  # fmt: skip
    kind = torch.arange(expert.numel(), device=expert.device) % 2 + 2 * (other != expert).long()
    return kind.repeat_interleave(64)


def by_kind(name: str, out: torch.Tensor, ref: torch.Tensor, rows: torch.Tensor, kind: torch.Tensor) -> None:
    """Relative L2 of each kind of slot (`pair_kinds`), the slots that hold a pair only."""
    errors = {}
    for k in range(4):
        mine = rows & (kind == k)
        if mine.any():
            errors[k] = round(float((out[mine] - ref[mine]).float().norm() / ref[mine].float().norm()), 5)
    rec(f"{name}_rel_l2_by_slot_kind", errors)


def compare(name: str, out: torch.Tensor, ref: torch.Tensor) -> None:
    equal = out.view(torch.int16) == ref.view(torch.int16) if out.dtype == torch.bfloat16 else out == ref
    diff = (out.float() - ref.float()).abs()
    rec(f"{name}_rel_l2", float(diff.norm() / ref.float().norm()))
    rec(
        f"{name}_worst_vs_row_max",
        float((diff / ref.float().abs().amax(1, keepdim=True).clamp_min(1e-30)).max()),
    )
    rec(f"{name}_equal_share", round(float(equal.float().mean()), 5))


def run(tokens_list: list[int], variants: list[str], reps: int) -> None:
    ceiling = fp8_ceiling()
    rec("fp8_scaled_mm_TFLOPs", round(ceiling, 1))
    gate_up, gate_up_scale = fp8_weights((EXPERTS, 2 * INTER, HIDDEN), 1)
    down, down_scale = fp8_weights((EXPERTS, HIDDEN, INTER), 2)
    libraries = {"cuda": grouped_cuda.load_library()}
    for name in variants:
        libraries[f"cuda_{name}"] = grouped_cuda.load_library(defines=VARIANTS[name])
    for tokens in tokens_list:
        one_size(tokens, libraries, ceiling, reps, (gate_up, gate_up_scale), (down, down_scale))


def routed_tokens(tokens: int):
    """`tokens` random rows quantised (xq, x_scale), routed uniformly (pair weights), the prefill
    configuration and the alignment of their pairs: the same for every call at one size."""
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, generator=gen, device="cuda").topk(TOP_K, dim=1).indices.int()
    weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda").softmax(1)
    config = kernels.default_config(tokens * TOP_K, EXPERTS, True)
    xq, x_scale = quantize_groups(x)
    return xq, x_scale, weights, config, routing.align(ids, EXPERTS, config.block_m)


def one_size(tokens: int, libraries: dict, ceiling: float, reps: int, gate_up_w, down_w) -> None:
    (gate_up, gate_up_scale), (down, down_scale) = gate_up_w, down_w
    xq, x_scale, weights, config, layout = routed_tokens(tokens)
    h, h_scale = triton_only(kernels.gate_up_stage, xq, x_scale, gate_up, gate_up_scale, layout, TOP_K, LIMIT,
                             config)  # fmt: skip
    refusal = grouped_cuda.operand_refusal(h, down, down_scale, layout)
    rec(f"T{tokens}_refusal", refusal)
    expert = layout.block_expert[: layout.block_expert.numel() // 2 * 2].view(-1, 2)
    # pairs whose two blocks hold different experts walk the ring twice, one consumer at a time
    rec(f"T{tokens}_mixed_pair_share", round(float((expert[:, 0] != expert[:, 1]).float().mean()), 4))
    if refusal:
        return
    # timed even where the check on this GPU failed (the figures say what a fix would be worth)
    rec(f"T{tokens}_device_refusal", grouped_cuda.device_refusal(h.device))
    xg, xg_scale = kernels.gather_rows(xq, x_scale, layout, TOP_K)
    pair_weights = weights.reshape(-1).float().contiguous()
    routed = {name: torch.zeros(tokens * TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda") for name in
              ("triton", *libraries)}  # fmt: skip
    hs: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    calls = {
        "down_triton": lambda: triton_only(kernels._down_tma, h, h_scale, down, down_scale, layout,
                                           pair_weights, routed["triton"], config),
        "gate_up_triton": lambda: hs.__setitem__("triton", triton_only(
            kernels.gate_up_stage, xq, x_scale, gate_up, gate_up_scale, layout, TOP_K, LIMIT, config)),
    }  # fmt: skip
    for name, library in libraries.items():
        calls[f"down_{name}"] = lambda name=name, library=library: grouped_cuda.down(
            h, h_scale, down, down_scale, layout, pair_weights, routed[name], library
        )
        calls[f"gate_up_{name}"] = lambda name=name, library=library: hs.__setitem__(
            name, grouped_cuda.gate_up(xg, xg_scale, gate_up, gate_up_scale, layout, LIMIT, library)
        )
    for fn in calls.values():
        fn()
    torch.cuda.synchronize()
    rows = layout.block_rows.repeat_interleave(64) > torch.arange(64, device="cuda").repeat(
        layout.block_rows.numel()
    )  # the slots that hold a pair
    pair_kind = pair_kinds(layout)
    for name in libraries:
        compare(f"T{tokens}_down_{name}_vs_triton", routed[name], routed["triton"])
        slot_pair = torch.where(rows, layout.pairs.long(), 0)  # padding slots' pair entries are unset
        by_kind(
            f"T{tokens}_down_{name}", routed[name][slot_pair], routed["triton"][slot_pair], rows, pair_kind
        )
        by_kind(f"T{tokens}_gate_up_{name}", hs[name][0].float(), hs["triton"][0].float(), rows, pair_kind)
        (hc, sc), (ht, st) = hs[name], hs["triton"]
        compare(f"T{tokens}_gate_up_{name}_vs_triton",
                (hc[rows].float() * sc[rows].repeat_interleave(128, 1)),
                (ht[rows].float() * st[rows].repeat_interleave(128, 1)))  # fmt: skip
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(reps):
        for name, fn in calls.items():
            times[name].append(bench_graph(fn, rep=30))
    for name, values in times.items():
        us = sorted(values)[len(values) // 2]
        # real pairs only; the Triton gate|up call includes its gather of x into slot order
        flops = 2 * tokens * TOP_K * HIDDEN * INTER * (2 if name.startswith("gate_up") else 1)
        rec(f"T{tokens}_{name}_us", round(us, 1))
        rec(f"T{tokens}_{name}_us_all", [round(v, 1) for v in values])
        rec(f"T{tokens}_{name}_pct_of_fp8_matmul", round(100 * flops / (us * 1e-6) / 1e12 / ceiling, 1))
    gather = bench_graph(lambda: kernels.gather_rows(xq, x_scale, layout, TOP_K), rep=30)
    rec(f"T{tokens}_gather_rows_us", round(gather, 1))


def calls_for_a_profiler(tokens: int, variant: str | None) -> None:
    """Three gate|up calls of one build (the shipped one, or `variant`) at `tokens`, nothing timed: for Nsight
    Compute (`ncu --kernel-name regex:grouped_kernel --launch-skip 2 --launch-count 1 ...`)."""
    library = grouped_cuda.load_library(defines=VARIANTS[variant] if variant else ())
    gate_up, gate_up_scale = fp8_weights((EXPERTS, 2 * INTER, HIDDEN), 1)
    xq, x_scale, _, _, layout = routed_tokens(tokens)
    xg, xg_scale = kernels.gather_rows(xq, x_scale, layout, TOP_K)
    for _ in range(3):
        grouped_cuda.gate_up(xg, xg_scale, gate_up, gate_up_scale, layout, LIMIT, library)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", default="8192,13312")
    parser.add_argument("--variants", default="", help=f"comma-separated names of {sorted(VARIANTS)}, or all")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument(
        "--for-profiler", metavar="VARIANT", nargs="?", const="",
        help="only three gate|up calls at the first --tokens (the shipped build, or VARIANT), for ncu",
    )  # fmt: skip
    args = parser.parse_args()
    if args.for_profiler is not None:
        calls_for_a_profiler(int(args.tokens.split(",")[0]), args.for_profiler or None)
        return
    variants = list(VARIANTS) if args.variants == "all" else [v for v in args.variants.split(",") if v]
    section("grouped", run, [int(t) for t in args.tokens.split(",")], variants, args.reps)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "moe_grouped_cuda.json").write_text(json.dumps(RESULTS, indent=1, default=str))


if __name__ == "__main__":
    main()
