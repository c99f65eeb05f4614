"""Probe: the CUDA-core FP8 GEMV (`kernels.fp8_gemv`) against the tuned w8a16 tensor-core kernel at
decode row counts, on the FP8 projection shapes of GLM-5.3-Flash (CUDA-graph replay medians, µs).

    python benchmarks/kernels/fp8_gemv_probe.py [--out DIR]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from functools import partial
from pathlib import Path

import torch
from triton.testing import do_bench_cudagraph

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from hylo.ops.gemm import fp8_fallback_config, kernels
from hylo.ops.gemm.table import lookup
from hylo.ops.moe import dequantize_fp8_blocks, quantize_fp8_blocks

SHAPES = [(24576, 4096), (4096, 8192), (4096, 16384), (12288, 4096), (2176, 4096), (256, 4096), (16384, 1536)]


def timed(fn) -> float:
    return 1e3 * do_bench_cudagraph(fn, rep=20)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    name = torch.cuda.get_device_name()
    report = []
    for (n, k), m in itertools.product(SHAPES, (1, 4)):
        w, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen, device="cuda") * k**-0.5)
        x = torch.randn(m, k, generator=gen, device="cuda").bfloat16()
        ref = x.float() @ dequantize_fp8_blocks(w, scale, torch.float32).t()
        config = lookup(name, m, n, k, fp8=True) or fp8_fallback_config(m)
        base = timed(partial(kernels.gemm, x, w, config, scale))
        best = None
        for bn, bk, split, warps in itertools.product((16, 32, 64), (128, 256, 512), (1, 2, 4, 8), (4, 8)):
            if split > 1 and k // split < bk:
                continue
            out = kernels.fp8_gemv(x, w, scale, bn, bk, split, warps)
            error = float((out.float() - ref).norm() / ref.norm())
            if error > 1e-2:
                raise AssertionError(f"{n}x{k} m{m} {bn},{bk},{split},{warps}: error {error}")
            us = timed(partial(kernels.fp8_gemv, x, w, scale, bn, bk, split, warps))
            if best is None or us < best[0]:
                best = (us, (bn, bk, split, warps))
        floor_us = 1e6 * w.numel() / 4.27e12
        row = {"n": n, "k": k, "m": m, "tuned_us": round(base, 2), "gemv_us": round(best[0], 2),
               "gemv_config": best[1], "floor_us": round(floor_us, 2)}  # fmt: skip
        print(row, flush=True)
        report.append(row)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_gemv_probe.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
