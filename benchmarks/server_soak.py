"""A bounded soak of a running hylo server on this machine: overload, clients that leave, and bad
input, mixed, for a fixed time. Reports lost requests, 5xx answers and how long the server takes to
be idle again once the load stops: no request holding a page or a slot (pages only the prefix cache
holds are available, not held; a third of the valid requests share a prompt of several pages, so
the cache is warm when the load stops). Exit status 1 if anything was lost, answered a 5xx or a
malformed event, or the server did not recover.

    .venv/bin/hylo serve --max-queued-requests 8 &
    .venv/bin/python benchmarks/server_soak.py --base-url http://127.0.0.1:8000 --duration 60

Loopback only: it refuses any other host (it is a load generator).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from urllib.parse import urlsplit

import httpx

from hylo.bench.sse import sse_events

LOOPBACK = {"127.0.0.1", "localhost", "::1"}
PROBLEMS = ("lost", "5xx", "malformed_error", "malformed_event", "accepted_bad_input")
# Several pages of one prompt (~600 tokens of the demo tokenizer): the prefix cache keeps its pages.
SHARED_PROMPT = "Once upon a time, in a town by the sea, there lived an old clockmaker. " * 28

# Bodies the server must refuse with an OpenAI-format 4xx, never a 5xx or a hang.
BAD_BODIES = [
    {"prompt": "x", "seed": 2**64},
    {"prompt": "x", "seed": 2**53, "n": 2},
    {"prompt": "x", "stop_token_ids": [10**9], "min_tokens": 3},
    {"prompt": "x", "logit_bias": {"999999999": 5}},
    {"prompt": "x", "n": 10**6},
    {"prompt": "x", "stop": ["s" * 1000] * 1000},
    {"prompt": [[False]]},
    {"prompt": "x", "max_tokens": 0},
    {"prompt": "x", "temperature": -1},
    {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
    {"messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 0},
    {"messages": []},
]
RAW_BAD_BODIES = [b'{"prompt": "a\\ud800b"}', b"\xff\xfe", b"{not json", b'{"prompt": "x", "top_p": NaN}']


class Soak:
    def __init__(self, args: argparse.Namespace, transport: httpx.AsyncBaseTransport | None = None):
        self.args = args
        self.rng = random.Random(args.seed)
        self.counts: Counter[str] = Counter()
        self.problems: list[str] = []
        self.idle_info: dict = {}
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        self.client = httpx.AsyncClient(
            base_url=args.base_url, headers=headers, timeout=args.request_timeout, transport=transport
        )

    def problem(self, kind: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.problems) < 20:
            self.problems.append(f"{kind}: {detail}")

    def check_error(self, response: httpx.Response, what: str) -> None:
        """A refusal must be a 4xx (429 included) in the OpenAI format."""
        if response.status_code >= 500:
            self.problem("5xx", f"{what} -> {response.status_code} {response.text[:200]}")
            return
        try:
            error = response.json()["error"]
            assert error["code"] == response.status_code and isinstance(error["message"], str)
        except (ValueError, KeyError, TypeError, AssertionError):
            self.problem("malformed_error", f"{what} -> {response.status_code} {response.text[:200]}")
            return
        self.counts["rate_limited" if response.status_code == 429 else "refused"] += 1

    def prompt(self) -> str:
        return SHARED_PROMPT if self.rng.random() < 1 / 3 else "Once upon a time"

    async def valid_stream(self) -> None:
        """A streaming completion; a third of them leave after a few events."""
        leave_after = self.rng.randint(1, 5) if self.rng.random() < 1 / 3 else None
        body = {"prompt": self.prompt(), "max_tokens": self.rng.randint(4, 64), "stream": True}
        async with self.client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                self.check_error(
                    httpx.Response(response.status_code, content=await response.aread()), "stream"
                )
                return
            events = 0
            async for data in sse_events(response.aiter_bytes()):
                if data == "[DONE]":
                    self.counts["completed"] += 1
                    return
                if "error" in json.loads(data):
                    self.problem("5xx", f"stream error event: {data[:200]}")
                events += 1
                if leave_after is not None and events >= leave_after:
                    self.counts["left_stream"] += 1
                    return
        self.problem("lost", "a stream ended without [DONE]")

    async def valid_json(self) -> None:
        """A non-streaming request; a third are abandoned before the answer."""
        body = {"prompt": self.prompt(), "max_tokens": self.rng.randint(4, 64)}
        leave = self.rng.random() < 1 / 3
        timeout = self.rng.uniform(0.05, 0.5) if leave else httpx.USE_CLIENT_DEFAULT
        try:
            response = await self.client.post("/v1/completions", json=body, timeout=timeout)
        except httpx.TimeoutException:
            if not leave:
                raise
            self.counts["left_json"] += 1
            return
        if response.status_code == 200:
            self.counts["completed"] += 1
        else:
            self.check_error(response, "completion")

    async def bad_input(self) -> None:
        if self.rng.random() < 0.5:
            body = self.rng.choice(BAD_BODIES)
            path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
            response = await self.client.post(path, json=body)
        else:
            raw = self.rng.choice(RAW_BAD_BODIES)
            headers = {"content-type": "application/json"}
            response = await self.client.post("/v1/completions", content=raw, headers=headers)
        if response.status_code < 400:
            self.problem("accepted_bad_input", response.text[:200])
        else:
            self.check_error(response, "bad input")

    async def worker(self, deadline: float) -> None:
        kinds = (self.valid_stream, self.valid_json, self.bad_input)
        while time.monotonic() < deadline:
            try:
                await self.rng.choices(kinds, weights=(4, 3, 3))[0]()
            except httpx.TransportError as e:
                self.problem("lost", f"{type(e).__name__}: {e}")
            except json.JSONDecodeError as e:
                self.problem("malformed_event", f"a streamed event is not JSON: {e}")

    async def recovery_s(self) -> float | None:
        """Seconds until the server is idle, no request holds a page or a slot, and it answers a
        request. Pages the prefix cache alone holds count as available (`available_pages`: free or
        evictable), not as held: a warm cache keeps them, so `free_pages` never returns to the total."""
        start = time.monotonic()
        while time.monotonic() - start < self.args.recovery_timeout:
            info = (await self.client.get("/server_info")).json()
            idle = info["num_running"] == 0 and info["num_waiting"] == 0 and info["num_open_requests"] == 0
            if (
                idle
                and info["available_pages"] == info["total_pages"]
                and info["free_slots"] == info["total_slots"]
            ):
                probe = await self.client.post("/v1/completions", json={"prompt": "ok", "max_tokens": 2})
                if probe.status_code == 200:
                    self.idle_info = info
                    return time.monotonic() - start
            await asyncio.sleep(0.1)
        return None

    async def run(self) -> int:
        deadline = time.monotonic() + self.args.duration
        await asyncio.gather(*(self.worker(deadline) for _ in range(self.args.concurrency)))
        recovery = await self.recovery_s()
        await self.client.aclose()
        print(f"soak: {self.args.duration:.0f} s, {self.args.concurrency} clients")
        for kind, n in sorted(self.counts.items()):
            print(f"  {kind:20s} {n}")
        print("  recovery             " + ("never" if recovery is None else f"{recovery:.2f} s"))
        if recovery is not None:
            info, prefix = self.idle_info, self.idle_info.get("prefix_cache") or {}
            print(
                f"  pages when idle      {info['free_pages']} free, {info['available_pages']} available,"
                f" {info['total_pages']} in all; the prefix cache holds {prefix.get('pages', 0)}"
            )
        for line in self.problems:
            print("  " + line)
        failed = any(self.counts[k] for k in PROBLEMS)
        return 1 if failed or recovery is None else 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (loopback only)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of load")
    parser.add_argument("--concurrency", type=int, default=32, help="clients at once")
    parser.add_argument("--request-timeout", type=float, default=120.0, help="seconds a request may take")
    parser.add_argument(
        "--recovery-timeout", type=float, default=60.0, help="seconds to wait for the server to be idle"
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the mix of requests")
    args = parser.parse_args()
    if urlsplit(args.base_url).hostname not in LOOPBACK:
        parser.error(f"--base-url must be a loopback address ({', '.join(sorted(LOOPBACK))})")
    return asyncio.run(Soak(args).run())


if __name__ == "__main__":
    sys.exit(main())
