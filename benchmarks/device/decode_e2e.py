"""End-to-end decode of a real-size GLM-5.3-Flash slice on the GPU, CUDA graphs on and off: the engine with
random weights (`load_format="dummy"`, FP8 routed experts), every Triton path live (KDA, sparse MLA,
indexer, mHC, MoE).

    PYTHONPATH=src python3 benchmarks/device/decode_e2e.py [--layers 8] [--out DIR]

One engine, its decode graphs captured at start for the buckets up to `--max-running`; "eager" is the same
engine with `runner.graphs` switched off. Reports:
- the Triton GEMMs each captured graph launches (the small-M GEMM table applies only under capture);
- for `--check-batches`, greedy tokens with graphs vs eager: equal or not, the first differing step and,
  there, the eager run's top-1 - top-2 logprob margin (a near-tie flips on rounding), the largest
  chosen-token logprob difference before it; the same for graphs captured with every projection on
  cuBLAS (no table), which separates the table's rounding from the padding's;
- for `--batches`, engine decode tokens/s with graphs vs eager (from the requests' first-token and finish
  times, after a warm-up run of each).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

import hylo.ops.gemm as gemm_dispatch
from hylo import LLM, SamplingParams
from hylo.engine.cuda_graph import DecodeGraphs
from hylo.engine.graph_bank import GraphBank
from hylo.ops.gemm import kernels as gemm_kernels


def write_config(path: Path, layers: int) -> None:
    text = {"model_type": "glm5_next_text", "num_hidden_layers": layers}
    raw = {"model_type": "glm5_next", "text_config": text, "quantization_config": {"quant_method": "fp8"}}
    (path / "config.json").write_text(json.dumps(raw))


def count_gemms_per_capture(report: dict, label: dict) -> None:
    """Every later capture of a decode bucket records the Triton GEMM launches it captured, by batch
    size, under the report key `label["key"]`."""
    calls = {"gemm": 0}
    triton_gemm, capture = gemm_kernels.gemm, GraphBank._capture

    def counted_gemm(*a, **kw):
        calls["gemm"] += 1
        return triton_gemm(*a, **kw)

    def counted_capture(self, bucket, *a, **kw):
        before = calls["gemm"]
        capture(self, bucket, *a, **kw)
        if self.shape.kind == "decode":  # (prefill buckets count tokens)
            report.setdefault(label["key"], {})[bucket] = calls["gemm"] - before

    gemm_kernels.gemm = counted_gemm
    GraphBank._capture = counted_capture


def compare(graph_outs, eager_outs) -> dict:
    """Greedy tokens of two runs of the same prompts, with top-2 logprobs per token."""
    equal, diverged, margins, drift = 0, [], [], 0.0
    for g, e in zip(graph_outs, eager_outs, strict=True):
        step = next(
            (i for i, (a, b) in enumerate(zip(g.token_ids, e.token_ids, strict=True)) if a != b), None
        )
        common = len(g.token_ids) if step is None else step
        for i in range(common):
            drift = max(drift, abs(g.logprobs[i][g.token_ids[i]] - e.logprobs[i][e.token_ids[i]]))
        if step is None:
            equal += 1
            continue
        top = sorted(e.logprobs[step].values(), reverse=True)
        diverged.append(step)
        margins.append(round(top[0] - top[1], 5) if len(top) > 1 else None)
    return {
        "sequences_equal": f"{equal}/{len(graph_outs)}",
        "first_differing_steps": diverged,
        "eager_margin_there": margins,
        "max_chosen_logprob_diff_before": round(drift, 5),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--check-batches", default="1,3,8")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--max-running", type=int, default=64)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp())
    write_config(model, args.layers)
    report: dict = {"layers": args.layers, "gpu": torch.cuda.get_device_name()}
    label = {"key": "triton_gemms_per_graph"}
    count_gemms_per_capture(report, label)
    start = time.perf_counter()
    llm = LLM(
        str(model), load_format="dummy", device="cuda", dtype="bfloat16", context_length=4096,
        max_running_requests=args.max_running, cuda_graph_max_bs=args.max_running, mem_fraction_static=0.8,
        skip_warmup=True,
    )  # fmt: skip
    report["engine_start_s"] = round(time.perf_counter() - start, 1)
    runner = llm.engine.runner
    table_graphs = runner.graphs
    assert table_graphs is not None, "the engine captured no decode graphs"
    report["buckets"] = table_graphs.buckets
    graph_steps = {"n": 0}
    replay = DecodeGraphs.run

    def counted_run(self, seqs, *variant):
        graph_steps["n"] += 1
        return replay(self, seqs, *variant)

    DecodeGraphs.run = counted_run
    gen = torch.Generator().manual_seed(0)

    def generate(prompts, graphs, logprobs=None):
        runner.graphs = graphs
        params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=logprobs)
        return llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)

    table_lookup = gemm_dispatch.lookup
    gemm_dispatch.lookup, label["key"] = (lambda *a: None), "triton_gemms_per_cublas_graph"
    checks = [int(b) for b in args.check_batches.split(",")]
    cublas_graphs = DecodeGraphs(llm.engine.model, llm.engine.caches, max(checks), capture=True)
    gemm_dispatch.lookup = table_lookup
    for bsz in checks:
        prompts = [torch.randint(0, 150000, (64,), generator=gen).tolist() for _ in range(bsz)]
        eager = generate(prompts, None, logprobs=2)
        before = graph_steps["n"]
        report[f"B{bsz}_check_table_graphs"] = compare(generate(prompts, table_graphs, 2), eager)
        report[f"B{bsz}_check_cublas_graphs"] = compare(generate(prompts, cublas_graphs, 2), eager)
        report[f"B{bsz}_check_graph_steps"] = graph_steps["n"] - before
        print(json.dumps({k: v for k, v in report.items() if k.startswith(f"B{bsz}_check")}), flush=True)
    del cublas_graphs

    for bsz in map(int, args.batches.split(",")):
        prompts = [torch.randint(0, 150000, (64,), generator=gen).tolist() for _ in range(bsz)]
        for mode, graphs in (("graphs", table_graphs), ("eager", None)):
            generate(prompts, graphs)  # warm-up: compiles this batch's eager and prefill kernels
            outs = generate(prompts, graphs)
            decode_s = max(o.metrics.finish_time for o in outs) - max(
                o.metrics.first_token_time for o in outs
            )
            report[f"B{bsz}_{mode}_decode_tok_s"] = round(bsz * (args.tokens - 1) / decode_s, 1)
        graphs_tok_s, eager_tok_s = (
            report[f"B{bsz}_graphs_decode_tok_s"],
            report[f"B{bsz}_eager_decode_tok_s"],
        )
        report[f"B{bsz}_graph_speedup"] = round(graphs_tok_s / eager_tok_s, 2)
        print(json.dumps({k: v for k, v in report.items() if k.startswith(f"B{bsz}_") and "check" not in k}))
    runner.graphs = table_graphs
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_e2e.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
