"""Prefill chunks as CUDA-graph replays, end to end on the real-size GLM-5.3-Flash slice: the same engine
with the prefill graphs on (the default, buckets up to 1024 tokens) and off
(`cuda_graph_max_prefill_tokens=0`), without and with DFlash; one shared target, runs interleaved.

    PYTHONPATH=src python3 benchmarks/device/prefill_graph_e2e.py [--layers 8] [--reps 5] [--out DIR]

Workloads, each repetition with fresh random tokens (no repetition hits another's cache):
- "fresh": one request of n new tokens (64, 256, 1024), no prefix hit; TTFT (arrival to first token,
  one greedy token).
- "pair": a 4096-token system prompt + 64 tokens, then the same system prompt + 64 other tokens;
  TTFT of each and the second's over the first's (the prefix cache leaves the second a 64-token
  prefill after a hit).
Medians over the repetitions; the slice and its random DFlash draft (block 8) are `spec_e2e.py`'s.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from prefix_e2e import SYSTEM, USER, VOCAB, serve, ttft
from spec_e2e import write_slice_with_dflash

from hylo import LLM

FRESH = (64, 256, 1024)


def fresh(engine, gen: torch.Generator) -> dict:
    out = {}
    for n in FRESH:
        (r,), _ = serve(engine, [torch.randint(0, VOCAB, (n,), generator=gen).tolist()], 1)
        out[f"ttft_{n}_ms"] = ttft(r) * 1e3
    return out


def pair(engine, gen: torch.Generator) -> dict:
    system = torch.randint(0, VOCAB, (SYSTEM,), generator=gen).tolist()
    first, second = (system + torch.randint(0, VOCAB, (USER,), generator=gen).tolist() for _ in range(2))
    (a,), _ = serve(engine, [first], 1)
    (b,), _ = serve(engine, [second], 1)
    return {
        "first_ttft_ms": ttft(a) * 1e3,
        "second_ttft_ms": ttft(b) * 1e3,
        "second_over_first": ttft(b) / ttft(a),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target, draft = write_slice_with_dflash(Path(tempfile.mkdtemp()), args.layers)
    common = dict(
        skip_warmup=True,  # the script warms what it measures; see cold_start.py for the start-up warm-up
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=8192, max_running_requests=8,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    dflash = dict(
        speculative_algorithm="DFLASH",
        speculative_num_draft_tokens=8,
        speculative_draft_model_path=str(draft),
    )
    eager = LLM(str(target), cuda_graph_max_prefill_tokens=0, mem_fraction_static=0.4, **common)
    shared = dict(target=eager.engine.model, **common)
    llms = {
        "eager": eager,
        "graphs": LLM(str(target), mem_fraction_static=0.55, **shared),
        "dflash_eager": LLM(
            str(target), cuda_graph_max_prefill_tokens=0, mem_fraction_static=0.7, **dflash, **shared
        ),
        "dflash_graphs": LLM(str(target), mem_fraction_static=0.85, **dflash, **shared),
    }
    engines = {name: llm.engine for name, llm in llms.items()}
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "layers": args.layers,
        "prefill_buckets": engines["graphs"].runner.prefill_graphs.buckets,
        "memory": {name: engine.memory_report for name, engine in engines.items()},
    }
    warm = torch.Generator().manual_seed(99)
    for engine in engines.values():  # warm-up: every kernel once
        fresh(engine, warm)
        pair(engine, warm)
    runs: dict = {f"{w}_{name}": [] for w in ("fresh", "pair") for name in engines}
    for rep in range(args.reps):
        for workload, fn in (("fresh", fresh), ("pair", pair)):
            for name, engine in engines.items():  # the same prompts for every engine
                runs[f"{workload}_{name}"].append(fn(engine, torch.Generator().manual_seed(1000 + rep)))
    for key, values in runs.items():
        report[key] = {m: round(statistics.median(v[m] for v in values), 3) for m in values[0]}
        report[key + "_reps"] = values
    for base in ("", "dflash_"):
        off, on = runs[f"fresh_{base}eager"], runs[f"fresh_{base}graphs"]
        report[f"{base}fresh_eager_over_graphs"] = {
            n: round(
                statistics.median(
                    a[f"ttft_{n}_ms"] / b[f"ttft_{n}_ms"] for a, b in zip(off, on, strict=True)
                ),
                2,
            )
            for n in FRESH
        }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_graph_e2e.json").write_text(text)


if __name__ == "__main__":
    main()
