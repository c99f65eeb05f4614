"""Prefix caching end to end on a real-size GLM-5.3-Flash slice, with DFlash speculation on: the same
engine with the cache on and off (one shared target, runs interleaved).

    PYTHONPATH=src python3 benchmarks/device/prefix_e2e.py [--layers 8] [--reps 2] [--out DIR]

Two workloads, each repetition over a fresh random system prompt (so no repetition hits another's):
- "pair": one request of a 4096-token system prompt + 64 tokens, then one with the same system prompt
  and 64 other tokens; TTFT of each (the second's over the first's is what the cache saves).
- "multi-turn": `--conversations` conversations x `--turns` turns over one system prompt; turn t of a
  conversation is the system prompt, its earlier user messages (64 tokens) and answers (`--answer`
  greedy tokens), and a new user message; every conversation's turn is submitted at once, the next
  turn when all answers are in. Mean and median TTFT (arrival to first token), output tokens/s over
  the run, the cache's hit rate, and whether each answer equals the uncached engine's.
The slice and the random DFlash draft (block 8) are those of `spec_e2e.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from spec_e2e import write_dflash, write_target

from hylo import LLM, SamplingParams

SYSTEM, USER = 4096, 64
VOCAB = 150000


def serve(engine, prompts: list[list[int]], max_tokens: int) -> tuple[list, float]:
    """Submit every prompt at once and step until all finish: (requests, seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    start = time.perf_counter()
    requests = [engine.add_request(f"r{serve.count}-{i}", p, params)[0] for i, p in enumerate(prompts)]
    serve.count += 1
    while engine.has_unfinished():
        engine.step()
    torch.cuda.synchronize()
    return requests, time.perf_counter() - start


serve.count = 0


def ttft(request) -> float:
    return request.metrics.first_token_time - request.metrics.arrival_time


def pair(engine, gen: torch.Generator) -> dict:
    system = torch.randint(0, VOCAB, (SYSTEM,), generator=gen).tolist()
    first, second = (system + torch.randint(0, VOCAB, (USER,), generator=gen).tolist() for _ in range(2))
    (a,), _ = serve(engine, [first], 1)
    (b,), _ = serve(engine, [second], 1)
    return {"first_ttft_ms": ttft(a) * 1e3, "second_ttft_ms": ttft(b) * 1e3}


def multi_turn(engine, gen: torch.Generator, conversations: int, turns: int, answer: int) -> dict:
    system = torch.randint(0, VOCAB, (SYSTEM,), generator=gen).tolist()
    history = [list(system) for _ in range(conversations)]
    ttfts, outputs, tokens, seconds = [], [], 0, 0.0
    prefix = engine.caches.prefix
    before = (prefix.stats.hit_tokens, prefix.stats.query_tokens) if prefix else (0, 0)
    for _ in range(turns):
        for h in history:
            h += torch.randint(0, VOCAB, (USER,), generator=gen).tolist()
        requests, took = serve(engine, history, answer)
        seconds += took
        for h, r in zip(history, requests, strict=True):
            ttfts.append(ttft(r))
            outputs.append(r.output_ids)
            tokens += len(r.output_ids)
            h += r.output_ids
    report = {
        "mean_ttft_ms": statistics.mean(ttfts) * 1e3,
        "median_ttft_ms": statistics.median(ttfts) * 1e3,
        "output_tok_s": tokens / seconds,
        "seconds": seconds,
    }
    if prefix:
        hits, queries = prefix.stats.hit_tokens - before[0], prefix.stats.query_tokens - before[1]
        report["hit_rate"] = hits / queries
    return report | {"outputs": outputs}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--conversations", type=int, default=32)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--answer", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    (root / "target").mkdir()
    (root / "dflash").mkdir()
    write_target(root / "target", args.layers)
    write_dflash(root / "dflash", [1, args.layers // 2, args.layers - 2], 8)
    common = dict(
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=8192, max_running_requests=32,
        cuda_graph_max_bs=32, speculative_algorithm="DFLASH", speculative_num_draft_tokens=8,
        speculative_draft_model_path=str(root / "dflash"),
    )  # fmt: skip
    off = LLM(str(root / "target"), disable_radix_cache=True, mem_fraction_static=0.5, **common)
    on = LLM(str(root / "target"), target=off.engine.model, mem_fraction_static=0.9, **common)
    engines = {"off": off.engine, "on": on.engine}
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "layers": args.layers,
        "snapshots": on.engine.plan.num_snapshots,
        "snapshot_mib": round(on.engine.plan.bytes_per_snapshot / 2**20, 1),
        "max_total_num_tokens": {k: e.plan.max_total_num_tokens for k, e in engines.items()},
    }
    warm = torch.Generator().manual_seed(99)
    for engine in engines.values():  # warm-up: every kernel once
        pair(engine, warm)
        multi_turn(engine, warm, 4, 2, 8)
    runs: dict = {f"{w}_{k}": [] for w in ("pair", "multi_turn") for k in engines}
    agree = []
    for rep in range(args.reps):
        for workload in ("pair", "multi_turn"):
            results = {}
            for name, engine in engines.items():  # the same prompts for both engines
                gen = torch.Generator().manual_seed(1000 + rep)
                if workload == "pair":
                    results[name] = pair(engine, gen)
                else:
                    results[name] = multi_turn(engine, gen, args.conversations, args.turns, args.answer)
                runs[f"{workload}_{name}"].append(results[name])
            if workload == "multi_turn":
                same = [
                    a == b
                    for a, b in zip(results["on"].pop("outputs"), results["off"].pop("outputs"), strict=False)
                ]
                agree.append(sum(same) / len(same))
    for key, values in runs.items():
        report[key] = {m: round(statistics.median(v[m] for v in values), 3) for m in values[0]}
    report["pair_second_over_first_on"] = round(
        statistics.median(v["second_ttft_ms"] / v["first_ttft_ms"] for v in runs["pair_on"]), 3
    )
    report["multi_turn_mean_ttft_off_over_on"] = round(
        statistics.median(
            off_["mean_ttft_ms"] / on_["mean_ttft_ms"]
            for off_, on_ in zip(runs["multi_turn_off"], runs["multi_turn_on"], strict=True)
        ),
        2,
    )
    report["multi_turn_answers_equal_uncached"] = agree
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefix_e2e.json").write_text(text)


if __name__ == "__main__":
    main()
