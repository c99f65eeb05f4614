"""Where a closed loop's wall time goes, by step kind: the demo model's engines of
`real_acceptance.py` at one concurrency, each step classified by its route and its chunks.

    PYTHONPATH=src python3 benchmarks/device/step_mix.py [--engines plain,dflash-verify] [--concurrency 64]

A step is one `Engine.step` call; its kind is the paths it launched (`Path`: eager, decode graph,
verify graph, prefill graph) and whether it carried prompt tokens (`+prefill`) or rows that decode or
verify (`+decode`). Per engine and kind: steps, wall ms in total, per step, median and most, prompt
tokens and decode rows per step. The second of two identical runs is reported (the first compiles). On
the CPU the figures mean nothing (a dry run).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import real_acceptance as ra

from hylo.sampling import SamplingParams


def classify(eng, prompts, concurrency, params) -> dict:
    """One closed loop with every step timed and classified."""
    kinds: dict[str, list] = defaultdict(lambda: [0, 0.0, 0, 0, []])
    launched: list = []
    launch, step = eng.runner.launch, eng.step

    def recording_launch(chunks, route):
        decodes = [ch.verify or (ch.num_tokens == 1 and bool(ch.request.output_ids)) for ch in chunks]
        prompt_tokens = sum(ch.num_tokens for ch, d in zip(chunks, decodes, strict=True) if not d)
        launched.append((route.path.value, prompt_tokens, sum(decodes)))
        return launch(chunks, route)

    def timed_step(*args, **kwargs):
        launched.clear()
        start = time.perf_counter()
        out = step(*args, **kwargs)
        seconds = time.perf_counter() - start
        paths = "|".join(sorted({p for p, _, _ in launched})) or "read only"
        prompt_tokens = sum(t for _, t, _ in launched)
        rows = sum(r for _, _, r in launched)
        kind = paths + ("+prefill" if prompt_tokens else "") + ("+decode" if rows else "")
        entry = kinds[kind]
        entry[0] += 1
        entry[1] += seconds
        entry[2] += prompt_tokens
        entry[3] += rows
        entry[4].append(seconds)
        return out

    eng.runner.launch, eng.step = recording_launch, timed_step
    try:
        result = ra.closed_loop(eng, prompts, concurrency, params)
    finally:
        del eng.runner.launch, eng.step
    table = {
        kind: {"steps": n, "ms": round(1e3 * s, 1), "ms_per_step": round(1e3 * s / n, 3),
               "median_ms": round(1e3 * statistics.median(each), 3), "max_ms": round(1e3 * max(each), 3),
               "prompt_tokens_per_step": round(t / n, 1), "rows_per_step": round(r / n, 1)}
        for kind, (n, s, t, r, each) in sorted(kinds.items(), key=lambda kv: -kv[1][1])
    }  # fmt: skip
    return {"tok_s": round(result["tokens"] / result["seconds"], 1), "seconds": round(result["seconds"], 3),
            "kinds": table}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--engines", default="plain,dflash-verify,mtp3-verify,plain+unmixed,dflash-verify+mixed"
    )
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    prompts = json.loads((Path(__file__).parents[1] / "data" / "held_out_prompts.json").read_text())
    batch = [prompts[i % len(prompts)] for i in range(max(2 * args.concurrency, 16))]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    report = {}
    for name in args.engines.split(","):
        eng = ra.build(ra.default_model_dir(), name, args.concurrency)
        ra.closed_loop(eng, batch, args.concurrency, params)  # compiles
        report[name] = classify(eng, batch, args.concurrency, params)
        print(name, json.dumps(report[name], indent=1), flush=True)
        eng.close()
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "step_mix.json").write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
