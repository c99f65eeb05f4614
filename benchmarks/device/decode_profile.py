"""Where a decode graph replay's time goes, kernel by kernel, beside the bytes each kind of module
reads: the real-size GLM-5.3-Flash slice (a random FP8 checkpoint, `load_format="dummy"`), or with
`--tp 8 --layers 45` rank 0 of a TP8/EP8 deployment of the full model (`hylo.distributed.rank_engine`: the
rank's share of the weights, its collectives recorded and not run, as in `rank_e2e.py`).

    PYTHONPATH=src python3 benchmarks/device/decode_profile.py [--tp 0|4|8] [--layers 8] [--buckets 1 8]
                                                               [--verify BLOCK] [--no-ttft] [--out DIR]

With `--verify 8` the step profiled is a DFlash verify of blocks of 8 tokens (a random draft, every draft
accepted, as spec_e2e's forced runs): the verify and commit graphs' kernels, and the bytes of the target and
of the draft (as "draft <kind>") that step reads.

Per bucket, after a few decode steps of that many requests of random prompts (so the graph's static
batch is a real one: distinct tokens routed to distinct experts; the warm-up batch repeats one token):
the replay's GPU ms; every kernel's µs per replay and launches per replay (torch.profiler over
replays), each CUDA GEMV variant's with the weight bytes it read and their floor; the weight bytes each
module kind reads in the step (counting hooks on an eager rerun of the same static batch: FP8 and bf16
projections, routed experts (the experts routed to), the lm_head, norms and the rest) and its floor at the
copy rate measured here; the CUDA GEMV's launches of that rerun by shape and variant
(`rank_e2e.gemv_census`: the kernel table names them by template only). Also the
TTFT of a fresh 1024- and 13312-token prompt (median of three), for the prefill side of the same kernels.
Printed per bucket as a table (`markdown_table`); `--out` gets the whole report as JSON.

Kernels launched as programmatic dependents (`hylo.ops.dependent_launch`, on by default on Hopper) start
before the kernel ahead of them ends and wait, so the profiler counts that wait in their time (mHC's pre
read twice its own cost so, RESULTS S32-2): for each kernel's own time run with `HYLO_PDL=0`. The
`exposed` table holds under either setting: what each kernel adds to the replay's span from the same
profiled replays' timeline (`exposed_table`), and the launch gaps between kernels.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import tempfile
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
from prefix_e2e import VOCAB, serve, ttft
from rank_e2e import gemv_census, warm
from spec_e2e import (
    accept_everything,
    copy_bandwidth,
    replay_ms,
    replay_step,
    weight_bytes_by_kind,
    write_dflash,
    write_target,
)

import hylo.engine.verify_graph as verify_graph
import hylo.speculative.verify as verify
from hylo import LLM
from hylo.config import EngineConfig
from hylo.distributed.rank_engine import rank_engine
from hylo.layers.linear import FusedLinear, Linear
from hylo.layers.moe import Experts, FP8Experts


def kernel_tables(replay: Callable[[], None], reps: int = 10) -> tuple[list[dict], dict]:
    """Every kernel of a step's graph replays (`replay`): name, µs and launches per replay, by time; and
    `exposed_table` of the same replays."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        total = getattr(e, "device_time_total", None) or e.cuda_time_total
        rows.append({"kernel": e.key[:120], "us": round(total / reps, 1), "launches": e.count / reps})
    spans = [
        (e.name, e.time_range.start, e.time_range.end)
        for e in prof.events()
        if e.device_type == torch.autograd.DeviceType.CUDA
    ]
    return sorted(rows, key=lambda r: -r["us"]), exposed_table(spans, reps)


def exposed_table(spans: list[tuple[str, float, float]], reps: int) -> dict:
    """What each kernel adds to a replay's span, from the profiler's (name, start µs, end µs) of `reps`
    replays of one graph. Walking them by start, a kernel's exposed time is how far it moves the latest end
    so far past max(that end, its own start); the idle time before it (its start past that end) is a gap. A
    programmatic dependent starts before the kernel ahead of it ends, so its own time (the profiler's)
    counts its wait; its exposed time does not. Per replay: the kernels by exposed µs (launches per replay),
    the gaps' µs, and the span (first start to last end), which exposed times and gaps add up to."""
    spans = sorted(spans, key=lambda s: s[1])
    if not spans or len(spans) % reps:
        raise ValueError(f"{len(spans)} kernel spans do not split into {reps} replays")
    per = len(spans) // reps
    exposed: dict[str, float] = defaultdict(float)
    launches: dict[str, int] = defaultdict(int)
    gaps = span = 0.0
    for r in range(reps):
        replay = spans[r * per : (r + 1) * per]
        latest = replay[0][1]
        for name, start, end in replay:
            gaps += max(0.0, start - latest)
            exposed[name[:120]] += max(0.0, end - max(latest, start))
            launches[name[:120]] += 1
            latest = max(latest, end)
        span += latest - replay[0][1]
    rows = [
        {"kernel": k, "exposed_us": round(t / reps, 1), "launches": launches[k] / reps}
        for k, t in exposed.items()
    ]
    rows.sort(key=lambda r: -r["exposed_us"])
    return {"span_us": round(span / reps, 1), "gaps_us": round(gaps / reps, 1), "kernels": rows}


OTHER = "other (norms, gates, hyper-connections, ...)"  # every module no other kind names


_GEMV_KERNEL = re.compile(r"fp8_gemv_kernel<(\d+), (\d+), \d+, (\d+)(?:, (?:true|false))?>")


def with_gemv_floors(
    rows: list[dict], weight_bytes: dict[tuple[int, int, int], int], bandwidth: float
) -> list[dict]:
    """`kernel_tables` rows, each CUDA GEMV variant's (`fp8_gemv_kernel<NT, SPLIT, DEPTH, SLICES, FULL>`)
    with the weight bytes it read in one step (`rank_e2e.GemvCensus.weight_bytes`), their floor at
    `bandwidth` and the share of the row's time the floor is."""
    out = []
    for row in rows:
        match = _GEMV_KERNEL.search(row["kernel"])
        read = weight_bytes.get(tuple(map(int, match.groups()))) if match else None
        if read:
            floor_us = 1e6 * read / bandwidth
            row = {**row, "gb": round(read / 1e9, 3), "floor_us": round(floor_us, 1),
                   "of_floor": round(floor_us / row["us"], 3)}  # fmt: skip
        out.append(row)
    return out


def markdown_table(step: dict, top: int = 40) -> str:
    """One bucket's report (`main`'s `b{batch}` entry) as a table: the replay and its floor, then each
    kernel by its own µs, with its exposed µs, launches and, for a CUDA GEMV variant, its floor and the
    share of its time that is; the step's floors by module kind and the launch gaps after it."""
    exposed = {row["kernel"]: row["exposed_us"] for row in step["exposed"]["kernels"]}
    lines = [
        f"replay {step['replay_ms']} ms, floor {step['floor_ms']} ms "
        f"({100 * step['floor_ms'] / step['replay_ms']:.1f}%); span {step['exposed']['span_us']} us",
        "",
        "| kernel | own us | exposed us | launches | floor us | floor / own |",
        "|---|---|---|---|---|---|",
    ]
    for row in step["kernels"][:top]:
        floor = (row["floor_us"], row["of_floor"]) if "floor_us" in row else ("", "")
        cells = (row["kernel"][:90], row["us"], exposed.get(row["kernel"], ""), row["launches"], *floor)
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    lines.append(f"| (gaps between kernels) | | {step['exposed']['gaps_us']} | | | |")
    for kind, cost in sorted(step["bytes_by_kind"].items(), key=lambda kv: -kv[1]["floor_us"]):
        lines.append(f"| floor of {kind} ({cost['gb']} GB) | | | | {cost['floor_us']} | |")
    return "\n".join(lines)


def module_kind(module: torch.nn.Module, name: str) -> str:
    if isinstance(module, Experts | FP8Experts):
        return "routed experts"
    if name.endswith("lm_head"):
        return "lm_head"
    if isinstance(module, Linear | FusedLinear):
        fp8 = getattr(module, "weight_scale_inv", None) is not None
        return "projections fp8" if fp8 else "projections bf16"
    if isinstance(module, torch.nn.Embedding) or name.endswith("embed_tokens"):
        return "embedding"
    return OTHER


def bytes_by_kind(model: torch.nn.Module, forward, draft: torch.nn.Module | None = None) -> dict[str, float]:
    """Weight bytes one call of `forward` reads, by `module_kind` (`spec_e2e.weight_bytes_by_kind`; the
    router's tensors as OTHER), the modules of `draft` (a speculative step's drafter) as "draft <kind>"."""
    drafted = {id(m) for m in draft.modules()} if draft is not None else set()

    def kind_of(m: torch.nn.Module, name: str) -> str:
        return ("draft " if id(m) in drafted else "") + module_kind(m, name)

    roots = [model] + ([draft] if draft is not None else [])
    return weight_bytes_by_kind(roots, forward, kind_of, OTHER)[0]


def build(tp: int, layers: int, block: int = 0):
    """The slice's engine (`tp` 0) or rank 0 of a `tp`-rank deployment of `layers` layers; with `block` > 0
    it speculates with a random DFlash draft of that block (taps 1, L/2, L-2), every draft accepted."""
    root = Path(tempfile.mkdtemp())
    (root / "target").mkdir()
    write_target(root / "target", layers)
    common = dict(
        load_format="dummy", device="cuda", dtype="bfloat16", max_running_requests=8, cuda_graph_max_bs=8,
        context_length=16384, skip_warmup=True,
    )  # fmt: skip
    if block:
        (root / "dflash").mkdir()
        write_dflash(root / "dflash", [1, layers // 2, layers - 2], block)
        common |= dict(
            speculative_algorithm="DFLASH", speculative_draft_model_path=str(root / "dflash"),
            speculative_num_draft_tokens=block, speculative_adaptive=False,
        )  # fmt: skip
        # forced acceptance: captured into the verify graphs, and for the eager steps of the warm-up
        verify_graph.accepted_prefix = verify.accepted_prefix = accept_everything
    if tp == 0:
        return LLM(str(root / "target"), mem_fraction_static=0.6, **common).engine
    config = EngineConfig.from_kwargs(
        model=str(root / "target"), tp_size=tp, mem_fraction_static=0.85, **common
    )
    return rank_engine(config, 0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=0, help="0: the slice; 4 or 8: rank 0 of that deployment")
    parser.add_argument("--layers", type=int, default=8, help="target layers (45: the full model)")
    parser.add_argument("--buckets", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--out", default=None)
    parser.add_argument("--no-ttft", action="store_true", help="skip the prefill TTFTs")
    parser.add_argument(
        "--verify", type=int, default=0, metavar="BLOCK",
        help="profile the verify step of DFlash blocks of BLOCK tokens (every draft accepted) instead",
    )  # fmt: skip
    args = parser.parse_args()
    engine = build(args.tp, args.layers, args.verify)
    graphs = engine.runner.verify_graphs if args.verify else engine.runner.graphs
    draft = getattr(engine.proposer, "draft", None) if args.verify else None
    bandwidth = copy_bandwidth()
    report: dict = {"gpu": torch.cuda.get_device_name(), "tp": args.tp, "layers": args.layers}
    report |= {"verify_block": args.verify} if args.verify else {}
    report["copy_bytes_per_s"] = bandwidth
    for batch in args.buckets:
        warm(engine, batch)
        bucket = next(b for b in graphs.buckets if b >= batch)
        replay_step(graphs, bucket)  # a verify's counting rerun below then verifies the drafts replayed
        with torch.inference_mode(), gemv_census() as census:
            read = bytes_by_kind(graphs.model, lambda b=bucket: graphs.bank.warm(b), draft)
        torch.cuda.synchronize()
        report[f"b{batch}"] = {
            "replay_ms": round(replay_ms(graphs, bucket), 3),
            "floor_ms": round(1e3 * sum(read.values()) / bandwidth, 3),
            "bytes_by_kind": {
                k: {"gb": round(v / 1e9, 3), "floor_us": round(1e6 * v / bandwidth, 1)}
                for k, v in read.items()
            },
            "gemv_calls": census.calls,
        }
        own, exposed = kernel_tables(lambda b=bucket: replay_step(graphs, b))
        report[f"b{batch}"]["kernels"] = with_gemv_floors(own, census.weight_bytes, bandwidth)
        report[f"b{batch}"]["exposed"] = exposed
    gen = torch.Generator().manual_seed(5)
    for n in () if args.no_ttft else (1024, 13312):
        times = []
        for _ in range(4):  # the first compiles what this length needs
            (request,), _ = serve(engine, [torch.randint(0, VOCAB, (n,), generator=gen).tolist()], 1)
            times.append(ttft(request) * 1e3)
        report[f"ttft_{n}_ms"] = round(statistics.median(times[1:]), 2)
    text = json.dumps(report, indent=1)
    for batch in args.buckets:
        print(f"\n## B = {batch}\n\n{markdown_table(report[f'b{batch}'])}")
    print({k: v for k, v in report.items() if not k.startswith("b")})
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "decode_profile.json").write_text(text)


if __name__ == "__main__":
    main()
