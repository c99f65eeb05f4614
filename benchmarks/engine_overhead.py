"""Engine step rate and per-step host overhead on the CPU, on the embedded demo model.

Decodes `--steps` steps at batch 1 and batch 64 and reports steps/s, the model forward's share and
the rest (scheduling, batch metadata, sampling, bookkeeping) per step, as medians.

    .venv/bin/python benchmarks/engine_overhead.py [--steps 50]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hylo import LLM, SamplingParams
from hylo.models.demo import default_model_dir


def measure(llm: LLM, batch: int, steps: int) -> dict[str, float]:
    engine = llm.engine
    forward_times: list[float] = []
    model_forward = engine.model.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = model_forward(*args, **kwargs)
        forward_times.append(time.perf_counter() - start)
        return out

    engine.model.forward = timed_forward
    params = SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", [5 + i % 50] * 16, params)
    engine.step()  # the prefill step
    step_times = []
    forward_times.clear()
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        step_times.append(time.perf_counter() - start)
    while engine.has_unfinished():
        engine.step()
    engine.model.forward = model_forward
    step, forward = statistics.median(step_times), statistics.median(forward_times[:steps])
    return {
        "steps_per_s": 1 / step,
        "step_ms": step * 1e3,
        "forward_ms": forward * 1e3,
        "host_ms": (step - forward) * 1e3,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    llm = LLM(str(default_model_dir()), device="cpu")
    print(f"torch threads: {torch.get_num_threads()}")
    print("| batch | steps/s | step ms | model forward ms | host overhead ms |")
    print("|---|---|---|---|---|")
    for batch in (1, 64):
        r = measure(llm, batch, args.steps)
        cells = (r["steps_per_s"], r["step_ms"], r["forward_ms"], r["host_ms"])
        print(f"| {batch} | " + " | ".join(f"{v:.2f}" for v in cells) + " |")


if __name__ == "__main__":
    main()
