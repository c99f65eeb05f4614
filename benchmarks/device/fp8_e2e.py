"""FP8 projections end to end on the real-size GLM-5.3-Flash slice: the same FP8 checkpoint (random,
`load_format="dummy"`, FP8 routed experts in both) served with its projections kept e4m3
(`fp8_projections="auto"`) and dequantised to bf16 at load (`"dequantize"`, as before); two engines
in one process, runs interleaved.

    PYTHONPATH=src python3 benchmarks/device/fp8_e2e.py [--layers 8] [--reps 5] [--out DIR]

Reports per engine: resident weight bytes (and the whole-bf16 slice's, counted on the meta device);
decode tokens/s per user at concurrency 1 and 8 with the engine's wall ms per step; the decode graph's
replay alone at batch 1 and 8 and the weight-read floor of the batch-1 step (bytes it reads at the
copy rate measured here: FP8 weights at one byte); TTFT of one fresh prompt of 1024, 8192 and 13312
tokens (one greedy token; the 1024 one is a prefill-graph replay). Medians over the repetitions.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import torch
from prefix_e2e import VOCAB, serve, ttft
from spec_e2e import copy_bandwidth, decode_rate, replay_ms, step_floor, write_target

from hylo import LLM
from hylo.config import ModelConfig
from hylo.models.loader import build_model

PROMPTS = (1024, 8192, 13312)


def bf16_slice_bytes(path: Path) -> int:
    """The weights of the slice loaded entirely in bf16 (no FP8 tensor), counted on the meta device."""
    model = build_model(ModelConfig.from_dir(path), "meta", torch.bfloat16)
    unique = {id(t): t for t in [*model.parameters(), *model.buffers()]}.values()
    return sum(t.numel() * t.element_size() for t in unique)


def workloads(llm: LLM, gen: torch.Generator) -> dict:
    out = {}
    for n in PROMPTS:
        (r,), _ = serve(llm.engine, [torch.randint(0, VOCAB, (n,), generator=gen).tolist()], 1)
        out[f"ttft_{n}_ms"] = ttft(r) * 1e3
    for users in (1, 8):
        prompts = [torch.randint(0, VOCAB, (64,), generator=gen).tolist() for _ in range(users)]
        rate, step_ms, _ = decode_rate(llm, prompts, 65)
        out[f"c{users}_tok_s"], out[f"c{users}_step_ms"] = rate, step_ms
    graphs = llm.engine.runner.graphs
    for bucket in (1, 8):
        out[f"replay_b{bucket}_ms"] = replay_ms(graphs, bucket)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    target = Path(tempfile.mkdtemp())
    write_target(target, args.layers)
    common = dict(
        skip_warmup=True,  # the script warms what it measures; see cold_start.py for the start-up warm-up
        load_format="dummy", device="cuda", dtype="bfloat16", context_length=16384, max_running_requests=8,
        cuda_graph_max_bs=8,
    )  # fmt: skip
    llms = {
        "fp8": LLM(str(target), fp8_projections="auto", mem_fraction_static=0.43, **common),
        "bf16": LLM(str(target), fp8_projections="dequantize", mem_fraction_static=0.88, **common),
    }
    bandwidth = copy_bandwidth()
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "layers": args.layers,
        "copy_bytes_per_s": bandwidth,
        "bf16_slice_weight_bytes": bf16_slice_bytes(target),
        "memory": {name: llm.engine.memory_report for name, llm in llms.items()},
    }
    report["fp8_weights_over_bf16_slice"] = round(
        report["memory"]["fp8"]["weights_bytes"] / report["bf16_slice_weight_bytes"], 3
    )
    warm = torch.Generator().manual_seed(99)
    for llm in llms.values():  # warm-up: every kernel once
        workloads(llm, warm)
    runs: dict = {name: [] for name in llms}
    for rep in range(args.reps):
        for name, llm in llms.items():  # the same prompts for both engines
            runs[name].append(workloads(llm, torch.Generator().manual_seed(1000 + rep)))
    for name, values in runs.items():
        report[name] = {m: round(statistics.median(v[m] for v in values), 3) for m in values[0]}
        report[name + "_reps"] = values
        report[name]["floor_b1"] = step_floor(llms[name].engine.runner.graphs, 1, bandwidth)
        report[name]["replay_b1_over_floor"] = round(
            report[name]["floor_b1"]["floor_ms"] / report[name]["replay_b1_ms"], 3
        )
    report["bf16_over_fp8"] = {
        m: round(statistics.median(b[m] / a[m] for a, b in zip(runs["fp8"], runs["bf16"], strict=True)), 3)
        for m in runs["fp8"][0]
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "fp8_e2e.json").write_text(text)


if __name__ == "__main__":
    main()
