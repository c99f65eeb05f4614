"""FP8 projection GEMMs on the GPU: real-shape parity against the dequantised weight, and the time of
each way to run a block-scaled e4m3 projection next to cuBLAS on the bf16 weight, in the same run.

    python benchmarks/kernels/fp8_gemm.py [--out DIR]
    python benchmarks/kernels/fp8_gemm.py --dry-run   # CPU, Triton interpreter, tiny sizes, fake timers

For every distinct FP8 projection shape of GLM-5.3-Flash (as `load_model` keeps an FP8 checkpoint) and
row counts from decode to prefill: cuBLAS bf16 (`F.linear` on the dequantised weight), the w8a16
Triton kernel with its configuration without a table entry (`ops.gemm.fallback_config`), and cuBLAS's
block-scaled FP8 matmul with the activation quantisation (`kernels.scaled_mm`), all as CUDA-graph
replays (medians), with the weight-read floor at the copy rate measured here. Writes `fp8_gemm.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

DRY = "--dry-run" in sys.argv
ROOT = Path(__file__).resolve().parents[2]
if DRY:
    sys.path.insert(0, str(ROOT / "tests"))
    from interpreter import use_interpreter

    use_interpreter()
sys.path.insert(0, str(ROOT / "src"))

from harness import RESULTS, bench_graph, rec, section  # noqa: E402

from hylo.config import ModelConfig  # noqa: E402
from hylo.layers.linear import Linear  # noqa: E402
from hylo.models.glm5_next import Glm5NextForCausalLM  # noqa: E402
from hylo.models.loader import keep_projections_fp8, stored_block_scaled  # noqa: E402
from hylo.ops import gemm  # noqa: E402
from hylo.ops.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402
from hylo.ops.gemm import kernels  # noqa: E402

DEV = "cpu" if DRY else "cuda"
ROWS = (1, 5) if DRY else (1, 8, 16, 32, 64, 128, 256, 1024, 4096, 8192)


def fp8_shapes() -> list[tuple[int, int]]:
    """Distinct (N, K) of the e4m3 projections, the most bytes per step first."""
    if DRY:
        return [(256, 512)]
    with torch.device("meta"):
        model = Glm5NextForCausalLM(ModelConfig.from_dict({}))
        keep_projections_fp8(model, stored_block_scaled)
    shapes = Counter(tuple(m.weight.shape) for m in model.modules() if isinstance(m, Linear) and m.fp8)
    return sorted(shapes, key=lambda nk: -shapes[nk] * nk[0] * nk[1])


def copy_rate() -> float:
    """Device copy bytes/s (read + write) of a 1 GiB buffer."""
    if DRY:
        return 1e12
    src = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (bench_graph(lambda: dst.copy_(src)) * 1e-6)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def measure_shape(n: int, k: int, rate: float, gen: torch.Generator) -> list[dict]:
    dtype = torch.float32 if DRY else torch.bfloat16
    w, scale = quantize_fp8_blocks(torch.randn(n, k, generator=gen, device=DEV) * k**-0.5)
    dense = dequantize_fp8_blocks(w, scale, dtype)
    exact = dequantize_fp8_blocks(w, scale, torch.float32)
    rows = []
    for m in ROWS:
        x = torch.randn(m, k, generator=gen, device=DEV).to(dtype)
        ref = x.float() @ exact.t()
        config = gemm.fallback_config(m, n, k, x.device)
        ways = {
            "bf16": lambda x=x: F.linear(x, dense),
            "triton": lambda x=x, c=config: kernels.gemm(x, w, c, scale),
        }
        row = {"n": n, "k": k, "m": m, "floor_us": round((n * k + m * (k + 2 * n)) / rate * 1e6, 2)}
        refusal = kernels.scaled_mm_refusal(x, w)
        if refusal is None:
            ways["scaled_mm"] = lambda x=x: kernels.scaled_mm(x, w, scale)
        else:
            row["scaled_mm_refusal"] = refusal
        for name, fn in ways.items():
            try:
                row[f"{name}_err"] = rel(fn(), ref)
                row[f"{name}_us"] = round(bench_graph(fn), 2)
            except Exception as e:  # one way failing leaves the others measured
                row[f"{name}_failed"] = repr(e)[:300]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def measure(shapes, rate: float) -> None:
    gen = torch.Generator(device=DEV).manual_seed(0)
    rec("rows", [row for n, k in shapes for row in measure_shape(n, k, rate, gen)])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    rate = copy_rate()
    rec("copy_bytes_per_s", rate)
    section("measure", measure, fp8_shapes(), rate)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemm.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
