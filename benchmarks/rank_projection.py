"""A projection of the full GLM-5.3-Flash deployment at TP4/TP8 from one rank measured alone
(`benchmarks/device/rank_e2e.py`), side by side with the published cells it competes with.

    PYTHONPATH=src .venv/bin/python benchmarks/rank_projection.py RANK_E2E.json [...]

Assumptions (each stated in the printed table too):
- a step of the deployment takes the rank's measured GPU time plus the time of the step's collectives,
  run one after another (nothing of the collectives overlaps compute), with no host time (hylo's
  steps measured 1.02-1.04× their replays on one GPU, RESULTS S22) and every rank as fast as rank 0;
- the collectives are those the rank issued (recorded by the stand-in), timed two ways: (a) NCCL's
  ring latency model plus the ring bandwidth term (`sizing.py`), (b) a one-shot
  all-reduce of the kind vLLM's custom all-reduce and TensorRT-LLM's fused all-reduce use, at the
  latency SGLang measured for it on H100 by message size (`ONE_SHOT_US`), all-gathers on NCCL's model;
- per-user decode rate = tokens per step / step time; a request's output rate (what the SGLang cookbook
  reports at concurrency 1) = OSL / (TTFT + (OSL − 1) × TPOT); TTFT = the rank's measured wall TTFT plus
  its prefill's all-reduces (one `[T, hidden]` bf16 all-reduce per block and the embedding).
It is a projection, not a measurement of four or eight GPUs.
"""

from __future__ import annotations

import argparse
import bisect
import json
import math
from pathlib import Path

import sizing

# One-shot custom all-reduce on H100 (no CUDA graph), µs by message bytes, TP4 and TP8: SGLang PR #2904's
# table (https://github.com/sgl-project/sglang/pull/2904, 2025-01-15), interpolated in log(bytes). Above its
# largest message, or where the ring is faster, the ring's time is taken (vLLM hands messages above its
# custom all-reduce's size limit to NCCL).
ONE_SHOT_SOURCE = "https://github.com/sgl-project/sglang/pull/2904"
ONE_SHOT_BYTES = [512, 4096, 32768, 262144, 524288, 1048576]
ONE_SHOT_US = {
    4: [4.8, 3.7, 4.8, 13.9, 20.2, 31.1],
    8: [5.9, 5.7, 7.8, 16.7, 22.1, 33.8],
}
ANCHORS = [
    # (label, tp, gpu, engine of ours, mode, acceptance, ISL, OSL, per-user tok/s, TTFT ms, source)
    ("SGLang cookbook, 8×H100 TP8/EP8, MTP 5 steps, simulated acceptance 3.0, 8K/1K, c=1", 8, "H100",
     "mtp5", "sim3", 3.0, 8192, 1024, 212.6, 345.7, "sglang glm-5.3-flash-benchmarks.jsx (#37576)"),
    ("SGLang H200 CI gate, 8×H200 TP8/EP8, MTP (EAGLE 5/1/6), acceptance ≥ 4.0, bs 1", 8, "H200",
     "mtp5", "sim4", 4.0, None, None, 200.0, None, "sglang#38076"),
    ("TensorRT-LLM, H200 TP4, MTP-3, 13K in / 33 out, c=1", 4, "H200",
     "mtp3", "forced", 4.0, 13312, 33, 316.0, 475.0, "seed 001 (research/anchors-2026-12.md)"),
]  # fmt: skip


def ring_us(c: sizing.Collective, tp: int) -> float:
    """NCCL's ring: its latency model plus the bytes each rank sends at the ring bus bandwidth."""
    return c.latency_us(tp) + c.sent_per_rank(tp) / sizing.RING_BUSBW * 1e6


def one_shot_us(c: sizing.Collective, tp: int) -> float:
    """An all-reduce as the one-shot kernel runs it (`ONE_SHOT_US`), where that is measured and faster
    than the ring; any other collective on the ring."""
    xs, ys = ONE_SHOT_BYTES, ONE_SHOT_US[tp]
    if c.kind != sizing.ALL_REDUCE or c.message_bytes > xs[-1]:
        return ring_us(c, tp)
    i = min(max(bisect.bisect_right(xs, c.message_bytes), 1), len(xs) - 1)
    x = max(c.message_bytes, xs[0])
    w = (math.log(x) - math.log(xs[i - 1])) / (math.log(xs[i]) - math.log(xs[i - 1]))
    return min(c.count * (ys[i - 1] + w * (ys[i] - ys[i - 1])), ring_us(c, tp))


def collectives_of(recorded: dict, tp: int) -> list[tuple[sizing.Collective, int]]:
    """The step's recorded collectives as `sizing.Collective`s (one per message size) with the rank's
    input bytes: an all-reduce's message is its tensor, an all-gather's the gathered output."""
    out: list[tuple[sizing.Collective, int]] = []
    for kind, entry in recorded.items():
        for shape, count in entry["shapes"].items():
            dims, dtype = shape.rsplit(" ", 1)
            size = math.prod(json.loads(dims)) * {"bfloat16": 2, "float32": 4, "float16": 2}[dtype]
            message = size * (tp if kind == sizing.ALL_GATHER else 1)
            out.append((sizing.Collective(kind, count, message, shape), size))
    return out


def comm_ms(recorded: dict, tp: int) -> tuple[float, float]:
    """(NCCL ring model, one-shot all-reduce) ms of a step's collectives."""
    collectives = [c for c, _ in collectives_of(recorded, tp)]
    return _ms(collectives, tp)


def _ms(collectives: list[sizing.Collective], tp: int) -> tuple[float, float]:
    nccl = sum(ring_us(c, tp) for c in collectives)
    return nccl / 1e3, sum(one_shot_us(c, tp) for c in collectives) / 1e3


def prefill_comm_ms(tokens: int, tp: int) -> tuple[float, float]:
    """(NCCL, one-shot) ms of a `tokens`-token prefill's all-reduces and its logits gather."""
    return _ms(sizing.target_step(sizing.full_config(), tp, tokens, 1), tp)


def step_rows(report: dict) -> list[dict]:
    """One row per measured (engine, mode, batch) step: GPU ms, collectives, projected step ms."""
    tp, rows = report["tp"], []
    for engine, result in report.items():
        if not isinstance(result, dict) or "memory_report" not in result:
            continue
        for key, step in result.items():
            if not isinstance(step, dict) or "replay_ms" not in step:
                continue
            mode, _, batch = key.rpartition("_B") if "_B" in key else ("plain", "", key.removeprefix("B"))
            nccl, one_shot = comm_ms(step["collectives"], tp)
            count = sum(e["count"] for e in step["collectives"].values())
            tokens = step.get("tokens_per_step", 1)
            rows.append(dict(
                engine=engine, mode=mode or "plain", batch=int(batch), gpu_ms=step["replay_ms"],
                floor_ms=step["floor"]["floor_ms"], kernels=step["kernels_per_step"], collectives=count,
                comm_bytes=sum(e["bytes"] for e in step["collectives"].values()), nccl_ms=nccl,
                one_shot_ms=one_shot, tokens=tokens,
            ))  # fmt: skip
    return rows


def projection_table(report: dict) -> list[str]:
    tp = report["tp"]
    lines = [
        f"### {report['gpu']}, TP{tp}/EP{report['ep']} rank {report['rank']}, {report['layers']} layers "
        f"(copy {report['copy_bandwidth_tb_s']} TB/s)",
        "",
        "| engine | acceptance | c | rank GPU ms | floor ms | kernels | collectives (rank bytes) | "
        "NCCL ms | one-shot ms | step ms (NCCL / one-shot) | tok/s per user (NCCL / one-shot) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in step_rows(report):
        step_nccl, step_one = r["gpu_ms"] + r["nccl_ms"], r["gpu_ms"] + r["one_shot_ms"]
        cells = [
            r["engine"], f"{r['mode']} ({r['tokens']})", r["batch"], f"{r['gpu_ms']:.2f}",
            f"{r['floor_ms']:.2f}", f"{r['kernels']:.0f}",
            f"{r['collectives']} ({r['comm_bytes'] / 1e3:.0f} kB)",
            f"{r['nccl_ms']:.2f}", f"{r['one_shot_ms']:.2f}", f"{step_nccl:.2f} / {step_one:.2f}",
            f"{1e3 * r['tokens'] / step_nccl:.0f} / {1e3 * r['tokens'] / step_one:.0f}",
        ]  # fmt: skip
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    plain = report.get("plain", {})
    ttfts = {int(k.removeprefix("ttft_ms_")): v for k, v in plain.items() if k.startswith("ttft_ms_")}
    if ttfts:
        header = "| prompt tokens | rank TTFT ms (measured) | + all-reduces NCCL / one-shot ms | TTFT ms |"
        lines += ["", header, "|---|---|---|---|"]
        for tokens, ms in sorted(ttfts.items()):
            nccl, one_shot = prefill_comm_ms(tokens, tp)
            total = f"{ms + nccl:.0f} / {ms + one_shot:.0f}"
            lines.append(f"| {tokens} | {ms:.1f} | {nccl:.1f} / {one_shot:.1f} | {total} |")
    return lines


def anchor_table(reports: list[dict]) -> list[str]:
    lines = [
        "| published cell | hylo projection (ours: engine, acceptance, GPU of the rank measured) | "
        "TPOT ms (NCCL / one-shot) | TTFT ms | per-user tok/s (NCCL / one-shot) | published |",
        "|---|---|---|---|---|---|",
    ]
    for label, tp, gpu, engine, mode, accept, isl, osl, rate, ttft, source in ANCHORS:
        report = next((r for r in reports if r["tp"] == tp and gpu in r["gpu"]), None)
        if report is None:
            report = next((r for r in reports if r["tp"] == tp), None)
            if report is None:
                lines.append(f"| {label} | not measured (no TP{tp} rank) | | | | {rate} tok/s |")
                continue
        row = next(
            (r for r in step_rows(report) if (r["engine"], r["mode"], r["batch"]) == (engine, mode, 1)), None
        )
        if row is None:
            lines.append(f"| {label} | {engine} {mode} not measured | | | | {rate} tok/s |")
            continue
        tpot = [(row["gpu_ms"] + comm) / accept for comm in (row["nccl_ms"], row["one_shot_ms"])]
        ours_ttft = None
        if isl is not None:
            measured = {
                int(k.removeprefix("ttft_ms_")): v
                for k, v in report["plain"].items()
                if k.startswith("ttft_ms_")
            }
            if isl in measured:
                ours_ttft = [measured[isl] + c for c in prefill_comm_ms(isl, tp)]
        if osl is not None and ours_ttft is not None:
            rates = [1e3 * osl / (t + (osl - 1) * p) for t, p in zip(ours_ttft, tpot, strict=True)]
        else:
            rates = [1e3 / p for p in tpot]
        ttft_cell = "n/a" if ours_ttft is None else f"{ours_ttft[0]:.0f} / {ours_ttft[1]:.0f}"
        published = f"{rate} tok/s" + (f", TTFT {ttft} ms" if ttft else "") + f" ({source})"
        lines.append(
            f"| {label} | {engine}, {mode} ({accept:g} tokens/step), {report['gpu']} | "
            f"{tpot[0]:.2f} / {tpot[1]:.2f} | {ttft_cell} | **{rates[0]:.0f} / {rates[1]:.0f}** | "
            f"{published} |"
        )
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("reports", nargs="+", help="rank_e2e.json files (one per GPU and TP degree)")
    args = parser.parse_args()
    reports = [json.loads(Path(p).read_text()) for p in args.reports]
    lines = ["A projection, not a measurement: the assumptions are in `benchmarks/rank_projection.py`.", ""]
    for report in reports:
        lines += [*projection_table(report), ""]
    lines += anchor_table(reports)
    busbw = f"{sizing.RING_BUSBW / 1e9:.0f} GB/s ({sizing.BUSBW_SOURCE})"
    lines += ["", f"NCCL model: {sizing.LATENCY_SOURCE}, ring bus bandwidth {busbw}; one-shot all-reduce: "
              f"{ONE_SHOT_SOURCE} (H100)."]  # fmt: skip
    print("\n".join(lines))


if __name__ == "__main__":
    main()
