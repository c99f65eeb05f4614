"""Acceptance of the shipped demo drafts on held-out ShareGPT prompts, and their CPU speed-up.

For each speculative configuration: the mean acceptance length τ (tokens a verify step commits, the
bonus token included, so 1..block) and its histogram over every verify step of every prompt, greedy
and at temperature 0.7, with the adaptive policy off (every step verifies). Then the wall-clock
tokens/s at concurrency 1 on a subset, each configuration against plain decoding of the same prompts,
runs interleaved and repeated.

    .venv/bin/python benchmarks/demo_acceptance.py --prompts 200 --out /tmp/acceptance.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.demo import default_model_dir
from hylo.sampling import SamplingParams
from hylo.tokenizer import Tokenizer
from hylo.train import data

CONFIGS = {
    "plain": {},
    "dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash"},
    "dflash2": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash2"},
    "mtp1": {"speculative_algorithm": "MTP", "speculative_num_steps": 1},
    "mtp3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3},
}


def held_out_prompts(model: Path, count: int, max_tokens: int) -> list[list[int]]:
    """The first user turn of the first `count` held-out conversations that fit `max_tokens`."""
    tokenizer = Tokenizer.from_dir(model)
    _, held_out = data.split(data.load_conversations())
    prompts = [data.prompt_ids(tokenizer, c) for c in held_out]
    return [p for p in prompts if len(p) <= max_tokens][:count]


def engine(model: Path, name: str) -> Engine:
    options = dict(CONFIGS[name])
    if "speculative_draft_model_path" in options:
        options["speculative_draft_model_path"] = str(model / options["speculative_draft_model_path"])
    if options:
        options["speculative_adaptive"] = False
    return Engine(EngineConfig.from_kwargs(model=str(model), device="cpu", dtype="float32", **options))


def run(eng: Engine, prompts: list[list[int]], params: SamplingParams) -> tuple[list[int], int, float]:
    """(τ of every verify step, tokens generated, seconds) for `prompts` submitted together."""
    for i, ids in enumerate(prompts):
        eng.add_request(f"p{i}-{time.monotonic_ns()}", ids, params)
    taus, tokens, started = [], 0, time.perf_counter()
    while eng.has_unfinished():
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.accepted_drafts is not None:
                taus.append(out.accepted_drafts + 1)
    return taus, tokens, time.perf_counter() - started


def acceptance(model: Path, prompts: list[list[int]], max_tokens: int) -> dict:
    results = {}
    for name in CONFIGS:
        if name == "plain":
            continue
        eng = engine(model, name)
        for temperature in (0.0, 0.7):
            params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=0)
            taus, tokens, _ = run(eng, prompts, params)
            key = f"{name}@T{temperature}"
            results[key] = {
                "mean_tau": statistics.fmean(taus),
                "verify_steps": len(taus),
                "tokens": tokens,
                "histogram": dict(sorted(Counter(taus).items())),
            }
            print(key, json.dumps(results[key]), flush=True)
    return results


def speed(model: Path, prompts: list[list[int]], max_tokens: int, reps: int) -> dict:
    """tokens/s at concurrency 1, each configuration over plain, per repetition; medians."""
    engines = {name: engine(model, name) for name in CONFIGS}
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    rates: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(reps):
        for name, eng in engines.items():  # interleaved: every repetition runs each configuration
            tokens, seconds = 0, 0.0
            for ids in prompts:
                _, n, s = run(eng, [ids], params)
                tokens, seconds = tokens + n, seconds + s
            rates[name].append(tokens / seconds)
    ratios = {
        name: statistics.median(r / p for r, p in zip(rates[name], rates["plain"], strict=True))
        for name in CONFIGS
        if name != "plain"
    }
    return {"tokens_per_s": {k: statistics.median(v) for k, v in rates.items()}, "speedup_over_plain": ratios}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument("--prompts", type=int, default=200)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--speed-prompts", type=int, default=10)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = held_out_prompts(args.model, args.prompts, args.max_prompt_tokens)
    report = {"prompts": len(prompts), "max_tokens": args.max_tokens}
    report["acceptance"] = acceptance(args.model, prompts, args.max_tokens)
    report["speed"] = speed(args.model, prompts[: args.speed_prompts], args.max_tokens, args.reps)
    print(json.dumps(report["speed"]))
    if args.out:
        args.out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
