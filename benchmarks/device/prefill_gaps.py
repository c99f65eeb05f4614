"""Where a lone prompt's wall time goes besides the GPU's kernels: the prompt prefilled to its first token on
the 8-layer slice (`--tp 0`) or on rank 0 of a TP/EP deployment (`--tp 8`: `prefill_floors.build`), timed
without the profiler, then once under torch.profiler (CPU and CUDA activity). The kernels' union on the
GPU's timeline against the wall: the host's time before the first kernel, the GPU's busy time, and the
idle gaps between kernels by size with the kernels on each side (where the GPU waited for the host).

    PYTHONPATH=src python3 benchmarks/device/prefill_gaps.py [--tp 0|8] [--layers 8] [--tokens 13312] \
        [--sequence-parallel-tokens N] [--out FILE]

Prints and writes (`--out`) a JSON report: the unprofiled walls, the profiled wall, the first kernel's
delay after the first host event, the kernels' span, GPU busy ms, the idle gaps' total (and those over
20 us), and the largest gaps.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from prefill_floors import build, prefill


@dataclass(frozen=True)
class Gap:
    """The GPU idle from `at_us` (after the kernels before it had all ended) for `us`, between `after`
    (the kernel that ended last) and `before` (the next to start)."""

    us: float
    at_us: float
    after: str
    before: str


def busy_and_gaps(kernels: list[tuple[float, float, str]]) -> tuple[float, list[Gap]]:
    """(µs in which at least one kernel ran, the idle gaps largest first) of kernels given as (start µs,
    end µs, name), in any order; gaps are measured from the first kernel's start (`Gap.at_us`). Kernels that
    overlap (a programmatic dependent starting before the kernel ahead of it ends) count once."""
    busy, gaps, end, last = 0.0, [], None, ""
    ordered = sorted(kernels)
    for start, stop, name in ordered:
        if end is not None and start > end:
            gaps.append(Gap(start - end, end - ordered[0][0], last, name))
        if end is None or stop > end:
            busy += stop - (start if end is None else max(start, end))
            end, last = stop, name
    return busy, sorted(gaps, key=lambda g: -g.us)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=0, help="0: the slice; 4 or 8: rank 0 of that deployment")
    parser.add_argument("--layers", type=int, default=8, help="target layers (45: the full model)")
    parser.add_argument("--tokens", type=int, default=13312)
    parser.add_argument("--sequence-parallel-tokens", type=int, default=None)
    parser.add_argument("--top", type=int, default=25, help="largest gaps listed")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = build(argparse.Namespace(
        tp=args.tp, layers=args.layers, tokens=str(args.tokens), chunked_prefill_size=None,
        idle_prefill_sizes=None, sequence_parallel_tokens=args.sequence_parallel_tokens,
    ))  # fmt: skip
    for seed in (1, 2, 3):  # the first compiles what this length needs
        prefill(engine, args.tokens, seed)
    walls = []
    for seed in (4, 5):
        torch.cuda.synchronize()
        start = time.perf_counter()
        prefill(engine, args.tokens, seed)
        torch.cuda.synchronize()
        walls.append(round(1e3 * (time.perf_counter() - start), 2))
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        prefill(engine, args.tokens, 6)
        torch.cuda.synchronize()
        wall = 1e3 * (time.perf_counter() - start)
    events = prof.events()
    kernels = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() > 0
    ]
    first_host = min(e.time_range.start for e in events if e.device_type == torch.autograd.DeviceType.CPU)
    busy, gaps = busy_and_gaps(kernels)
    first, last = min(k[0] for k in kernels), max(k[1] for k in kernels)
    report = {
        "gpu": torch.cuda.get_device_name(), "tp": args.tp, "layers": args.layers, "tokens": args.tokens,
        "walls_ms": walls, "profiled_wall_ms": round(wall, 2),
        "first_kernel_after_first_host_event_ms": round((first - first_host) / 1e3, 3),
        "kernel_span_ms": round((last - first) / 1e3, 3), "gpu_busy_ms": round(busy / 1e3, 3),
        "kernels": len(kernels), "gaps_ms": round(sum(g.us for g in gaps) / 1e3, 3),
        "gaps_over_20us": sum(g.us > 20 for g in gaps),
        "gaps_over_20us_ms": round(sum(g.us for g in gaps if g.us > 20) / 1e3, 3),
        "largest_gaps": [
            {"us": round(g.us, 1), "at_ms": round(g.at_us / 1e3, 2), "after": g.after[:80],
             "before": g.before[:80]}
            for g in gaps[: args.top]
        ],
    }  # fmt: skip
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
