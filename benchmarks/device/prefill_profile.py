"""Where a short prefill step's time goes on a real-size slice: the host profile (cProfile) and the
wall time of one eager prefill step of `--tokens` new tokens after a prefix-cache hit on a 4096-token
prefix, with and without DFlash (the random draft of `spec_e2e.py`).

    PYTHONPATH=src python3 benchmarks/device/prefill_profile.py [--layers 8] [--tokens 64]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
import time
from pathlib import Path

import torch
from spec_e2e import write_slice_with_dflash

from hylo import LLM, SamplingParams


def hit_step_ms(engine, system: list[int], tokens: int, gen: torch.Generator, profile: bool) -> tuple:
    """(ms of the step that computes a hit request's `tokens` new tokens, the profile's text)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    engine.add_request(f"seed-{time.monotonic_ns()}", [*system, 1], params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request(
        f"hit-{time.monotonic_ns()}",
        system + torch.randint(0, 150000, (tokens,), generator=gen).tolist(),
        params,
    )
    torch.cuda.synchronize()
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as gpu:
            engine.step()
            torch.cuda.synchronize()
    else:
        engine.step()
        torch.cuda.synchronize()
    took = (time.perf_counter() - start) * 1e3
    text = ""
    if profiler:
        profiler.disable()
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("cumulative").print_stats(25)
        events = gpu.key_averages()
        busy = sum(e.self_device_time_total for e in events) / 1e3
        kernels = sum(e.count for e in events if e.self_device_time_total > 0)
        table = events.table(sort_by="self_device_time_total", row_limit=12)
        text = f"GPU busy {busy:.2f} ms over {kernels} kernels\n{table}\n{out.getvalue()}"
    while engine.has_unfinished():
        engine.step()
    return took, text


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    target, draft = write_slice_with_dflash(Path(tempfile.mkdtemp()), args.layers)
    common = dict(
        skip_warmup=True,  # the script warms what it measures; see cold_start.py for the start-up warm-up
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=8192, max_running_requests=8,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    plain = LLM(str(target), mem_fraction_static=0.45, **common)
    spec = LLM(
        str(target), target=plain.engine.model, mem_fraction_static=0.85,
        speculative_algorithm="DFLASH", speculative_draft_model_path=str(draft),
        speculative_num_draft_tokens=8, **common,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    system = torch.randint(0, 150000, (4096,), generator=gen).tolist()
    for name, llm in (("plain", plain), ("dflash", spec)):
        hit_step_ms(llm.engine, system, args.tokens, gen, False)  # warm-up
        times = [hit_step_ms(llm.engine, system, args.tokens, gen, False)[0] for _ in range(args.reps)]
        took, text = hit_step_ms(llm.engine, system, args.tokens, gen, True)
        print(f"== {name}: hit step ms {sorted(times)} (profiled {took:.1f})\n{text}")


if __name__ == "__main__":
    main()
