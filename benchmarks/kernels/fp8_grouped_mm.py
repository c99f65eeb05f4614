"""Vendor FP8 GEMMs for the MoE prefill, against hylo's grouped expert kernels (issue 45 item 3).

    python3 benchmarks/kernels/fp8_grouped_mm.py [--tokens 8192] [--out DIR]

hylo's FP8 prefill experts (Triton, TMA) reach ~40% of the FP8 matmul ceiling; cuBLAS's block-scaled
matmul (`F.scaled_mm`, 1x128 activation and 128x128 weight scales, GLM-5.3-Flash's layout) runs the dense
projections at ~83% of it. This asks what the vendor paths give the experts of one prefill step (`--tokens`
tokens, top-8 of 288 experts, uniformly routed, rows grouped by expert), in one process:

1. `grouped`: torch's grouped GEMM with those scales over ragged groups (`F.scaled_grouped_mm`, offsets on
   the device, no host sync), if this build runs it on this GPU: each scale layout tried is recorded with
   its error, or with its difference from the dequantised product; the first that matches is timed for
   the gate|up and the down shapes.
2. `per_expert`: cuBLAS's block-scaled matmul once per expert over its rows (the rows' counts read on the
   host, as an engine would have to once per MoE layer), replayed as a CUDA graph (the GPU's time) and
   launched eagerly (with the host's launches).
3. `hylo`: hylo's whole FP8 experts step (`kernels.experts`: x quantised and gathered, both GEMMs, SwiGLU,
   the combine) on the same routing.

Every time is a median of `harness.bench`; TFLOP/s count the routed pairs' useful FLOPs (no padding rows)
against `harness.fp8_ceiling` measured in the same run. Prints the figures and writes `fp8_grouped_mm.json`
to --out (default $OUT or ./out).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from harness import RESULTS, bench, fp8_ceiling, rec, section

from hylo.ops import fp8 as fp8_ops
from hylo.ops.fp8.kernels import quantize_groups
from hylo.ops.gemm.kernels import SCALED_MM_ROW_ALIGN
from hylo.ops.moe import kernels
from hylo.ops.moe.reference import Choices, ExpertWeights

HIDDEN, INTER, EXPERTS, TOP_K, LIMIT = 4096, 2048, 288, 8, 10.0


def rel_err(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got.float() - expected).norm() / expected.norm())


def tflops_share(flops: float, us: float, ceiling: float) -> float:
    """`flops` done in `us` microseconds, as a percentage of the `ceiling` (TFLOP/s)."""
    return round(100 * flops / (us * 1e-6) / 1e12 / ceiling, 1)


def expert_weights(rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every expert's random `[rows, cols]` weight, e4m3 with its 128x128 block scales, built 16 at a time."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.empty(EXPERTS, rows, cols, device="cuda", dtype=torch.float8_e4m3fn)
    s = torch.empty(EXPERTS, rows // 128, cols // 128, device="cuda")
    for e in range(0, EXPERTS, 16):
        w = torch.randn(16, rows, cols, device="cuda", generator=gen, dtype=torch.bfloat16) * cols**-0.5
        q[e : e + 16], s[e : e + 16] = fp8_ops.quantize_fp8_blocks(w)
    return q, s


class Grouped:
    """One product's operands, rows grouped by expert: `a [P, K]` e4m3 with `a_scale [P, K/128]`, the
    experts' `w [E, N, K]` e4m3 with `w_scale [E, N/128, K/128]`, `offs` (int32 row ends per expert) and
    the counts on the host. cuBLAS takes row counts in multiples of `SCALED_MM_ROW_ALIGN` (it finds no
    algorithm for some others), so the per-expert path reads a copy whose groups are padded to them."""

    def __init__(self, a, a_scale, w, w_scale, counts: torch.Tensor):
        self.a, self.a_scale, self.w, self.w_scale = a, a_scale, w, w_scale
        self.offs = counts.cumsum(0).to(torch.int32).cuda()
        self.counts = counts.tolist()
        self.flops = 2.0 * a.shape[0] * w.shape[1] * w.shape[2]
        padded = [-(-n // SCALED_MM_ROW_ALIGN) * SCALED_MM_ROW_ALIGN for n in self.counts]
        self.padded_starts = [sum(padded[:e]) for e in range(EXPERTS)]
        self.padded_counts = padded
        self.a_padded = torch.zeros(sum(padded), a.shape[1], device="cuda", dtype=a.dtype)
        self.expert_scales = []  # each expert's padded rows' scales, M-major as cuBLAS reads them
        start = 0
        for e, n in enumerate(self.counts):
            self.a_padded[self.padded_starts[e] : self.padded_starts[e] + n] = a[start : start + n]
            scales = torch.ones(padded[e], a_scale.shape[1], device="cuda")
            scales[:n] = a_scale[start : start + n]
            self.expert_scales.append(scales.t().contiguous().t())
            start += n

    def rows_of(self, expert: int) -> slice:
        end = int(self.offs[expert])
        return slice(end - self.counts[expert], end)

    def reference(self, expert: int) -> torch.Tensor:
        """fp32 product of one expert's rows with its dequantised weight."""
        rows = self.rows_of(expert)
        a = self.a[rows].float() * self.a_scale[rows].repeat_interleave(128, 1)[:, : self.a.shape[1]]
        return a @ fp8_ops.dequantize_fp8_blocks(self.w[expert], self.w_scale[expert], torch.float32).t()

    def per_expert(self) -> list[torch.Tensor]:
        """cuBLAS's block-scaled matmul once per expert with rows, over its padded rows."""
        outs = []
        for e, n in enumerate(self.padded_counts):
            if n:
                rows = slice(self.padded_starts[e], self.padded_starts[e] + n)
                product = F.scaled_mm(
                    self.a_padded[rows], self.w[e].t(),
                    self.expert_scales[e], F.ScalingType.BlockWise1x128,
                    self.w_scale[e].t(), F.ScalingType.BlockWise128x128,
                    output_dtype=torch.bfloat16,
                )  # fmt: skip
                outs.append(product)
        return outs


def grouped_layouts(g: Grouped) -> dict[str, Callable[[], torch.Tensor]]:
    """The calls of torch's grouped GEMM tried, by the scale layout they pass."""
    b = g.w.transpose(1, 2)  # [E, K, N], column-major in its last two dims
    m_major = g.a_scale.t().contiguous().t()
    one_by_128, blocks = F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128

    def v2(a_scale, b_scale):
        return lambda: F.scaled_grouped_mm(
            g.a, b, a_scale, one_by_128, b_scale, blocks, offs=g.offs, output_dtype=torch.bfloat16
        )

    return {
        "v2 a [P,K/128] b [E,K/128,N/128]": v2(g.a_scale, g.w_scale.transpose(1, 2)),
        "v2 a M-major b [E,K/128,N/128]": v2(m_major, g.w_scale.transpose(1, 2)),
        "v2 a [P,K/128] b [E,K/128,N/128] contiguous": v2(g.a_scale, g.w_scale.transpose(1, 2).contiguous()),
        "v2 a M-major b [E,N/128,K/128]": v2(m_major, g.w_scale),
    }


def try_grouped(name: str, g: Grouped, ceiling: float) -> None:
    """Step 1 for one product (see the module docstring)."""
    if not hasattr(F, "scaled_grouped_mm"):
        rec(f"{name}_grouped", f"this torch ({torch.__version__}) has no F.scaled_grouped_mm")
        return
    experts = [e for e in range(EXPERTS) if g.counts[e]][:4]
    for layout, call in grouped_layouts(g).items():
        try:
            out = call()
            torch.cuda.synchronize()
        except Exception as exc:  # an unsupported recipe, layout or GPU: recorded, the next one tried
            rec(f"{name}_grouped[{layout}]", f"{type(exc).__name__}: {str(exc)[:300]}")
            continue
        err = max(rel_err(out[g.rows_of(e)], g.reference(e)) for e in experts)
        rec(f"{name}_grouped[{layout}]_rel_err", f"{err:.2e}")
        if err < 2e-2:
            us = bench(call)
            rec(f"{name}_grouped_us", round(us, 1))
            rec(f"{name}_grouped_pct_of_fp8_ceiling", tflops_share(g.flops, us, ceiling))
            return


def time_per_expert(name: str, g: Grouped, ceiling: float) -> None:
    """Step 2 for one product."""
    outs = g.per_expert()
    experts = [e for e in range(EXPERTS) if g.counts[e]]
    err = max(rel_err(o[: g.counts[e]], g.reference(e)) for o, e in zip(outs[:4], experts, strict=False))
    rec(f"{name}_per_expert_rel_err", f"{err:.2e}")
    eager = bench(g.per_expert)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        g.per_expert()
        with torch.cuda.graph(graph, stream=stream):
            g.per_expert()
    torch.cuda.synchronize()
    replay = bench(graph.replay)
    for how, us in (("eager", eager), ("graph", replay)):
        rec(f"{name}_per_expert_{how}_us", round(us, 1))
        rec(f"{name}_per_expert_{how}_pct_of_fp8_ceiling", tflops_share(g.flops, us, ceiling))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    args = parser.parse_args()
    rec("gpu", torch.cuda.get_device_name())
    rec("torch", torch.__version__)
    ceiling = fp8_ceiling()
    tokens = args.tokens
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device="cuda", generator=gen, dtype=torch.bfloat16)
    ids = torch.rand(tokens, EXPERTS, device="cuda", generator=gen).topk(TOP_K, dim=1).indices
    weights = torch.full((tokens, TOP_K), 1.0 / TOP_K, device="cuda")
    order = ids.flatten().argsort(stable=True)
    counts = torch.bincount(ids.flatten(), minlength=EXPERTS).cpu()
    gate_up, gate_up_scale = expert_weights(2 * INTER, HIDDEN, seed=1)
    down, down_scale = expert_weights(HIDDEN, INTER, seed=2)
    xq, xs = quantize_groups(x)
    rows = order // TOP_K
    h = torch.randn(rows.numel(), INTER, device="cuda", generator=gen).to(torch.bfloat16)  # SwiGLU rows
    products = {
        "gate_up": Grouped(xq[rows], xs[rows], gate_up, gate_up_scale, counts),
        "down": Grouped(*quantize_groups(h), down, down_scale, counts),
    }
    for name, g in products.items():
        section(f"{name}_grouped", try_grouped, name, g, ceiling)
        section(f"{name}_per_expert", time_per_expert, name, g, ceiling)
    w = ExpertWeights(gate_up, down, (gate_up_scale, down_scale))
    useful = sum(g.flops for g in products.values())

    def hylo_step() -> None:
        us = bench(lambda: kernels.experts(x, w, Choices(ids, weights), LIMIT))
        rec("hylo_experts_step_us", round(us, 1))
        rec("hylo_experts_step_pct_of_fp8_ceiling", tflops_share(useful, us, ceiling))

    section("hylo_experts_step", hylo_step)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_grouped_mm.json").write_text(json.dumps(RESULTS, indent=1))


if __name__ == "__main__":
    main()
