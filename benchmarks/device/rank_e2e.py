"""One rank of the full 45-layer GLM-5.3-Flash at TP4 or TP8, measured alone on one GPU.

    PYTHONPATH=src python3 benchmarks/device/rank_e2e.py --tp 8 [--algorithms plain,dflash2,mtp3,mtp5]
        [--batches 1,8] [--ttft 1024,8192,13312] [--out DIR]

The rank is `hylo.distributed.rank_engine`: rank 0's share of the real deployment (its TP heads, its
EP-sharded FP8 experts, its vocabulary rows; random weights, `load_format="dummy"`) whose collectives are
recorded by a **local stand-in** instead of run (an all-reduce keeps the rank's partial sum, an
all-gather repeats its part). Every figure below is therefore the rank's GPU work *without* its
collectives; `benchmarks/rank_projection.py` adds their time by a model to project the deployment.

Engines are built one after another (a TP4 rank holds ~82 GB): plain decode, DFlash2 in the shape of the
GLM-5.3-Flash DFlash2 drafter (block 8, 4 Qwen3 layers of hidden 4096 with the selector, ~1B parameters,
tapping target layers 5, 14, 24, 33, 42), MTP with 3 and 5 steps. For each speculative engine, verify
graphs are captured with acceptance replaced (this script's hook, as in `spec_e2e.py`): "forced" (every
draft accepted) and "sim3"/"sim4"/"sim6", a simulated acceptance of 3.0 / 4.0 / 6.0 tokens per step (2 /
3 / 5 drafts accepted every step, SGLang's `SGLANG_SIMULATE_ACC_LEN` protocol at a fixed length; a mode
whose block is shorter is skipped). Per (engine, mode, batch): the GPU ms of one step's replays (CUDA
events, median of `--reps` timings of 30 replays), the kernels one step launches (torch.profiler), the
weight-read floor of the step at the copy bandwidth measured in this run (`spec_e2e.step_floor`), the
CUDA GEMV's launches of that eager rerun by shape and variant (`gemv_census`), and the step's collectives
(kind, count, bytes) as the stand-in recorded them in one eager run of the step.
TTFT: the plain engine's wall time from adding a prompt of each `--ttft` length to its first token,
the median of `--reps` prompts after one that compiles the new shapes' kernels (one prompt alone moved by
~15% between processes, RESULTS S42-3). `--out`: rank_e2e.json and the top
kernels of each step.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import tempfile
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import spec_e2e

import hylo.engine.verify_graph as verify_graph
from hylo.config import EngineConfig
from hylo.distributed.rank_engine import rank_engine
from hylo.engine.cuda_graph import DecodeGraphs
from hylo.engine.engine import Engine
from hylo.sampling import SamplingParams

GLM_DRAFT_TAPS = [5, 14, 24, 33, 42]  # incoai/GLM-5.3-Flash-DFlash2 (research/anchors-2026-12.md)
GLM_DRAFT = dict(layers=4, dflash2_config={"selector_rank": 256, "selector_top_k": 16})
BLOCK = 8
SIMULATED = {"sim3": 3, "sim4": 4, "sim6": 6}  # tokens per step: drafts accepted + the bonus token


def step_collectives(graphs: DecodeGraphs, bucket: int) -> dict:
    """The collectives of one step through `bucket`'s graphs, as the stand-in records them in one eager
    run of what the bucket captures: by kind, the count, the bytes of the rank's inputs, the shapes."""
    calls = graphs.model.parallel.stand_in.calls
    start = len(calls)
    with torch.inference_mode():
        graphs.bank.warm(bucket)
    torch.cuda.synchronize()
    step = calls[start:]
    out = {}
    for kind in sorted({c.kind for c in step}):
        mine = [c for c in step if c.kind == kind]
        shapes = Counter(f"{list(c.shape)} {str(c.dtype).removeprefix('torch.')}" for c in mine)
        out[kind] = {"count": len(mine), "bytes": sum(c.bytes for c in mine), "shapes": dict(shapes)}
    return out


@dataclass
class GemvCensus:
    """The CUDA GEMV's launches inside a block: `calls` by shape and variant {"M x N x K, split S, W warps
    over K": count}, so the kernel table's `fp8_gemv_kernel<...>` rows can be told apart (the profiler names
    a ctypes launch by its template only), and `weight_bytes` each template variant read, keyed (row tiles,
    split, warps over K) as `fp8_gemv_kernel<NT, SPLIT, DEPTH, SLICES>` names them."""

    calls: dict[str, int] = field(default_factory=dict)
    weight_bytes: dict[tuple[int, int, int], int] = field(default_factory=dict)


@contextmanager
def gemv_census():
    """A `GemvCensus` of the CUDA GEMV's launches inside the block."""
    from hylo.ops.gemm import gemv_cuda

    census = GemvCensus()
    launch = gemv_cuda._launch

    def counting(library, x, weight, scale_inv, split, slices, dependent):
        key = f"{x.shape[0]} x {weight.shape[0]} x {x.shape[1]}, split {split}, {slices} warps over K"
        census.calls[key] = census.calls.get(key, 0) + 1
        variant = (1 if x.shape[0] <= 8 else 2, split, slices)  # fp8_gemv.cu: 8-row tiles of x, 1 or 2
        read = weight.numel() * weight.element_size() + scale_inv.numel() * scale_inv.element_size()
        census.weight_bytes[variant] = census.weight_bytes.get(variant, 0) + read
        return launch(library, x, weight, scale_inv, split, slices, dependent)

    gemv_cuda._launch = counting
    try:
        yield census
    finally:
        gemv_cuda._launch = launch


def measure_step(
    graphs: DecodeGraphs, bucket: int, bandwidth: float, reps: int, out: Path | None, label: str
):
    times = [spec_e2e.replay_ms(graphs, bucket, 30) for _ in range(reps)]
    kernels, table = spec_e2e.replay_kernels(graphs, bucket)
    if out is not None:
        (out / f"kernels_{label}.txt").write_text(table)
    row = {
        "replay_ms": round(statistics.median(times), 3),
        "replay_ms_all": [round(t, 3) for t in times],
        "kernels_per_step": kernels,
        "collectives": step_collectives(graphs, bucket),
    }
    spec_e2e.replay_step(graphs, bucket)  # the floor reruns the drafts of the step replayed last
    with gemv_census() as census:
        row["floor"] = spec_e2e.step_floor(graphs, bucket, bandwidth)
    row["gemv_calls"] = census.calls
    row["efficiency"] = round(row["floor"]["floor_ms"] / row["replay_ms"], 3)
    return row


def warm(engine: Engine, batch: int, prompt_len: int = 64, tokens: int = 17) -> None:
    """A few steps of `batch` requests: eager kernels compiled, the graphs' caches holding real rows."""
    gen = torch.Generator().manual_seed(batch)
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    for i in range(batch):
        engine.add_request(
            f"warm-{batch}-{i}", torch.randint(0, 150000, (prompt_len,), generator=gen).tolist(), params
        )
    while engine.has_unfinished():
        engine.step()


def ttft_ms(engine: Engine, length: int, reps: int) -> list[float]:
    """Wall ms from adding one prompt of `length` tokens to its first token, for `reps` prompts after one
    that compiles the new shapes' kernels; each prompt its own random tokens (no prefix reuse)."""
    gen = torch.Generator().manual_seed(length)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    times = []
    for run in range(1 + reps):
        prompt = torch.randint(0, 150000, (length,), generator=gen).tolist()
        torch.cuda.synchronize()
        start = time.perf_counter()
        engine.add_request(f"ttft-{length}-{run}", prompt, params)
        while engine.has_unfinished():
            engine.step()
        times.append(round(1e3 * (time.perf_counter() - start), 1))
    return times[1:]


def engine_flags(name: str, root: Path) -> dict:
    if name == "plain":
        return {}
    if name.startswith("mtp"):
        return dict(speculative_algorithm="MTP", speculative_num_steps=int(name.removeprefix("mtp")))
    return dict(
        speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(root / name),
        speculative_num_draft_tokens=BLOCK,
        speculative_adaptive=False,
    )


def measure_engine(name: str, engine: Engine, args, bandwidth: float, out: Path | None) -> dict:
    batches = list(map(int, args.batches.split(",")))
    result: dict = {"memory_report": {k: v for k, v in engine.memory_report.items() if k != "ranks"}}
    runner = engine.runner
    if name == "plain":
        graphs = runner.graphs
        for b in batches:
            # replayed: this concurrency's last step, its cache pages not yet reused by another warm-up
            warm(engine, b)
            bucket = next(x for x in graphs.buckets if x >= b)
            result[f"B{b}"] = measure_step(graphs, bucket, bandwidth, args.reps, out, f"{name}_B{b}")
            print(json.dumps({name: {f"B{b}": result[f"B{b}"]}}), flush=True)
        for length in map(int, args.ttft.split(",")) if args.ttft else ():
            times = ttft_ms(engine, length, args.reps)
            result[f"ttft_ms_{length}"], result[f"ttft_all_ms_{length}"] = statistics.median(times), times
            row = {f"ttft_ms_{length}": result[f"ttft_ms_{length}"], "all": times}
            print(json.dumps({name: row}), flush=True)
        return result
    for b in batches:
        warm(engine, b)
    natural = runner.verify_graphs
    tokens_per_step = natural.tokens_per_seq
    real_accept = verify_graph.accepted_prefix
    modes = {"forced": spec_e2e.accept_everything}
    modes |= {m: spec_e2e.accept_at_most(n - 1) for m, n in SIMULATED.items() if n <= tokens_per_step}
    for mode, hook in modes.items():
        verify_graph.accepted_prefix = hook  # captured into this mode's graphs
        try:
            graphs = verify_graph.VerifyGraphs(
                engine.model, engine.caches, engine.proposer, natural.buckets[-1], True, natural.bank.pool
            )
        finally:
            verify_graph.accepted_prefix = real_accept
        for b in batches:
            bucket = next(x for x in graphs.buckets if x >= b)
            row = measure_step(graphs, bucket, bandwidth, args.reps, out, f"{name}_{mode}_B{b}")
            row["tokens_per_step"] = tokens_per_step if mode == "forced" else SIMULATED[mode]
            result[f"{mode}_B{b}"] = row
            print(json.dumps({name: {f"{mode}_B{b}": row}}), flush=True)
        del graphs
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=8, help="ranks the deployment splits each layer over")
    parser.add_argument("--ep", type=int, default=None, help="expert split: tp (by expert, default) or 1")
    parser.add_argument("--rank", type=int, default=0, help="which rank to build")
    parser.add_argument("--layers", type=int, default=45, help="target layers (45: the full model)")
    parser.add_argument("--algorithms", default="plain,dflash2,mtp3,mtp5", help="engines, built in turn")
    parser.add_argument("--batches", default="1,8", help="concurrencies measured")
    parser.add_argument("--ttft", default="1024,8192,13312", help="prompt lengths of the TTFT runs")
    parser.add_argument(
        "--reps", type=int, default=3, help="timings per step (each 30 replays), and TTFT prompts per length"
    )
    parser.add_argument("--mem-fraction", type=float, default=0.9, help="mem_fraction_static of each engine")
    parser.add_argument("--sequence-parallel-tokens", type=int, default=512, help="0: prefill without it")
    parser.add_argument("--out", default=None, help="folder for rank_e2e.json and kernel tables")
    args = parser.parse_args()
    out = Path(args.out) if args.out else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    root = Path(tempfile.mkdtemp())
    (root / "target").mkdir()
    spec_e2e.write_target(root / "target", args.layers)
    algorithms = args.algorithms.split(",")
    if "dflash2" in algorithms:
        (root / "dflash2").mkdir()
        taps = [t for t in GLM_DRAFT_TAPS if t < args.layers] or [args.layers - 1]
        spec_e2e.write_dflash(root / "dflash2", taps, BLOCK, dflash2=True, **GLM_DRAFT)
    report: dict = {
        "gpu": torch.cuda.get_device_name(),
        "tp": args.tp,
        "ep": args.ep or args.tp,
        "rank": args.rank,
        "layers": args.layers,
        "collectives": "local stand-in (recorded, not run): the figures are the rank's GPU work alone",
    }
    bandwidth = spec_e2e.copy_bandwidth()
    report["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 3)
    max_bs = max(map(int, args.batches.split(",")))
    longest = max(map(int, args.ttft.split(","))) if args.ttft else 0
    for name in algorithms:
        start = time.perf_counter()
        config = EngineConfig.from_kwargs(
            model=str(root / "target"), load_format="dummy", device="cuda", dtype="bfloat16",
            tp_size=args.tp, ep_size=args.ep, context_length=max(4096, longest + 64), max_running_requests=16,
            cuda_graph_max_bs=max_bs, mem_fraction_static=args.mem_fraction, skip_warmup=True,
            sequence_parallel_tokens=args.sequence_parallel_tokens, **engine_flags(name, root),
        )  # fmt: skip
        engine = None
        try:  # an engine that fails is reported and the next one still runs
            engine = rank_engine(config, args.rank)
            built_s = time.perf_counter() - start
            result = measure_engine(name, engine, args, bandwidth, out)
            result["build_s"] = round(built_s, 1)
        except Exception as e:
            traceback.print_exc()
            result = {"error": f"{type(e).__name__}: {e}"}
        finally:
            if engine is not None:
                engine.close()
            del engine
            gc.collect()
            torch.cuda.empty_cache()
        report[name] = result
        if out is not None:
            (out / "rank_e2e.json").write_text(json.dumps(report, indent=1))
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
