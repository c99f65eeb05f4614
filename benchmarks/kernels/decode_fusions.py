"""The decode-step fusions of issue 44 item 3 against the launches they replace, same run, CUDA-graph replays
(median µs of `do_bench_cudagraph`), GLM-5.3-Flash shapes in bf16 (FP8 projections where the checkpoint
has them):

- mHC entry of one token (the previous block's post, this block's pre and RMSNorm): the decode plan's one
  launch (`one_launch_tokens = 1`: the projection's last program finishes) against its two launches.
- KDA decode with the gate's f_b and the output norm's g_b multiplied inside the step and the norm
  (`ops.kda.LowRank`) against the two projections launched first (`ops.gemm.linear`: the FP8 GEMV or
  cuBLAS), at batch 1 and 8, 64 heads (TP1) and 8 (a TP8 rank).
- KDA decode of an FP8 checkpoint with β's logits computed in the step from the layer input and b_proj's
  bf16 rows (`LowRank(x, W_b)`) against b's bf16 GEMM launched first (`ops.gemm.linear`, as the layer's
  `in_proj` ran it), the FP8 f_b/g_b inside the launches in both.
- DFlash2's candidates, the top 8 of the draft head's bf16 rows: `ops.topk.top_k` (one launch) against
  `torch.topk`, 7 and 112 rows (c = 1 and 16, blocks of 8) of the demo's 8192 and GLM's 154880 tokens.

Each pair is timed `--reps` times interleaved (old, new, old, new, ...); the table shows every median.

    python benchmarks/kernels/decode_fusions.py [--reps 3] [--out DIR] [--only TEXT]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
from pathlib import Path

import torch
from harness import bench_graph

from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.gemm import linear
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, decode
from hylo.ops.mhc import BlockNorm, HCParams, PendingPost
from hylo.ops.mhc import kernels as mhc_kernels
from hylo.ops.topk import kernels as topk_kernels

HIDDEN, D = 4096, 128


def randn(*shape, scale=1.0, dtype=torch.bfloat16):
    return (torch.randn(*shape, device="cuda") * scale).to(dtype)


def mhc_pair():
    """(two launches, one launch) of one token's mHC entry."""
    streams = randn(1, 4, HIDDEN)
    pending = PendingPost(
        randn(1, HIDDEN), 2 * torch.rand(1, 4, device="cuda"), torch.rand(1, 4, 4, device="cuda")
    )
    hc = HCParams(randn(24, 4 * HIDDEN, scale=(4 * HIDDEN) ** -0.5), torch.randn(24, device="cuda"),
                  torch.rand(3, device="cuda") + 0.5, 1e-6, 1e-6, 20)  # fmt: skip
    norm = BlockNorm(randn(HIDDEN), 1e-5)
    two = dataclasses.replace(mhc_kernels.DECODE_PLAN, one_launch_tokens=0)

    def run(plan):
        return lambda: mhc_kernels.mhc_enter(streams, hc, pending, norm, plan=plan)

    return run(two), run(mhc_kernels.DECODE_PLAN)


def kda_step(batch: int, heads: int):
    """(params, slots, q, k, v, b logits, f_a, g_a, norm weight) of one KDA decode step."""
    hd = heads * D
    params = KDAParams(randn(3 * hd, 4, scale=0.5, dtype=torch.float32), randn(hd, dtype=torch.float32),
                       randn(heads, scale=0.5, dtype=torch.float32), -5.0)  # fmt: skip
    slots = KDASlots(randn(batch, 3, 3 * hd), randn(batch, heads, D, D, scale=0.3, dtype=torch.float32),
                     torch.arange(batch, device="cuda"))  # fmt: skip
    q, k, v, b = randn(batch, 3 * hd + heads).split([hd] * 3 + [heads], dim=-1)
    f_a, g_a = randn(batch, 2 * D).split([D, D], dim=-1)
    return params, slots, q, k, v, b, f_a, g_a, randn(D)


def low_rank_factor(a: torch.Tensor, heads: int, fp8: bool) -> LowRank:
    weight = randn(heads * D, D, scale=D**-0.5, dtype=torch.float32)
    return LowRank(a, *quantize_fp8_blocks(weight)) if fp8 else LowRank(a, weight.bfloat16())


def kda_pair(batch: int, heads: int, fp8: bool):
    """(projections then decode, LowRank decode) of one KDA decode step."""
    params, slots, q, k, v, b, f_a, g_a, weight = kda_step(batch, heads)
    f, gate = low_rank_factor(f_a, heads, fp8), low_rank_factor(g_a, heads, fp8)

    def projected():
        f_dense = linear(f.a, f.weight, f.scale_inv)
        gate_dense = linear(gate.a, gate.weight, gate.scale_inv).view(batch, heads, D)
        return decode(KDAInputs(q, k, v, f_dense, b), params, slots, OutputNorm(gate_dense, weight, 1e-5))

    def fused():
        return decode(KDAInputs(q, k, v, f, b), params, slots, OutputNorm(gate, weight, 1e-5))

    return projected, fused


def kda_beta_pair(batch: int, heads: int):
    """(b's GEMM then decode, decode computing b) of one FP8 KDA decode step."""
    params, slots, q, k, v, _, f_a, g_a, weight = kda_step(batch, heads)
    f, gate = low_rank_factor(f_a, heads, True), low_rank_factor(g_a, heads, True)
    b = LowRank(randn(batch, HIDDEN), randn(heads, HIDDEN, scale=HIDDEN**-0.5))
    norm = OutputNorm(gate, weight, 1e-5)

    def projected():
        return decode(KDAInputs(q, k, v, f, linear(b.a, b.weight)), params, slots, norm)

    def fused():
        return decode(KDAInputs(q, k, v, f, b), params, slots, norm)

    return projected, fused


def topk_pair(rows: int, vocab: int):
    """(torch.topk, the Triton top-k) of the 8 best of `rows` bf16 rows."""
    x = randn(rows, vocab)
    return (lambda: x.topk(8)), (lambda: topk_kernels.top_k(x, 8))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "out")))
    parser.add_argument("--only", default="", help="the cases whose name contains this text")
    args = parser.parse_args()
    torch.manual_seed(0)
    cases = {"mHC enter, 1 token": mhc_pair()}
    for heads in (64, 8):
        for batch in (1, 8):
            for fp8 in (True, False):
                name = f"KDA decode, B={batch}, {heads} heads, {'FP8' if fp8 else 'bf16'} f_b/g_b"
                cases[name] = kda_pair(batch, heads, fp8)
    for heads, batch in ((64, 1), (8, 1), (8, 8)):
        cases[f"KDA decode, B={batch}, {heads} heads, FP8, b from x"] = kda_beta_pair(batch, heads)
    for rows_, vocab in ((7, 8192), (112, 8192), (7, 154880)):
        cases[f"top-8 of {rows_} x {vocab} bf16"] = topk_pair(rows_, vocab)
    rows = {}
    for name, (old, new) in cases.items():
        if args.only not in name:
            continue
        times = {"old": [], "new": []}
        for _ in range(args.reps):
            times["old"].append(bench_graph(old))
            times["new"].append(bench_graph(new))
        rows[name] = times
        ratio = statistics.median(times["new"]) / statistics.median(times["old"])
        old_us = " ".join(f"{t:.2f}" for t in times["old"])
        new_us = " ".join(f"{t:.2f}" for t in times["new"])
        print(f"{name:48s} old {old_us} | fused {new_us} us | fused/old {ratio:.3f}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name()
    (args.out / "decode_fusions.json").write_text(json.dumps({"gpu": gpu, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
