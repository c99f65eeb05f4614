"""Plain decode tokens/s of a real-size GLM-5.3-Flash slice (dummy weights, FP8 routed experts, decode
graphs) in one process: run once per source tree by `tp1_overhead.sh`, which interleaves the tree
before tensor parallelism and the current one, to show what TP=1 costs on the code that now carries
the distributed path (issue 18).

    PYTHONPATH=<tree>/src python3 benchmarks/device/tp1_overhead.py --label L [--layers 4] [--out DIR]

Prints one JSON line: engine start seconds and, per batch, decode tokens/s (tokens after the first over
the time from first token to finish, medians of `--reps` runs after a warm-up) and the median time of
one replay of that batch's decode graph (the device work alone).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from hylo import LLM, SamplingParams
from hylo.engine.cuda_graph import OBSERVE


def replay_ms(graph: torch.cuda.CUDAGraph, replays: int = 200) -> float:
    """Median milliseconds of one replay of a captured decode graph (the step's device work alone)."""
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--label", required=True)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        text = {"model_type": "glm5_next_text", "num_hidden_layers": args.layers}
        raw = {"model_type": "glm5_next", "text_config": text, "quantization_config": {"quant_method": "fp8"}}
        (Path(tmp) / "config.json").write_text(json.dumps(raw))
        start = time.perf_counter()
        llm = LLM(
            tmp, load_format="dummy", device="cuda", dtype="bfloat16", context_length=2048,
            max_running_requests=8, cuda_graph_max_bs=8, mem_fraction_static=0.8, skip_warmup=True,
        )  # fmt: skip
        report = {
            "label": args.label,
            "layers": args.layers,
            "engine_start_s": round(time.perf_counter() - start, 1),
        }
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for batch in map(int, args.batches.split(",")):
        prompts = [torch.randint(0, 150000, (32,), generator=gen).tolist() for _ in range(batch)]
        rates = []
        for rep in range(args.reps + 1):
            outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
            first = max(o.metrics.first_token_time for o in outs)
            finish = max(o.metrics.finish_time for o in outs)
            if rep:  # the first run warms up
                rates.append(batch * (args.tokens - 1) / (finish - first))
        report[f"B{batch}_tok_s"] = round(statistics.median(rates), 1)
        graph = llm.engine.runner.graphs.bank.graphs[OBSERVE, batch].graph
        report[f"B{batch}_replay_ms"] = round(replay_ms(graph), 4)
    print(json.dumps(report), flush=True)


if __name__ == "__main__":
    main()
