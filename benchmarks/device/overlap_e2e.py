"""The overlap schedule end to end on the real-size GLM-5.3-Flash slice: one target (a random FP8
checkpoint, `load_format="dummy"`, FP8 projections and routed experts) served by two engines, one
with the overlap schedule and one that reads every step first (`disable_overlap_schedule`); runs
interleaved in one process.

    PYTHONPATH=src python3 benchmarks/device/overlap_e2e.py [--layers 8] [--reps 5] [--out DIR]

Reports per engine: decode tokens/s per user at concurrency 1 and 8, the engine's wall ms per step
and synchronising calls per step (sync debug mode), the decode graph's replay alone at batch 1 and 8,
and the engine step over the replay; whether both engines gave the same greedy tokens. Medians over
the repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from prefix_e2e import VOCAB
from spec_e2e import decode_rate, replay_ms, write_target

from hylo import LLM, SamplingParams

USERS = (1, 8)
TOKENS = 129


def workloads(llm: LLM, gen: torch.Generator) -> tuple[dict, dict]:
    """(figures, greedy tokens by concurrency)."""
    out, tokens = {}, {}
    for users in USERS:
        prompts = [torch.randint(0, VOCAB, (64,), generator=gen).tolist() for _ in range(users)]
        rate, step_ms, syncs = decode_rate(llm, prompts, TOKENS)
        out[f"c{users}_tok_s"], out[f"c{users}_step_ms"], out[f"c{users}_syncs"] = rate, step_ms, syncs
        params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        tokens[users] = [o.token_ids for o in outs]
    for users in USERS:
        out[f"replay_b{users}_ms"] = replay_ms(llm.engine.runner.graphs, users)
        out[f"c{users}_step_over_replay"] = out[f"c{users}_step_ms"] / out[f"replay_b{users}_ms"]
    return out, tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp())
    write_target(path, args.layers)
    common = dict(
        skip_warmup=True,  # the script warms what it measures; see cold_start.py for the start-up warm-up
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=4096, max_running_requests=8,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    overlap = LLM(str(path), mem_fraction_static=0.5, **common)
    reading = LLM(
        str(path), disable_overlap_schedule=True, mem_fraction_static=0.85, target=overlap.engine.model,
        **common,
    )  # fmt: skip
    llms = {"overlap": overlap, "reading": reading}
    assert overlap.engine.overlap and not reading.engine.overlap
    report: dict = {"gpu": torch.cuda.get_device_name(), "layers": args.layers, "tokens": TOKENS}
    warm = torch.Generator().manual_seed(99)
    for llm in llms.values():  # warm-up: every kernel once
        workloads(llm, warm)
    runs: dict = {name: [] for name in llms}
    same = []
    for rep in range(args.reps):
        tokens = {}
        for name, llm in llms.items():  # the same prompts for both engines
            figures, tokens[name] = workloads(llm, torch.Generator().manual_seed(1000 + rep))
            runs[name].append(figures)
        same.append(tokens["overlap"] == tokens["reading"])
    report["same_greedy_tokens"] = same
    for name, values in runs.items():
        report[name] = {m: round(statistics.median(v[m] for v in values), 3) for m in values[0]}
        report[name + "_reps"] = values
    pairs = list(zip(runs["overlap"], runs["reading"], strict=True))
    report["overlap_over_reading"] = {
        m: round(statistics.median(a[m] / b[m] for a, b in pairs), 3)
        for m in runs["overlap"][0]
        if "syncs" not in m
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "overlap_e2e.json").write_text(text)


if __name__ == "__main__":
    main()
