"""The CUDA C++ FP8 GEMV (`hylo.ops.gemm.gemv_cuda`) against the tuned Triton w8a16 kernel and the bytes
floor, for M = 1, 4, 8, 16 rows at GLM-5.3-Flash's FP8 projection shapes and TP-rank shards of them.

    python benchmarks/kernels/fp8_gemv_cuda.py [--out DIR]       # GPU, about 2 minutes with the build
    python benchmarks/kernels/fp8_gemv_cuda.py --dry-run         # CPU: the script's logic, tiny shapes
    python benchmarks/kernels/fp8_gemv_cuda.py --all-splits      # also the GEMV at every compiled K split
    python benchmarks/kernels/fp8_gemv_cuda.py --variants d6=HYLO_GEMV_DEPTH_8=6+HYLO_GEMV_MIN_CTAS_8=1
                                                  # also builds of the kernel with other -D tunables

Per shape and M: first parity of both kernels against the float64 product (`gemv_cuda.worst_error`,
≤ 1 is within the GEMV's arithmetic; a kernel that fails is not timed), then CUDA-graph medians
(`triton.testing.do_bench_cudagraph`) of `COPIES_BYTES / weight bytes` back-to-back calls over as many
distinct weight copies (so no call finds its weight in L2, as in a decode step), divided by the calls.
Triton runs the configuration of this GPU's shipped table (`ops/gemm/tables`) where it has the shape,
else `fallback_config` (the table column says which). The floor is the bytes one call moves (e4m3
weight, scales, x, out) at the copy rate measured in this run (read + write bytes of a 2 GiB device copy,
as `benchmarks/device/spec_e2e.py` measures it). The GEMV is timed as dispatched (a programmatic
dependent of the call before it where `ops.dependent_launch` says so, which lets each call load its
first weights while the previous one finishes) and launched plainly (`gemv_plain_us`); `--variants`
adds builds with other values of `fp8_gemv.cu`'s `HYLO_GEMV_*` macros, each checked like the shipped
one. Also records the GEMV's build-and-check time (the first call; a cold kernel cache includes nvcc).
Writes `fp8_gemv_cuda.json` and `fp8_gemv_cuda.md`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

DRY = "--dry-run" in sys.argv
ALL_SPLITS = "--all-splits" in sys.argv  # also time the GEMV at every compiled K split
VARIANTS: dict[str, object] = {}  # name -> a checked library built with other -D tunables (`--variants`)
ROOT = Path(__file__).resolve().parents[2]
if DRY:
    sys.path.insert(0, str(ROOT / "tests"))
    from interpreter import use_interpreter

    use_interpreter()
sys.path.insert(0, str(ROOT / "src"))

from harness import RESULTS, bench_graph, rec, section  # noqa: E402

from hylo.ops import gemm  # noqa: E402
from hylo.ops.gemm import gemv_cuda, kernels, table  # noqa: E402

DEV = "cpu" if DRY else "cuda"
ROWS = (1, 4) if DRY else (1, 4, 8, 16)
# (N, K) of the FP8 projections (the shipped table's `_fp8` keys), then TP-rank shards (N or K / 4, 8)
SHAPES = (
    [(256, 512)]
    if DRY
    else [
        (24576, 4096), (12288, 4096), (4096, 16384), (4096, 12288), (4096, 8192), (16384, 1536),
        (2176, 4096), (2048, 4096), (4096, 2048), (4096, 1536), (8192, 128), (256, 4096),
        (3072, 4096), (1536, 4096), (4096, 1024), (272, 4096),
    ]
)  # fmt: skip
# weight bytes a timed graph cycles through (`--copies-mib`): 4x an H200's L2 by default; a decode step's
# weights span tens of GB, which a larger figure comes closer to (TLB reach)
COPIES_BYTES = 1 << 20 if DRY else 256 << 20


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write), as spec_e2e measures it."""
    if DRY:
        return 1e12
    from triton.testing import do_bench

    src = torch.empty(2**29, dtype=torch.float32, device=DEV)
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms / 1e3)


def gemv_status() -> None:
    """Build (or read from the cache) and check the GEMV; the time and the reason if it is off."""
    start = time.perf_counter()
    off = "the CUDA GEMV runs on a GPU" if DRY else gemv_cuda.device_refusal(torch.device(DEV, 0))
    rec("gemv_build_and_check_s", round(time.perf_counter() - start, 1))
    rec("gemv_off", off)


def per_call_us(fn, copies: list[tuple[torch.Tensor, torch.Tensor]]) -> float:
    """Median graph time of `fn(weight, scale)` over every copy in turn, per call (20 ms of replays a
    sample: 128 of them fit the script's 3-minute budget)."""
    return bench_graph(lambda: [fn(w, s) for w, s in copies], rep=20) / len(copies)


def measure_shape(n: int, k: int, bandwidth: float, gpu: str) -> list[dict]:
    gen = torch.Generator(device=DEV).manual_seed(n + k)
    weight, scale = gemv_cuda.random_e4m3(n, k, gen)
    count = max(2, -(-COPIES_BYTES // (n * k)))
    copies = [(weight, scale)] + [(weight.clone(), scale.clone()) for _ in range(count - 1)]
    # the interpreter's dot has no bf16: the dry run's x is fp32 (the GEMV is off there anyway)
    x16 = torch.randn(16, k, generator=gen, device=DEV).to(torch.float32 if DRY else torch.bfloat16)
    rows = []
    for m in ROWS:
        x = x16[:m]
        moved = n * k + scale.numel() * 4 + m * k * 2 + m * n * 2
        config = table.lookup(gpu, m, n, k, fp8=True)
        row = {
            "n": n, "k": k, "m": m, "split": gemv_cuda.split_for(n, k, sms()), "copies": count,
            "slices": gemv_cuda.slices_for(m, n, k, gemv_cuda.split_for(n, k, sms()), sms()),
            "floor_us": round(moved / bandwidth * 1e6, 2), "triton_config": "table" if config else "fallback",
        }  # fmt: skip
        config = config or gemm.fallback_config(m, n, k, x.device)
        ways = {"triton": lambda w, s, x=x, c=config: kernels.gemm(x, w, c, s)}
        refused = RESULTS.get("gemv_off", "its status is unknown") or gemv_cuda.refusal(x, weight, scale)
        if refused is None:
            ways["gemv"] = lambda w, s, x=x: gemv_cuda.gemv(x, w, s)
            ways["gemv_plain"] = lambda w, s, x=x: gemv_cuda.gemv(x, w, s, dependent=False)
            for name, library in VARIANTS.items():
                ways[f"gemv_{name}"] = lambda w, s, x=x, lib=library: gemv_cuda.gemv(x, w, s, library=lib)
        else:
            row["gemv_refused"] = refused
        for name, fn in ways.items():
            try:
                error = gemv_cuda.worst_error(fn(weight, scale), x, weight, scale)
                row[f"{name}_error_over_bound"] = round(error, 3)
                if error <= 1.0:
                    row[f"{name}_us"] = round(per_call_us(fn, copies), 2)
                    row[f"{name}_of_floor"] = round(row["floor_us"] / row[f"{name}_us"], 3)
            except Exception as e:  # one way failing leaves the other measured
                row[f"{name}_failed"] = repr(e)[:300]
        if "gemv_us" in row and "triton_us" in row:
            row["triton_over_gemv"] = round(row["triton_us"] / row["gemv_us"], 2)
        if ALL_SPLITS and "gemv_us" in row:  # what `split_for` chose against the other compiled splits
            row["gemv_us_by_split"] = {
                split: round(per_call_us(lambda w, s, x=x, c=split: gemv_cuda.gemv(x, w, s, c), copies), 2)
                for split in gemv_cuda.SPLITS
                if split == 1 or 2 * split <= -(-k // 128)
            }
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def build_variants(spec: str) -> None:
    """`--variants name=MACRO=V+MACRO=V,...`: build and check each (a failure is recorded, not timed)."""
    for item in filter(None, spec.split(",")):
        name, _, macros = item.partition("=")
        defines = tuple(filter(None, macros.split("+")))
        library = gemv_cuda.load_library("sm_90a", defines)
        failure = (
            library if isinstance(library, str) else gemv_cuda.check_library(library, torch.device(DEV, 0))
        )
        rec(f"variant_{name}", {"defines": defines, "failed": failure})
        if failure is None:
            VARIANTS[name] = library


def sms() -> int:
    return 132 if DRY else torch.cuda.get_device_properties(0).multi_processor_count


def measure(bandwidth: float, gpu: str, shapes: list[tuple[int, int]]) -> None:
    rows = []
    for n, k in shapes:
        rows += measure_shape(n, k, bandwidth, gpu)
        if not DRY:
            torch.cuda.empty_cache()  # the shape's weight copies
    rec("rows", rows)


def markdown(gpu: str) -> str:
    lines = [
        f"FP8 GEMV on {gpu}: copy rate {RESULTS['copy_bytes_per_s'] / 1e12:.2f} TB/s, "
        f"GEMV {'on' if RESULTS.get('gemv_off') is None else 'off: ' + str(RESULTS['gemv_off'])}, "
        f"build + check {RESULTS.get('gemv_build_and_check_s')} s",
        "",
        "| N × K | M | split | CUDA GEMV µs | Triton µs (config) | floor µs | GEMV / floor | Triton / floor |"
        " Triton / GEMV |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in RESULTS.get("rows", []):
        gemv = r.get("gemv_us", "refused" if "gemv_refused" in r else "failed")
        lines.append(
            f"| {r['n']} × {r['k']} | {r['m']} | {r['split']} | {gemv} | {r.get('triton_us', 'failed')} "
            f"({r['triton_config']}) | {r['floor_us']} | {r.get('gemv_of_floor', '')} | "
            f"{r.get('triton_of_floor', '')} | {r.get('triton_over_gemv', '')} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=os.environ.get("OUT", "out"))
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--all-splits", action="store_true", help="time the GEMV at every compiled split too")
    parser.add_argument("--shapes", default="", help="NxK,NxK,... instead of the model's shapes")
    parser.add_argument("--copies-mib", type=int, default=0, help="weight MiB the timed calls cycle through")
    parser.add_argument(
        "--variants", default="", help="name=MACRO=V+MACRO=V,...: builds with other HYLO_GEMV_* values too"
    )
    args = parser.parse_args()
    if args.copies_mib:
        global COPIES_BYTES
        COPIES_BYTES = args.copies_mib << 20
    gpu = "CPU (dry run)" if DRY else torch.cuda.get_device_name(0)
    rec("gpu", gpu)
    section("gemv_status", gemv_status)
    rec("copy_bytes_per_s", copy_bandwidth())
    if args.variants and not DRY and RESULTS.get("gemv_off") is None:
        section("variants", build_variants, args.variants)
    shapes = (
        [tuple(int(v) for v in nk.split("x")) for nk in args.shapes.split(",")] if args.shapes else SHAPES
    )
    section("measure", measure, RESULTS["copy_bytes_per_s"], gpu, shapes)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "fp8_gemv_cuda.json").write_text(json.dumps(RESULTS, indent=1))
    table_text = markdown(gpu)
    (out / "fp8_gemv_cuda.md").write_text(table_text)
    print(table_text)


if __name__ == "__main__":
    main()
