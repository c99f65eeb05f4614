"""Speculation at real acceptance on the GPU: the trained demo model and its shipped drafts on held-out
prompts, every algorithm with the adaptive policy on and off, against plain decoding (issue 48).

    PYTHONPATH=src python3 benchmarks/device/real_acceptance.py [--concurrency 1,16,64] [--out DIR]
    PYTHONPATH=src python3 benchmarks/device/real_acceptance.py --write-prompts PATH

(the default prompt file is benchmarks/data/held_out_prompts.json).

The prompts are the first user turns of held-out ShareGPT conversations (`hylo.train.data.split`: the
demo model and its drafts never trained on them), chat-templated, at most `--max-prompt-tokens` long;
`--write-prompts` makes the file on a machine with the packaged dataset (the GPU machine has none).

Every engine is built first (with its start-up warm-up, as served; `--skip-warmup`: without) and shares
nothing but the process. A concurrency c runs a closed loop: c requests in flight, the next prompt
submitted as one finishes, until `--requests-per-stream` × c prompts (at least `--min-requests`) are
done (greedy, `--max-tokens` new tokens each, stopping at EOS as a user's would). Each (engine, c) runs
once unmeasured (the first run of a shape compiles kernels), then `--reps` times interleaved engine by
engine. Reported per (engine, c): output tokens/s (median), the ratio to plain decoding of the same
repetition (median of the per-repetition ratios), the mean acceptance τ (tokens a verify step commits
per request, bonus included) and, with the policy on, its verify/plain choices and its per-bucket step
costs, each repetition's rate, and the calls whose step could not run ahead (the overlap schedule) by
the ledger's reason. `--profile`: per engine, the kernels of a c = 1 run's steps (torch.profiler):
kernels per step and GPU µs per step by kernel, to `DIR/kernels_<engine>.txt`. Without a GPU the
engines run on the CPU (a dry run of the script: its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter
from pathlib import Path

import torch

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.models.demo import default_model_dir
from hylo.sampling import SamplingParams

ALGORITHMS = {
    "dflash": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash"},
    "dflash2": {"speculative_algorithm": "DFLASH", "speculative_draft_model_path": "dflash2"},
    "mtp3": {"speculative_algorithm": "MTP", "speculative_num_steps": 3},
}
CACHE_BYTES = 2 * 2**30  # each engine's caches: 64 requests of ~400 tokens need far less


def write_prompts(model: Path, path: Path, count: int, max_tokens: int) -> None:
    from hylo.tokenizer import Tokenizer
    from hylo.train import data

    tokenizer = Tokenizer.from_dir(model)
    _, held_out = data.split(data.load_conversations())
    prompts = [data.prompt_ids(tokenizer, c) for c in held_out]
    kept = [p for p in prompts if len(p) <= max_tokens][:count]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(kept, separators=(",", ":")) + "\n")
    print(f"{len(kept)} held-out prompts of <= {max_tokens} tokens -> {path}")


# an engine name's suffix: built with `mixed_steps` on or off (without one: auto)
MIXING = {"+mixed": "on", "+unmixed": "off"}


def engine_names(algorithms: list[str], mixing: bool) -> list[str]:
    names = ["plain"] + [f"{a}-{policy}" for a in algorithms for policy in ("adaptive", "verify")]
    return names + [name + suffix for suffix in MIXING for name in names] if mixing else names


def build(model: Path, name: str, max_batch: int, warmup: bool = True) -> Engine:
    """`name`: plain, or `<algorithm>-adaptive` / `<algorithm>-verify` (the policy off: every decode
    step verifies), a `MIXING` suffix after it for an engine whose steps mix prefill chunks with
    decode rows (`+mixed`) or do not (`+unmixed`). Caches of about `CACHE_BYTES` beside what the
    process already holds. `warmup`: the engine's start-up warm-up (as served): without it eager
    steps of shapes the unmeasured run did not meet compile inside measured runs (RESULTS S26-2)."""
    options: dict = {}
    for suffix, setting in MIXING.items():
        if name.endswith(suffix):
            name, options = name.removesuffix(suffix), {"mixed_steps": setting}
    if name != "plain":
        algorithm, policy = name.rsplit("-", 1)
        options |= ALGORITHMS[algorithm]
        if "speculative_draft_model_path" in options:
            options["speculative_draft_model_path"] = str(model / options["speculative_draft_model_path"])
        options["speculative_adaptive"] = policy == "adaptive"
    if torch.cuda.is_available():
        free, total = torch.cuda.mem_get_info()
        options |= {"device": "cuda", "mem_fraction_static": (total - free + CACHE_BYTES) / total}
        options["cuda_graph_max_bs"] = max_batch
    else:
        options |= {"device": "cpu", "max_memory_gb": CACHE_BYTES / 2**30}
    config = EngineConfig.from_kwargs(
        model=str(model), max_running_requests=max_batch, skip_warmup=not warmup, **options
    )
    return Engine(config)


def closed_loop(eng: Engine, prompts: list[list[int]], concurrency: int, params: SamplingParams) -> dict:
    """Run `prompts` with `concurrency` in flight; tokens, seconds, τ of every verify block, and the
    calls whose step (or the one launched behind it) could not run ahead, by the ledger's reason."""
    queue, in_flight, tokens, taus, refusals = list(prompts), 0, 0, [], Counter()
    started = time.perf_counter()
    while queue or in_flight:
        while queue and in_flight < concurrency:
            eng.add_request(f"r{time.monotonic_ns()}", queue.pop(0), params)
            in_flight += 1
        for out in eng.step():
            tokens += len(out.new_token_ids)
            if out.accepted_drafts is not None:
                taus.append(out.accepted_drafts + 1)
            in_flight -= out.finished
        if eng.last_run_ahead is not None and not eng.last_run_ahead.ok:
            refusals[eng.last_run_ahead.reason] += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return {"tokens": tokens, "seconds": time.perf_counter() - started, "taus": taus, "refusals": refusals}


def policy_report(eng: Engine) -> dict | None:
    policy = eng.policy
    if policy is None:
        return None
    costs = {
        f"B{bucket}-{'verify' if verify else 'plain'}": round(1e3 * policy.cost(bucket, verify), 3)
        for bucket, verify in sorted(policy.times)
    }
    return {"choices": dict(policy.choices), "mean_committed": policy.mean_committed, "step_ms": costs}


def kernel_profile(eng: Engine, prompt: list[int], params: SamplingParams, path: Path) -> dict:
    """The kernels of one c = 1 request's steps: kernels per step, GPU µs per step by kernel."""
    from torch.profiler import ProfilerActivity, profile

    steps = [0]
    original = eng.step

    def counted_step(*args, **kwargs):
        steps[0] += 1
        return original(*args, **kwargs)

    eng.step = counted_step
    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            closed_loop(eng, [prompt], 1, params)
    finally:
        del eng.step
    rows, launches, busy = [], 0, 0.0
    for e in prof.key_averages():
        total = e.device_time_total
        if total <= 0 or e.key.startswith("Memcpy") or e.key.startswith("Memset"):
            continue
        launches += e.count
        busy += total
        rows.append((total / steps[0], e.count / steps[0], e.key[:110]))
    rows.sort(reverse=True)
    lines = [f"{steps[0]} steps; {launches / steps[0]:.0f} kernels and {busy / steps[0]:.0f} GPU µs per step"]
    lines += [f"{us:9.1f} µs {n:7.1f}x  {name}" for us, n, name in rows[:40]]
    path.write_text("\n".join(lines) + "\n")
    return {
        "steps": steps[0],
        "kernels_per_step": round(launches / steps[0], 1),
        "gpu_us_per_step": round(busy / steps[0], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=default_model_dir())
    parser.add_argument(
        "--prompts", type=Path, default=Path(__file__).parents[1] / "data" / "held_out_prompts.json"
    )
    parser.add_argument("--write-prompts", type=Path, default=None, help="write the prompt file and exit")
    parser.add_argument("--count", type=int, default=256, help="prompts --write-prompts keeps")
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--algorithms", default=",".join(ALGORITHMS))
    parser.add_argument("--concurrency", default="1,16,64")
    parser.add_argument("--requests-per-stream", type=int, default=2, help="prompts per in-flight stream")
    parser.add_argument("--min-requests", type=int, default=16, help="prompts per run at least")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument(
        "--mixing", action="store_true", help="also every engine with --mixed-steps on and with it off"
    )
    parser.add_argument("--skip-warmup", action="store_true", help="engines without the start-up warm-up")
    parser.add_argument("--profile", action="store_true", help="kernel tables of a c = 1 run per engine")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.write_prompts:
        write_prompts(args.model, args.write_prompts, args.count, args.max_prompt_tokens)
        return
    prompts = json.loads(args.prompts.read_text())
    concurrencies = [int(c) for c in args.concurrency.split(",")]
    names = engine_names(args.algorithms.split(","), args.mixing)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    engines = {name: build(args.model, name, max(concurrencies), not args.skip_warmup) for name in names}
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU dry run)"
    report: dict = {"gpu": gpu, "prompts": len(prompts), "runs": {}}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
    for c in concurrencies:
        count = max(args.requests_per_stream * c, args.min_requests)
        batch = [prompts[i % len(prompts)] for i in range(count)]
        for eng in engines.values():
            closed_loop(eng, batch, c, params)  # compiles what this shape needs
        runs: dict[str, list[dict]] = {name: [] for name in engines}
        for _ in range(args.reps):  # interleaved: every repetition runs each engine
            for name, eng in engines.items():
                runs[name].append(closed_loop(eng, batch, c, params))
        for name, results in runs.items():
            rates = [r["tokens"] / r["seconds"] for r in results]
            plain = [r["tokens"] / r["seconds"] for r in runs["plain"]]
            taus = [t for r in results for t in r["taus"]]
            refusals = sum((r["refusals"] for r in results), Counter())
            row = {
                "tokens_per_s": round(statistics.median(rates), 1),
                "over_plain": round(statistics.median(a / b for a, b in zip(rates, plain, strict=True)), 3),
                "rates": [round(r) for r in rates],
                "not_ahead": dict(refusals.most_common(4)),
                "mean_tau": round(statistics.fmean(taus), 3) if taus else None,
                "tau_histogram": dict(sorted(Counter(taus).items())),
            }
            report["runs"][f"{name}@c{c}"] = row
            print(f"c={c:3d} {name:18s} {json.dumps(row)}", flush=True)
        if args.profile and args.out and c == concurrencies[0] and torch.cuda.is_available():  # warm now
            report["profiles"] = {
                name: kernel_profile(eng, prompts[0], params, args.out / f"kernels_{name}.txt")
                for name, eng in engines.items()
                if "-adaptive" not in name
            }
            print(json.dumps(report["profiles"]), flush=True)
        # the policies' choices and costs so far (cumulative over the concurrencies run)
        report["policies"] = {n: policy_report(eng) for n, eng in engines.items() if eng.policy is not None}
        print(f"policies after c={c}: {json.dumps(report['policies'])}", flush=True)
    if args.out:
        (args.out / "real_acceptance.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
