"""Where a fresh prompt's prefill goes on the GPU, kernel by kernel, on the real-size slice: one
request of `--tokens` new tokens (no prefix hit), eager and as a prefill-graph replay, under
torch.profiler (CUDA activity); the wall time of the steps up to its first token beside their GPU-busy
time. A prompt longer than the chunked-prefill size takes several steps, all of them counted.

    PYTHONPATH=src python3 benchmarks/device/prefill_kernels.py [--layers 8] [--tokens 1024] [--out DIR]
        [--engines eager,graphs]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch
from spec_e2e import write_slice_with_dflash

from hylo import LLM, SamplingParams

VOCAB = 150000


def prefill_step(engine, tokens: int, gen: torch.Generator, profile: bool) -> tuple[float, dict | None]:
    """(wall ms of the steps that prefill one fresh prompt up to its first token, {kernel: [GPU µs,
    launches]} if `profile`)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(
        f"p-{time.monotonic_ns()}", torch.randint(0, VOCAB, (tokens,), generator=gen).tolist(), params
    )
    torch.cuda.synchronize()

    def first_token() -> float:
        start = time.perf_counter()
        while engine.has_unfinished():
            engine.step()
        return (time.perf_counter() - start) * 1e3

    if not profile:
        return first_token(), None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        wall = first_token()
    kernels: dict = defaultdict(lambda: [0.0, 0])
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels[event.name][0] += event.device_time
            kernels[event.name][1] += 1
    return wall, dict(kernels)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--engines", default="eager,graphs")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target, _ = write_slice_with_dflash(Path(tempfile.mkdtemp()), args.layers)
    common = dict(
        skip_warmup=True,
        load_format="dummy",
        device="cuda",
        dtype="bfloat16",
        context_length=max(8192, args.tokens + 64),
        max_running_requests=8,
    )
    eager = LLM(str(target), cuda_graph_max_prefill_tokens=0, mem_fraction_static=0.45, **common)
    graphs = LLM(str(target), target=eager.engine.model, mem_fraction_static=0.85, **common)
    engines = {"eager": eager.engine, "graphs": graphs.engine}
    engines = {name: engines[name] for name in args.engines.split(",")}
    gen = torch.Generator().manual_seed(5)
    for engine in engines.values():  # warm-up
        prefill_step(engine, args.tokens, gen, False)
    report: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "tokens": args.tokens}
    walls: dict = {name: [] for name in engines}
    for _ in range(args.reps):
        for name, engine in engines.items():
            walls[name].append(prefill_step(engine, args.tokens, gen, False)[0])
    for name, engine in engines.items():
        wall, kernels = prefill_step(engine, args.tokens, gen, True)
        busy = sum(t for t, _ in kernels.values()) / 1e3
        top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:30]
        report[name] = {
            "wall_ms_median": round(statistics.median(walls[name]), 3),
            "wall_ms_profiled": round(wall, 3),
            "gpu_busy_ms": round(busy, 3),
            "launches": sum(n for _, n in kernels.values()),
            "top_kernels_us": [(k[:90], round(t, 1), n) for k, (t, n) in top],
        }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / f"prefill_kernels_{args.tokens}.json").write_text(text)


if __name__ == "__main__":
    main()
