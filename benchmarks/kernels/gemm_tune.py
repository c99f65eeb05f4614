"""Fill the small-M GEMM table (`src/hylo/ops/gemm/tables/<gpu>.json`) for GLM-5.3-Flash's projections.

    python benchmarks/kernels/gemm_tune.py [--out DIR] [--budget-s 300] [--fp8]
    python benchmarks/kernels/gemm_tune.py --check [--fp8]   # the table hidden: the heuristic's cost
    python benchmarks/kernels/gemm_tune.py --dry-run   # CPU, Triton interpreter, tiny shapes, fake timers

For every distinct projection shape (N, K) of the model and every M bucket (16, 32, 64 rows), each
launch configuration is first checked against an fp32 torch product (relative error ≤ 1e-2 in bf16),
then timed under CUDA-graph replay (median) at the bucket's smallest and largest M next to what runs
without an entry on the same inputs: `torch.nn.functional.linear` (cuBLAS) for bf16 weights; with
`--fp8`, the e4m3 projections of an FP8 checkpoint (`loader.keep_projections_fp8`) against the FP8
kernel's configuration without an entry (`ops.gemm.fallback_config`, the heuristic). An entry is
written only when its best configuration is at least 2% faster than that baseline at both ends of
the bucket (above run-to-run noise); the other shapes keep the baseline. With `--fp8-activations`
the e4m3 candidates also include configurations that quantise x in the kernel (`GemmConfig.quant_x`,
checked to 5e-2: e4m3's rounding of x), so that a table may choose w8a8 for decode as prefill's
cuBLAS path has it.
Every configuration is tried in both orientations of the tile product (`GemmConfig.swap_ab`). `--buckets`
chooses the M buckets and their order (on Hopper the CUDA GEMV takes FP8 products of <= 16 rows).
Prints the table and writes it (with the timings) to --out, together with the shipped table's entries
of the other weight format and those it did not measure; every candidate's timings go to
`gemm_tune_all[_fp8].json`. `--check` tunes nothing: it times what runs without a table entry
(`table.heuristic_config` for e4m3 weights and for the narrow bf16 dense parts of FP8 `FusedLinear`s,
cuBLAS for other bf16 ones) against the shipped table's entries and the other candidates
(issue 44's "within 1.2x of the tuned table with the table hidden").
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]
DRY = "--dry-run" in sys.argv
if DRY:
    sys.path.insert(0, str(ROOT / "tests"))
    from interpreter import use_interpreter

    use_interpreter()
sys.path.insert(0, str(ROOT / "src"))

from triton.testing import do_bench_cudagraph  # noqa: E402

from hylo.config import ModelConfig  # noqa: E402
from hylo.layers.linear import FusedLinear, Linear  # noqa: E402
from hylo.models.glm5_next import Glm5NextForCausalLM  # noqa: E402
from hylo.models.loader import keep_projections_fp8, stored_block_scaled  # noqa: E402
from hylo.ops import gemm  # noqa: E402
from hylo.ops.fp8 import dequantize_fp8_blocks, quantize_fp8_blocks  # noqa: E402
from hylo.ops.gemm import kernels, table  # noqa: E402

DEV = "cpu" if DRY else "cuda"
FP8 = "--fp8" in sys.argv
# e4m3 weights: also try configurations that quantise the activations (w8a8, `GemmConfig.quant_x`);
# their error is e4m3's rounding of x, as cuBLAS's block-scaled matmul has it for prefill
FP8_ACTIVATIONS = "--fp8-activations" in sys.argv
MAX_ERROR, MAX_ERROR_QUANT_X = 1e-2, 5e-2
MARGIN = 1.02  # an entry must beat cuBLAS by this factor at both ends of its bucket: run-to-run noise is ~1%


def model_shapes(dense_parts: bool = False) -> list[tuple[int, int]]:
    """Distinct (N, K) of the model's projections and head (hylo `Linear`s; with `--fp8` its e4m3
    ones), built on the meta device, the most weight bytes per decode step first (the budget may end
    before the last ones). `dense_parts`: those of the bf16 parts an FP8 checkpoint keeps beside
    e4m3 ones in a `FusedLinear` (its `dense_weight`) instead."""
    if DRY:
        return [(16, 128)] if dense_parts else [(48, 256), (24, 128)]
    with torch.device("meta"):
        model = Glm5NextForCausalLM(ModelConfig.from_dict({}))
        if FP8 or dense_parts:
            keep_projections_fp8(model, stored_block_scaled)
    if dense_parts:
        weights = [m.dense_weight for m in model.modules() if isinstance(m, FusedLinear)]
        shapes = Counter(tuple(w.shape) for w in weights if w is not None)
    else:
        modules = [m for m in model.modules() if isinstance(m, Linear) and m.fp8 == FP8]
        shapes = Counter(tuple(m.weight.shape) for m in modules)
    return sorted(shapes, key=lambda nk: -shapes[nk] * nk[0] * nk[1])


def candidates(bucket: int) -> list[table.GemmConfig]:
    grid = itertools.product((64, 128), (128, 256), (1, 2, 4, 8), (4,), (3,))
    if FP8:  # a K tile must lie inside one scale block; with a byte per weight, deeper pipelines
        grid = itertools.product((32, 64, 128), (128,), (1, 2, 4, 8), (4,), (3, 5))
    if DRY:
        grid = itertools.product((16,), (32,), (1, 2), (4,), (2,))
    configs = [table.GemmConfig(bucket, bn, bk, sk, w, st) for bn, bk, sk, w, st in grid]
    # the transposed tile: from 64 weight rows a tile is a warpgroup MMA's M side (Hopper's wgmma)
    configs += [dataclasses.replace(c, swap_ab=True) for c in configs if DRY or c.block_n >= 64]
    if FP8 and FP8_ACTIVATIONS:
        configs += [dataclasses.replace(c, quant_x=True) for c in configs]
    return configs


def config_name(c: table.GemmConfig) -> str:
    flags = "_qx" * c.quant_x + "_swap" * c.swap_ab
    return f"bm{c.block_m}_bn{c.block_n}_bk{c.block_k}_sk{c.split_k}_w{c.num_warps}_s{c.num_stages}{flags}"


def timed(fn) -> float:
    if DRY:
        fn()
        return 1.0
    return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3


@dataclasses.dataclass
class Operands:
    """One shape's weight (e4m3 with its scales under `--fp8`) and x at the bucket's two ends, with
    their fp32 products (the reference)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    xs: dict[int, torch.Tensor]
    refs: dict[int, torch.Tensor]

    def error(self, config: table.GemmConfig) -> float:
        return max(
            float((kernels.gemm(x, self.weight, config, self.scale).float() - self.refs[m]).norm())
            / float(self.refs[m].norm())
            for m, x in self.xs.items()
        )

    def time(self, config_of) -> dict[int, float]:
        """Median µs at each end of the bucket of the Triton kernel with `config_of(m)`."""
        us = {}
        for m, x in self.xs.items():
            config = config_of(m)
            us[m] = timed(lambda x=x, c=config: kernels.gemm(x, self.weight, c, self.scale))
        return us

    def baseline(self) -> dict[int, float]:
        """What runs without a table entry: cuBLAS for bf16, `fallback_config` for e4m3."""
        if self.scale is None:
            return {m: timed(lambda x=x: F.linear(x, self.weight)) for m, x in self.xs.items()}
        n, k = self.weight.shape
        return self.time(lambda m: gemm.fallback_config(m, n, k, self.weight.device))


def operands(n: int, k: int, bucket: int, gen: torch.Generator) -> Operands:
    dtype = torch.float32 if DRY else torch.bfloat16
    weight = torch.randn(n, k, generator=gen).div(k**0.5).to(DEV, dtype)
    scale = None
    if FP8:
        weight, scale = quantize_fp8_blocks(weight)
    low = {16: 1, 32: 17, 64: 33}[bucket]
    xs = {m: torch.randn(m, k, generator=gen).to(DEV, dtype) for m in (low, bucket)}
    exact = weight.float() if scale is None else dequantize_fp8_blocks(weight, scale, torch.float32)
    return Operands(weight, scale, xs, {m: x.float() @ exact.t() for m, x in xs.items()})


def rounded(us: dict[int, float]) -> dict[str, float]:
    return {str(m): round(t, 2) for m, t in us.items()}


def tune_shape(n: int, k: int, bucket: int, gen: torch.Generator) -> dict | None:
    ops = operands(n, k, bucket, gen)
    xs, baseline = ops.xs, ops.baseline()
    best, tried = None, {}
    for config in candidates(bucket):
        try:
            error = ops.error(config)
        except Exception:  # a tile the GPU cannot hold: not a candidate
            continue
        if error > (MAX_ERROR_QUANT_X if config.quant_x else MAX_ERROR):
            print(f"  rejected {config} (rel. error {error:.2e})")
            continue
        us = ops.time(lambda m, c=config: c)
        tried[config_name(config)] = rounded(us)
        low, high = xs
        if best is None or us[high] + us[low] < best[1][high] + best[1][low]:
            best = (config, us, error)
    if best is None:
        return None
    config, us, error = best
    faster = DRY or all(us[m] * MARGIN <= baseline[m] for m in xs)
    return {
        "config": config.__dict__,
        "us": rounded(us),
        ("fallback_us" if FP8 else "cublas_us"): rounded(baseline),
        "rel_error": error,
        "beats_baseline": faster,
        "tried": tried,
    }


def check_shape(n: int, k: int, bucket: int, gen: torch.Generator, gpu: str) -> dict:
    """The GPU's table hidden, as on a GPU without one: the heuristic configuration
    (`table.heuristic_config`, checked against the reference) beside the table's entry for the shape,
    for bf16 weights cuBLAS, and three neighbours of the heuristic; median µs at the bucket's two ends."""
    ops = operands(n, k, bucket, gen)
    heuristic = {m: gemm.fallback_config(m, n, k, ops.weight.device) for m in ops.xs}
    error = max(ops.error(c) for c in heuristic.values())
    if error > MAX_ERROR:
        raise AssertionError(f"(N={n}, K={k}) heuristic {heuristic}: rel. error {error:.2e}")
    us = {"heuristic": rounded(ops.time(heuristic.__getitem__))}
    # its neighbours, to see which way a miss leans: the other tile orientation, half and twice the split
    for name, change in {
        "swap_ab": lambda c: dataclasses.replace(c, swap_ab=True),
        "half_split": lambda c: dataclasses.replace(c, split_k=max(1, c.split_k // 2)),
        "twice_split": lambda c: dataclasses.replace(c, split_k=c.split_k * 2),
    }.items():
        us[name] = rounded(ops.time(lambda m, change=change: change(heuristic[m])))
    entry = table.lookup(gpu, bucket, n, k, FP8)
    if entry is not None:
        us["tuned"] = rounded(ops.time(lambda m: entry))
    if not FP8:
        us["cublas"] = rounded(ops.baseline())
    return {
        "heuristic": [heuristic[m].__dict__ for m in ops.xs],
        "entry": None if entry is None else entry.__dict__,
        "us": us,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--budget-s", type=float, default=300, help="stop tuning new shapes after this")
    parser.add_argument(
        "--dry-run", action="store_true", help="CPU, interpreter, tiny shapes (checks the script)"
    )
    parser.add_argument("--fp8", action="store_true", help="the e4m3 projections of an FP8 checkpoint")
    parser.add_argument(
        "--buckets", default=",".join(map(str, table.M_BUCKETS)),
        help="M buckets to tune, in this order (FP8 products of <= 16 rows run the CUDA GEMV on Hopper)",
    )  # fmt: skip
    parser.add_argument(
        "--fp8-activations", action="store_true",
        help="with --fp8: also try quantising the activations in the kernel (w8a8; e4m3 error on x)",
    )  # fmt: skip
    parser.add_argument(
        "--shapes", default=None,
        help="only these projection shapes, as NxK[,NxK...] (default: every shape of the model)",
    )  # fmt: skip
    parser.add_argument(
        "--check", action="store_true",
        help="tune nothing: time the heuristic configuration against the shipped table's entries",
    )  # fmt: skip
    args = parser.parse_args()
    gpu = "dry-run" if DRY else torch.cuda.get_device_name()
    gen = torch.Generator().manual_seed(0)
    buckets = [int(b) for b in args.buckets.split(",")]
    if not set(buckets) <= set(table.M_BUCKETS):
        parser.error(f"--buckets: each must be one of {table.M_BUCKETS}, got {args.buckets}")
    if args.check:
        check(gpu, buckets, gen, Path(args.out))
        return
    shapes = model_shapes()
    if args.shapes:
        chosen = [tuple(int(d) for d in nk.split("x")) for nk in args.shapes.split(",")]
        if unknown := [nk for nk in chosen if nk not in shapes]:
            parser.error(f"--shapes: {unknown} are not the model's; it has {shapes}")
        shapes = chosen
    deadline = time.time() + args.budget_s
    entries, measured = {}, {}
    for bucket, (n, k) in itertools.product(buckets, shapes):
        if time.time() > deadline:
            print(f"budget spent: from bucket {bucket}, shape (N={n}, K={k}) on, nothing was tuned")
            break
        result = tune_shape(n, k, bucket, gen)
        key = table.entry_key(bucket, n, k, FP8)
        measured[key] = result
        if result is not None and result["beats_baseline"]:
            entries[key] = {name: value for name, value in result.items() if name != "tried"}
        shown = None if result is None else {name: v for name, v in result.items() if name != "tried"}
        print(f"{key:24s} {json.dumps(shown)}", flush=True)
    shipped = table.table_path(gpu)
    if shipped.exists():  # keep the entries of the other weight format, and those not measured now
        kept = json.loads(shipped.read_text())["entries"]
        entries |= {key: e for key, e in kept.items() if key.endswith("_fp8") != FP8 or key not in measured}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / table.table_path(gpu).name).write_text(json.dumps({"gpu": gpu, "entries": entries}, indent=1))
    (out / f"gemm_tune_all{'_fp8' * FP8}.json").write_text(
        json.dumps({"gpu": gpu, "measured": measured}, indent=1)
    )
    print(f"\n{len(entries)} of {len(measured)} (shape, bucket) entries beat cuBLAS on {gpu}")


def without_entry(n: int) -> str:
    """What `ops.gemm.linear` runs under capture for a shape without a table entry: the heuristic
    configuration (e4m3 weights, and bf16 ones of at most `table.NARROW_MAX_N` columns) or cuBLAS."""
    return "heuristic" if FP8 or n <= table.NARROW_MAX_N else "cublas"


def check(gpu: str, buckets: list[int], gen: torch.Generator, out: Path) -> None:
    """`--check`: per shape and bucket, what runs without a table entry (`without_entry`) over the
    tuned entry and over the other candidates; the worst of each ratio at the end."""
    results, worst = {}, {}
    shapes = model_shapes() + ([] if FP8 else model_shapes(dense_parts=True))
    for bucket, (n, k) in itertools.product(buckets, shapes):
        key = table.entry_key(bucket, n, k, FP8)
        result = results[key] = check_shape(n, k, bucket, gen, gpu)
        us = result["us"]
        fallback = without_entry(n)
        ratios = {
            f"{fallback}/{other}": max(us[fallback][m] / us[other][m] for m in us[fallback])
            for other in ("tuned", "heuristic", "cublas")
            if other in us and other != fallback
        }
        result["ratios"] = {name: round(r, 3) for name, r in ratios.items()}
        for name, r in ratios.items():
            if r > worst.get(name, (0, None))[0]:
                worst[name] = (round(r, 3), key)
        print(f"{key:24s} {json.dumps(us)} {json.dumps(result['ratios'])}", flush=True)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"gemm_check{'_fp8' * FP8}.json").write_text(json.dumps({"gpu": gpu, "shapes": results}, indent=1))
    print(f"\n{gpu}: worst ratios (slower end of each bucket): {json.dumps(worst)}")


if __name__ == "__main__":
    main()
