"""Host time to build one decode step's batch metadata on the CPU, eager vs the fixed shapes the decode
CUDA graphs replay (padding to the bucket, the static pool table's columns), on the embedded demo model.

    .venv/bin/python benchmarks/decode_batch_build.py [--repeats 200]
"""

from __future__ import annotations

import argparse
import statistics
import time

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
    print(f"static pool table: {graphs.pool_width} columns")
    for batch_size in (1, 8):
        seqs = [SequenceChunk([5], 10 + i, i, i) for i in range(batch_size)]
        bucket = next(b for b in graphs.buckets if b >= batch_size)
        fixed = FixedShape(bucket, graphs.pool_width, c.scratch_slot)
        times = {
            name: median_us(
                lambda s=seqs, f=shape: ForwardBatch.build(
                    s, c.table.table, c.tokens, c.states, c.kpool, fixed=f
                ),
                args.repeats,
            )
            for name, shape in (("eager", None), ("fixed-shape", fixed))
        }
        print(f"B={batch_size}: " + ", ".join(f"{name} build {us:.0f} us" for name, us in times.items()))


if __name__ == "__main__":
    main()
