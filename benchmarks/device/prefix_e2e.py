"""Prefix caching end to end on a real-size GLM-5.3-Flash slice, with DFlash speculation on: the same
engine with the cache on and off (one shared target, runs interleaved).

    PYTHONPATH=src python3 benchmarks/device/prefix_e2e.py [--layers 8] [--reps 2] [--out DIR]

Two workloads, each repetition over a fresh random system prompt (so no repetition hits another's):
- "pair" (also without speculation): one request of a 4096-token system prompt + 64 tokens, then
  one with the same system prompt and 64 other tokens; TTFT of each (the second's over the first's
  is what the cache saves).
- "multi-turn": `--conversations` conversations x `--turns` turns over one system prompt; turn t of a
  conversation is the system prompt, its earlier user messages (64 tokens) and answers (`--answer`
  greedy tokens), and a new user message; every conversation's turn is submitted at once, the next
  turn when all answers are in. Mean and median TTFT (arrival to first token), output tokens/s over
  the run, the cache's hit rate, and whether each answer (and its first token) equals the uncached
  engine's (bf16 with random weights: near-uniform logits, so a last-bit difference flips greedy picks;
  the pairs' first-token logprob gaps, cached against uncached, are the correctness figure).
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
from spec_e2e import write_slice_with_dflash

from hylo import LLM, SamplingParams

SYSTEM, USER = 4096, 64
VOCAB = 150000


def serve(
    engine, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None
) -> tuple[list, float]:
    """Submit every prompt at once and step until all finish: (requests, seconds)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=logprobs)
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
    (a,), _ = serve(engine, [first], 1, logprobs=5)
    (b,), _ = serve(engine, [second], 1, logprobs=5)
    return {
        "first_ttft_ms": ttft(a) * 1e3,
        "second_ttft_ms": ttft(b) * 1e3,
        "logprobs": [a.logprobs, b.logprobs],
    }


def logprob_gap(ours: list[dict[int, float]], theirs: list[dict[int, float]]) -> float:
    """Largest difference between two runs' logprobs of the same token ids (top-5 of the first token)."""
    (a,), (b,) = ours, theirs
    return max(abs(a[t] - b[t]) for t in a.keys() & b.keys())


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
    target, draft = write_slice_with_dflash(Path(tempfile.mkdtemp()), args.layers)
    common = dict(
        skip_warmup=True,  # the script warms what it measures; see cold_start.py for the start-up warm-up
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=8192, max_running_requests=32,
        cuda_graph_max_bs=32, speculative_algorithm="DFLASH", speculative_num_draft_tokens=8,
        speculative_draft_model_path=str(draft),
    )  # fmt: skip
    off = LLM(str(target), disable_radix_cache=True, mem_fraction_static=0.4, **common)
    on = LLM(str(target), target=off.engine.model, mem_fraction_static=0.55, **common)
    plain = {k: v for k, v in common.items() if not k.startswith("speculative")}
    shared = dict(target=off.engine.model, **plain)
    plain_off = LLM(str(target), disable_radix_cache=True, mem_fraction_static=0.7, **shared)
    plain_on = LLM(str(target), mem_fraction_static=0.85, **shared)
    # the noise of bf16 on its own: the uncached engine prefilling in chunks of 1024 (where the cache's
    # snapshots split KDA, though here attention is split too)
    chunked = LLM(
        str(target), disable_radix_cache=True, mem_fraction_static=0.95, chunked_prefill_size=1024,
        **shared,
    )  # fmt: skip
    engines = {
        "off": off.engine, "on": on.engine, "plain_off": plain_off.engine, "plain_on": plain_on.engine,
        "plain_off_chunked": chunked.engine,
    }  # fmt: skip
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "layers": args.layers,
        "snapshots": on.engine.plan.num_snapshots,
        "snapshot_mib": round(on.engine.plan.bytes_per_snapshot / 2**20, 1),
        "max_total_num_tokens": {k: e.plan.max_total_num_tokens for k, e in engines.items()},
    }
    warm = torch.Generator().manual_seed(99)
    for name, engine in engines.items():  # warm-up: every kernel once
        pair(engine, warm)
        if not name.startswith("plain"):
            multi_turn(engine, warm, 4, 2, 8)
    runs: dict = {f"pair_{k}": [] for k in engines} | {"multi_turn_off": [], "multi_turn_on": []}
    agree, first_agree, gaps = [], [], []
    for rep in range(args.reps):
        for workload in ("pair", "multi_turn"):
            results = {}
            for name, engine in engines.items():  # the same prompts for every engine
                if workload == "multi_turn" and name.startswith("plain"):
                    continue
                gen = torch.Generator().manual_seed(1000 + rep)
                if workload == "pair":
                    results[name] = pair(engine, gen)
                else:
                    results[name] = multi_turn(engine, gen, args.conversations, args.turns, args.answer)
                runs[f"{workload}_{name}"].append(results[name])
            if workload == "multi_turn":
                ours, theirs = results["on"].pop("outputs"), results["off"].pop("outputs")
                agree.append(sum(a == b for a, b in zip(ours, theirs, strict=True)) / len(ours))
                first_agree.append(sum(a[0] == b[0] for a, b in zip(ours, theirs, strict=True)) / len(ours))
                continue
            # cached against uncached, for the first (snapshots taken) and the second (resumed) request
            for cached, uncached in (
                ("on", "off"),
                ("plain_on", "plain_off"),
                ("plain_off_chunked", "plain_off"),
            ):
                pairs = zip(results[cached]["logprobs"], results[uncached]["logprobs"], strict=True)
                gaps.append([round(logprob_gap(a, b), 4) for a, b in pairs])
            for result in results.values():
                del result["logprobs"]
    for key, values in runs.items():
        report[key] = {m: round(statistics.median(v[m] for v in values), 3) for m in values[0]}
        report[key + "_reps"] = values
    for name in ("on", "plain_on"):
        report[f"pair_second_over_first_{name}"] = round(
            statistics.median(v["second_ttft_ms"] / v["first_ttft_ms"] for v in runs[f"pair_{name}"]), 3
        )
    # per repetition: on / off, plain_on / plain_off, plain_off_chunked / plain_off; each [first, second]
    report["pair_first_token_logprob_gaps"] = gaps
    report["multi_turn_mean_ttft_off_over_on"] = round(
        statistics.median(
            off_["mean_ttft_ms"] / on_["mean_ttft_ms"]
            for off_, on_ in zip(runs["multi_turn_off"], runs["multi_turn_on"], strict=True)
        ),
        2,
    )
    report["multi_turn_answers_equal_uncached"] = agree
    report["multi_turn_first_tokens_equal_uncached"] = first_agree
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefix_e2e.json").write_text(text)


if __name__ == "__main__":
    main()
