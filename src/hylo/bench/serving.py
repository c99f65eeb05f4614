"""`hylo bench serve`: an asynchronous load generator for any OpenAI-compatible server.

Metrics follow `sglang.bench_serving`: TTFT is the time to the first streamed text, ITL the gaps
between streamed chunks, TPOT = (latency - TTFT) / (output tokens - 1), throughput over the whole
run; token counts come from the server's `usage` (stream_options.include_usage).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from hylo.bench.datasets import BenchRequest, random_dataset, sharegpt_dataset
from hylo.bench.sse import sse_events
from hylo.tokenizer import Tokenizer


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


async def _one(
    client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, ignore_eos: bool
) -> RequestResult:
    body = {
        "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
        "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": ignore_eos,
    }  # fmt: skip
    result = RequestResult()
    start = last = time.perf_counter()
    chunks = 0
    try:
        async with client.stream("POST", url, json=body) as response:
            if response.status_code != 200:
                result.error = f"HTTP {response.status_code}: {(await response.aread()).decode()[:200]}"
                return result
            async for data in sse_events(response.aiter_bytes()):
                if data == "[DONE]":
                    continue
                payload = json.loads(data)
                now = time.perf_counter()
                if payload.get("usage"):
                    result.prompt_tokens = payload["usage"]["prompt_tokens"]
                    result.output_tokens = payload["usage"]["completion_tokens"]
                if any(c.get("text") for c in payload.get("choices", [])):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
        result.latency = time.perf_counter() - start
        result.output_tokens = result.output_tokens or chunks
        result.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        result.error = f"{type(e).__name__}: {e}"
    return result


async def run_benchmark(
    base_url: str,
    requests: list[BenchRequest],
    model: str | None = None,
    request_rate: float = math.inf,
    max_concurrency: int | None = None,
    api_key: str | None = None,
    ignore_eos: bool = True,
    seed: int = 1,
    progress: bool = True,
) -> dict:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=None, limits=limits) as client:
        if model is None:
            model = (await client.get("/v1/models")).json()["data"][0]["id"]
        gate = asyncio.Semaphore(max_concurrency or len(requests))
        rng = random.Random(seed)
        bar = tqdm(total=len(requests), desc="Requests", unit="req", disable=not progress)

        async def limited(req: BenchRequest) -> RequestResult:
            async with gate:
                result = await _one(client, "/v1/completions", model, req, ignore_eos)
            bar.update()
            return result

        start = time.perf_counter()
        tasks = []
        for req in requests:
            tasks.append(asyncio.create_task(limited(req)))
            if request_rate != math.inf:
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        info = (await client.get("/server_info")).json() if (await _has(client, "/server_info")) else {}
    report = summarize(results, duration)
    report.update(model=model, base_url=base_url, request_rate=request_rate, max_concurrency=max_concurrency)
    if "avg_spec_accept_length" in info:
        report["mean_accept_length"] = info["avg_spec_accept_length"]
    return report


async def _has(client: httpx.AsyncClient, path: str) -> bool:
    try:
        return (await client.get(path)).status_code == 200
    except httpx.HTTPError:
        return False


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.ok]
    tpot = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    report: dict = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_tokens for r in ok),
        "total_output_tokens": sum(r.output_tokens for r in ok),
        "request_throughput": len(ok) / duration,
        "input_throughput": sum(r.prompt_tokens for r in ok) / duration,
        "output_throughput": sum(r.output_tokens for r in ok) / duration,
        "concurrency": sum(r.latency for r in ok) / duration,
    }
    report["total_throughput"] = report["input_throughput"] + report["output_throughput"]
    for name, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpot),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2e_latency", [r.latency for r in ok]),
    ):
        report |= {f"{k}_{name}_ms": v for k, v in _stats(values).items()}
    return report


def _stats(values: list[float]) -> dict[str, float]:
    if not values:
        return {"mean": 0.0, "median": 0.0, "p99": 0.0, "std": 0.0}
    ordered = sorted(values)
    p99 = ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]
    return {
        "mean": statistics.fmean(values) * 1e3,
        "median": statistics.median(values) * 1e3,
        "p99": p99 * 1e3,
        "std": (statistics.pstdev(values) if len(values) > 1 else 0.0) * 1e3,
    }


def format_report(report: dict) -> str:
    lines = [f"{'=' * 16} Serving Benchmark Result {'=' * 16}"]
    rows = [
        ("Successful requests", report["completed"]),
        ("Failed requests", report["failed"]),
        ("Benchmark duration (s)", report["duration_s"]),
        ("Total input tokens", report["total_input_tokens"]),
        ("Total generated tokens", report["total_output_tokens"]),
        ("Request throughput (req/s)", report["request_throughput"]),
        ("Input token throughput (tok/s)", report["input_throughput"]),
        ("Output token throughput (tok/s)", report["output_throughput"]),
        ("Total token throughput (tok/s)", report["total_throughput"]),
        ("Concurrency", report["concurrency"]),
    ]
    if "mean_accept_length" in report:
        rows.append(("Mean acceptance length", report["mean_accept_length"]))
    for name, title in (
        ("e2e_latency", "End-to-end latency"),
        ("ttft", "Time to first token"),
        ("tpot", "Time per output token (excl. 1st)"),
        ("itl", "Inter-token latency"),
    ):
        rows += [
            (f"{k.capitalize()} {title} (ms)", report[f"{k}_{name}_ms"]) for k in ("mean", "median", "p99")
        ]
    for label, value in rows:
        lines.append(f"{label:<46}{value:>12.2f}" if isinstance(value, float) else f"{label:<46}{value:>12}")
    return "\n".join(lines)


def run_from_cli(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise SystemExit("hylo bench serve: --num-prompts must be >= 1")
    try:
        requests = _dataset(args)
    except (ValueError, FileNotFoundError) as e:
        raise SystemExit(f"hylo bench serve: {e}") from e
    report = asyncio.run(run_benchmark(
        args.base_url, requests, args.model, args.request_rate, args.max_concurrency, args.api_key,
        not args.disable_ignore_eos, args.seed, not args.disable_tqdm,
    ))  # fmt: skip
    report["dataset"] = args.dataset
    report["num_prompts"] = args.num_prompts
    print(format_report(report))
    if args.output_json:
        Path(args.output_json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["failed"] == 0 else 1


def _dataset(args: argparse.Namespace) -> list[BenchRequest]:
    if args.dataset == "sharegpt":
        return sharegpt_dataset(args.num_prompts, args.sharegpt_output_len, args.seed)
    for flag in ("random_input_len", "random_output_len"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        raise ValueError(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    tokenizer = Tokenizer.from_dir(_tokenizer_dir(args))
    return random_dataset(
        tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
        args.random_range_ratio, args.seed,
    )  # fmt: skip


def _tokenizer_dir(args: argparse.Namespace) -> Path:
    """--tokenizer, else --model when it is a directory, else what a hylo server reports serving."""
    if args.tokenizer is not None:
        return Path(args.tokenizer)
    if args.model is not None and Path(args.model).is_dir():
        return Path(args.model)
    why = "the server reports no model directory (/server_info is hylo's)"
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    try:
        response = httpx.get(f"{args.base_url.rstrip('/')}/server_info", headers=headers, timeout=30)
        config = response.json()["config"] if response.status_code == 200 else None
    except (httpx.HTTPError, ValueError, KeyError, TypeError):
        config = None
    if isinstance(config, dict):
        served = config.get("tokenizer") or config.get("model")
        if served is None:
            from hylo.models.demo import default_model_dir

            return default_model_dir()  # hylo serves its embedded demo model when given none
        if Path(served).is_dir():
            return Path(served)
        why = f"the server's model directory {served} is not on this machine"
    raise ValueError(
        "--dataset-name random counts prompt tokens with the served model's tokenizer: pass "
        f"--tokenizer DIR (a directory with tokenizer.json); {why}"
    )
