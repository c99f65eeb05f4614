"""End-to-end decode of a real-size GLM-5.3-Flash slice on the GPU: the engine with random weights
(`load_format="dummy"`, FP8 routed experts), every Triton path live (KDA, sparse MLA, indexer, mHC, MoE).

    PYTHONPATH=src python3 benchmarks/device/decode_e2e.py [--layers 8] [--out DIR]

Per batch size: the engine's decode tokens/s (eager steps, from the requests' first-token and finish
times, after the same batch ran once to compile everything), and one decode forward of the model timed
on its own, eagerly and as a CUDA-graph replay, with the small-M GEMM table and with every projection
on cuBLAS (the table only applies while a graph is captured), with the number of Triton GEMMs a
captured forward launches.
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile
from pathlib import Path

import torch
from triton.testing import do_bench, do_bench_cudagraph

import hylo.ops.gemm as gemm_dispatch
from hylo import LLM, SamplingParams
from hylo.ops.gemm import kernels as gemm_kernels


def write_config(path: Path, layers: int) -> None:
    text = {"model_type": "glm5_next_text", "num_hidden_layers": layers}
    raw = {"model_type": "glm5_next", "text_config": text, "quantization_config": {"quant_method": "fp8"}}
    (path / "config.json").write_text(json.dumps(raw))


class ForwardProbe:
    """Stands in for the runner's model: the first forward of exactly `tokens` new tokens (a decode batch)
    is also timed, table on and off, before it runs for real. Other attributes pass through."""

    def __init__(self, model, modes: dict, report: dict, calls: dict):
        self.model, self.modes, self.report, self.calls, self.tokens = model, modes, report, calls, None

    def __getattr__(self, name):
        return getattr(self.model, name)

    def __call__(self, batch, capture=()):
        if self.tokens is not None and batch.input_ids.shape[0] == self.tokens:
            tag, self.tokens = f"B{self.tokens}", None
            for mode, lookup in self.modes.items():
                gemm_dispatch.lookup = lookup
                try:
                    run = lambda: self.model(batch, capture)  # noqa: E731
                    self.report[f"{tag}_{mode}_forward_eager_us"] = round(do_bench(run, rep=200) * 1e3, 1)
                    before = self.calls["gemm"]
                    with torch.cuda.graph(torch.cuda.CUDAGraph()):
                        run()
                    self.report[f"{tag}_{mode}_triton_gemms_per_graph"] = self.calls["gemm"] - before
                    graph_us = do_bench_cudagraph(run, rep=200, return_mode="median") * 1e3
                    self.report[f"{tag}_{mode}_forward_graph_us"] = round(graph_us, 1)
                except Exception as e:  # the figures of the other modes still count
                    self.report[f"{tag}_{mode}_forward_error"] = repr(e)[:300]
            gemm_dispatch.lookup = self.modes["table"]
            graph = [self.report.get(f"{tag}_{m}_forward_graph_us") for m in ("table", "cublas")]
            if all(graph):
                self.report[f"{tag}_forward_graph_table_speedup"] = round(graph[1] / graph[0], 3)
        return self.model(batch, capture)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    model = Path(tempfile.mkdtemp())
    write_config(model, args.layers)
    calls = {"gemm": 0}
    triton_gemm = gemm_kernels.gemm

    def counted(*a, **kw):
        calls["gemm"] += 1
        return triton_gemm(*a, **kw)

    gemm_kernels.gemm = counted
    table_lookup = gemm_dispatch.lookup
    report: dict = {"layers": args.layers, "gpu": torch.cuda.get_device_name()}
    llm = LLM(
        str(model), load_format="dummy", device="cuda", dtype="bfloat16", context_length=4096,
        max_running_requests=64, mem_fraction_static=0.8,
    )  # fmt: skip
    modes = {"table": table_lookup, "cublas": lambda *a: None}
    probe = ForwardProbe(llm.engine.runner.model, modes, report, calls)
    llm.engine.runner.model = probe
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True)
    for bsz in map(int, args.batches.split(",")):
        prompts = [torch.randint(0, 150000, (64,), generator=gen).tolist() for _ in range(bsz)]
        probe.tokens = bsz
        llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)  # warm-up and probe
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        decode_s = max(o.metrics.finish_time for o in outs) - max(o.metrics.first_token_time for o in outs)
        report[f"B{bsz}_engine_decode_tok_s"] = round(bsz * (args.tokens - 1) / decode_s, 1)
        print(json.dumps({k: v for k, v in report.items() if k.startswith(f"B{bsz}_")}), flush=True)
    gemm_dispatch.lookup = table_lookup
    del llm
    gc.collect()
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_e2e.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
