"""What the kernel benchmark scripts share: a results record, sections that survive failures, timers.

`--dry-run` on a script's command line (CPU, Triton interpreter, tiny sizes) makes the timers run the
function once and report 1 us, so the script's own logic is checked without a GPU.
"""

from __future__ import annotations

import sys
import time
import traceback

DRY = "--dry-run" in sys.argv
RESULTS: dict[str, object] = {}


def rec(key: str, value: object) -> None:
    RESULTS[key] = value
    print(f"{key}: {value}", flush=True)


def section(name: str, fn, *args) -> None:
    """Run one part of a benchmark; a failure is recorded and the other parts still run."""
    start = time.time()
    try:
        fn(*args)
    except Exception:  # keep measuring the other sections; the log says what broke
        rec(f"{name}_error", traceback.format_exc()[-2000:])
    rec(f"{name}_wall_s", round(time.time() - start, 1))


def bench_graph(fn, rep: int = 50) -> float:
    """Median microseconds of a CUDA-graph replay (small launches); compiles outside the capture."""
    fn()
    if DRY:
        return 1.0
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def bench(fn, rep: int = 100) -> float:
    """Median microseconds of eager launches."""
    if DRY:
        fn()
        return 1.0
    from triton.testing import do_bench

    return do_bench(fn, warmup=10, rep=rep, return_mode="median") * 1e3


def fp8_ceiling() -> float:
    """The FP8 matmul ceiling the kernel benchmarks divide by: `torch._scaled_mm` on 8192³ e4m3 with
    per-tensor scales (256³ on the CPU of a dry run), TFLOP/s, recorded as `fp8_scaled_mm_TFLOPs`."""
    import torch

    n, device = (256, "cpu") if DRY else (8192, "cuda")
    a8 = torch.randn(n, n, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn)
    b8 = torch.randn(n, n, device=device, dtype=torch.bfloat16).to(torch.float8_e4m3fn).t()  # column-major
    one = torch.ones((), device=device)
    t = bench(lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
    tflops = round(2 * n**3 / (t * 1e-6) / 1e12, 1)
    rec("fp8_scaled_mm_TFLOPs", tflops)
    return tflops
