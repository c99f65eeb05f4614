# ruff: noqa: B023  (every timed closure runs before its loop variables move on)
"""The KDA block verify's time by its `tl.dot` precision (`recurrent.VERIFY_PRECISION`) at GLM-5.3-Flash's
KDA shapes (d = 128; 64 heads at TP1, 16 at TP4, 8 at TP8), the kernel alone under graph replay.

    PYTHONPATH=src python3 benchmarks/kernels/kda_verify_precision.py [--precisions tf32,tf32x3] [--reps 3]

Each shape's precisions are timed interleaved `--reps` times (`do_bench_cudagraph`); the medians are
printed. Which precision keeps the tokens is a test's question (tests/test_speculative_cuda.py), not
this script's: RESULTS S31-2 has both.
"""

from __future__ import annotations

import argparse

import torch
import triton

from hylo.ops.kda import recurrent
from hylo.ops.kda.reference import KDAInputs, KDAParams, KDASlots

D, WIDTH = 128, 4


def operands(heads: int, batch: int, tokens: int):
    """Random conv outputs, gates and pools of a verify of `tokens` tokens for `batch` sequences."""
    hd, r = heads * D, lambda *s: torch.randn(*s, device="cuda")
    x = KDAInputs(*[r(batch, tokens, hd).bfloat16() for _ in range(4)], r(batch, tokens, heads).bfloat16())
    params = KDAParams(r(3 * hd, WIDTH) * 0.5, r(hd), r(heads) * 0.5, -5.0)
    state = r(batch + 1, heads, D, D) * 0.3
    slots = KDASlots(r(batch + 1, WIDTH - 1, 3 * hd).bfloat16(), state, torch.arange(batch, device="cuda"))
    return recurrent.conv_steps(x, params.conv_weight, slots), x, params, slots


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--precisions", default="tf32,tf32x3")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    precisions = args.precisions.split(",")
    default = recurrent.VERIFY_PRECISION
    print(torch.cuda.get_device_name(), "default", default)
    for heads in (64, 16, 8):
        for batch, tokens in ((1, 8), (1, 16), (8, 8)):
            qkv, x, params, slots = operands(heads, batch, tokens)
            times = {p: [] for p in precisions}
            for _ in range(args.reps):
                for p in precisions:
                    recurrent.VERIFY_PRECISION = p
                    run = lambda: recurrent.block_verify(qkv, x, params, slots)  # noqa: E731
                    times[p].append(triton.testing.do_bench_cudagraph(run, rep=100) * 1e3)
            recurrent.VERIFY_PRECISION = default
            med = {p: sorted(v)[len(v) // 2] for p, v in times.items()}
            cells = ", ".join(f"{p} {us:.2f} us" for p, us in med.items())
            print(f"H={heads:3d} B={batch} T={tokens:2d}: {cells}", flush=True)


if __name__ == "__main__":
    main()
