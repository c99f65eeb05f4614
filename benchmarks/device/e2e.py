"""Issue 22's figures side by side in one process on the real-size GLM-5.3-Flash slice: hylo (a random FP8
checkpoint, `load_format="dummy"`: FP8 projections and routed experts, decode graphs, the overlap schedule)
and HF transformers (bf16, the same text config without its FP8 quantisation, random init; with `fla-core`
importable, HF's KDA layers run FLA's Triton kernels), runs interleaved.

    PYTHONPATH=src python3 benchmarks/device/e2e.py [--layers 8] [--reps 3] [--tokens 33] [--out DIR]

Needs `transformers==5.23.0` (glm5_next) and, for the fair baseline, `fla-core==0.6.0` (both travel as
wheels). Reports hylo's start-up memory report (weights, load peak); decode tokens/s per user at
concurrency 1 and 8 with the engine's ms per step over its graph replay; the batch-1 replay over its
weight-read floor (bytes at the copy rate measured here); TTFT of a fresh 1024- and 13312-token prompt;
HF's greedy decode tokens/s at batch 1 over a 64-token prompt (`generate` of 1 + N tokens minus that of 1,
so that its prefill is not counted) and whether FLA was importable; hylo's c = 1 tokens/s over HF's.
Medians over the repetitions, ratios per repetition.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from prefix_e2e import VOCAB, serve, ttft
from spec_e2e import copy_bandwidth, decode_rate, replay_ms, step_floor, write_target

from hylo import LLM

PROMPT_LEN = 64
CACHE_BYTES = 8 * 2**30  # hylo's caches: room for the HF model beside it


def hf_model(path: Path, layers: int):
    """HF's glm5_next of the slice's config in bf16 on the GPU (random weights), and whether FLA's
    kernels were importable for its KDA layers."""
    import transformers

    try:
        import fla  # noqa: F401

        with_fla = True
    except ImportError:
        with_fla = False
    raw = json.loads((path / "config.json").read_text())
    raw.pop("quantization_config", None)
    hf_dir = path.parent / "hf"
    hf_dir.mkdir(exist_ok=True)
    (hf_dir / "config.json").write_text(json.dumps(raw))
    config = transformers.AutoConfig.from_pretrained(hf_dir)
    config.dtype = torch.bfloat16
    with torch.device("cuda"):  # (its vision tower is built too, and idle)
        model = transformers.Glm5NextForConditionalGeneration._from_config(config, dtype=torch.bfloat16)
    return model.eval(), with_fla


@torch.inference_mode()
def hf_decode_rate(model, prompt: list[int], tokens: int) -> float:
    """Greedy decode tokens/s at batch 1: `generate` of 1 + `tokens` tokens minus `generate` of 1."""
    ids = torch.tensor([prompt], device="cuda")

    def generated(n: int) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - start

    return tokens / (generated(1 + tokens) - generated(1))


def hylo_figures(llm: LLM, gen: torch.Generator, tokens: int) -> dict:
    out = {}
    for users in (1, 8):
        prompts = [torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist() for _ in range(users)]
        rate, step_ms, _ = decode_rate(llm, prompts, tokens)
        replay = replay_ms(llm.engine.runner.graphs, users)
        out |= {
            f"c{users}_tok_s": rate,
            f"c{users}_step_ms": step_ms,
            f"c{users}_step_over_replay": step_ms / replay,
        }
        out[f"replay_b{users}_ms"] = replay
    for n in (1024, 13312):
        (request,), _ = serve(llm.engine, [torch.randint(0, VOCAB, (n,), generator=gen).tolist()], 1)
        out[f"ttft_{n}_ms"] = ttft(request) * 1e3
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=33, help="decoded tokens per timed run")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    path = Path(tempfile.mkdtemp()) / "target"
    path.mkdir()
    write_target(path, args.layers)
    free, total = torch.cuda.mem_get_info()
    fp8_weight_bytes = 41e9 * args.layers / 8  # the slice's FP8 weights (S15-3), for the cache budget
    llm = LLM(
        str(path), load_format="dummy", device="cuda", dtype="bfloat16", context_length=16384,
        max_running_requests=8, cuda_graph_max_bs=8, skip_warmup=True,
        mem_fraction_static=(total - free + fp8_weight_bytes + CACHE_BYTES) / total,
    )  # fmt: skip
    model, with_fla = hf_model(path, args.layers)
    bandwidth = copy_bandwidth()
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "layers": args.layers,
        "hf_with_fla": with_fla,
        "hylo_memory": llm.engine.memory_report,
        "floor_b1": step_floor(llm.engine.runner.graphs, 1, bandwidth),
    }
    gen = torch.Generator().manual_seed(7)
    hylo_figures(llm, gen, args.tokens)  # warm-up: every kernel once
    prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
    hf_decode_rate(model, prompt, 2)
    runs = []
    for rep in range(args.reps):
        gen = torch.Generator().manual_seed(100 + rep)
        figures = hylo_figures(llm, gen, args.tokens)
        figures["hf_tok_s"] = hf_decode_rate(model, prompt, args.tokens)
        figures["hylo_c1_over_hf"] = figures["c1_tok_s"] / figures["hf_tok_s"]
        runs.append(figures)
    report["median"] = {m: round(statistics.median(r[m] for r in runs), 3) for m in runs[0]}
    report["replay_b1_over_floor"] = round(
        report["floor_b1"]["floor_ms"] / report["median"]["replay_b1_ms"], 3
    )
    report["reps"] = runs
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "e2e.json").write_text(text)


if __name__ == "__main__":
    main()
