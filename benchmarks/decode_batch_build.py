"""Host time of one decode step's batch metadata on the CPU, on the embedded demo model: an eager
batch build, a fixed-shape build (what the decode graphs did before they built their metadata on the
device), and what a decode graph's step now does on the host (the (prefix, row, token) rows into its
pinned upload buffer).

    .venv/bin/python benchmarks/decode_batch_build.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.forward_batch import FixedShape, ForwardBatch, SequenceChunk


def median_us(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e6


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args()
    engine = Engine(EngineConfig(max_running_requests=16), decode_graphs=True)
    graphs, c = engine.runner.graphs, engine.caches
    assert graphs is not None
    print(f"static pool table: {graphs.layout.pool_width} columns")
    for batch_size in (1, 8):
        seqs = [SequenceChunk([5], 10 + i, i, i) for i in range(batch_size)]
        bucket = next(b for b in graphs.buckets if b >= batch_size)
        fixed = FixedShape(bucket, graphs.layout.pool_width, c.scratch_slot)
        times = {
            name: median_us(
                lambda s=seqs, f=shape: ForwardBatch.build(
                    s, c.table.table, c.tokens, c.states, c.kpool, fixed=f
                ),
                args.repeats,
            )
            for name, shape in (("eager", None), ("fixed-shape", fixed))
        }
        filler = [(0, c.scratch_slot, 0)] * (bucket - batch_size)
        rows = [(s.prefix_len, s.table_row, s.token_ids[0]) for s in seqs] + filler
        times["graph upload"] = median_us(
            lambda r=rows, h=graphs.bank.host_inputs[bucket][0]: h.copy_(torch.tensor(r).t()), args.repeats
        )
        print(f"B={batch_size}: " + ", ".join(f"{name} {us:.0f} us" for name, us in times.items()))


if __name__ == "__main__":
    main()
