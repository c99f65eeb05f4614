"""A small CPU op of a CUDA engine's host work (the host packing's `repeat_interleave` of a 64-sequence
batch) on one torch CPU thread and on all of them: why a CUDA engine runs torch's CPU ops on one thread
(`engine.builder.limit_host_threads`).

    python benchmarks/host_threads.py [--sequences 64] [--calls 2000]

Prints the median µs a call for each thread count (run it beside other work to see the pool's wake-up)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    lengths = torch.randint(1, 20, (args.sequences,), generator=torch.Generator().manual_seed(0))
    for threads in sorted({1, torch.get_num_threads()}):
        torch.set_num_threads(threads)
        times = []
        for _ in range(args.calls):
            start = time.perf_counter()
            torch.repeat_interleave(torch.arange(args.sequences), lengths)
            times.append(time.perf_counter() - start)
        print(f"{threads} thread(s): {1e6 * statistics.median(times):.1f} us a call (median of {args.calls})")


if __name__ == "__main__":
    main()
