"""hylo's own HTTP clients (`hylo bench serve`, `benchmarks/server_soak.py`) against scripted servers:
streams read by the SSE spec's line ends, and the soak's recovery with a warm prefix cache."""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
from pathlib import Path

import httpx

from hylo.bench.serving import BenchRequest, _one
from hylo.bench.sse import SSEDecoder, sse_events

ROOT = Path(__file__).resolve().parents[1]
# Characters JSON strings may carry raw that str.splitlines (and so httpx's aiter_lines) splits at.
SEPARATORS = "\u2028\u2029\u0085\x0b\x0c\x1c\x1d\x1e"
TEXT = f"a{SEPARATORS}b é ✓"


def _stream(line_end: bytes) -> bytes:
    """Three completion chunks carrying TEXT raw (as `json.dumps(..., ensure_ascii=False)` writes it),
    a usage chunk and [DONE], each event ended by a blank line."""
    events = [{"choices": [{"index": 0, "text": TEXT}]} for _ in range(3)]
    events.append({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    body = [f"data: {json.dumps(e, ensure_ascii=False)}" for e in events] + ["data: [DONE]"]
    return b"".join(line.encode() + line_end + line_end for line in body)


def _load_soak():
    spec = importlib.util.spec_from_file_location("server_soak", ROOT / "benchmarks" / "server_soak.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_stream_really_holds_what_splitlines_splits():
    assert len(_stream(b"\n").decode().splitlines()) > 10  # 10 lines by the spec's line ends


def test_sse_decoder_splits_on_cr_lf_crlf_only():
    for line_end in (b"\n", b"\r", b"\r\n"):
        raw = _stream(line_end)
        for chunk_size in (1, 2, 7, len(raw)):  # chunks cut CRLF pairs and UTF-8 characters in two
            decoder = SSEDecoder()
            pieces = [raw[i : i + chunk_size] for i in range(0, len(raw), chunk_size)]
            events = [e for piece in pieces for e in decoder.feed(piece)]
            events += decoder.close()
            assert events[-1] == "[DONE]", (line_end, chunk_size)
            payloads = [json.loads(e) for e in events[:-1]]
            assert [p["choices"][0]["text"] for p in payloads[:3]] == [TEXT] * 3, (line_end, chunk_size)
            assert payloads[3]["usage"]["completion_tokens"] == 3


def test_sse_decoder_follows_the_event_rules():
    raw = b"\xef\xbb\xbf: a comment\nevent: x\ndata:one\ndata: two\nid: 7\n\ndata: cut off at the end"
    decoder = SSEDecoder()
    assert decoder.feed(raw) == ["one\ntwo"]  # BOM dropped, fields joined by LF, one space dropped
    assert decoder.close() == []  # an event the stream ends inside is dropped
    final_cr = SSEDecoder()
    assert final_cr.feed(b"data: x\r\r") == [] and final_cr.close() == ["x"]  # a final CR ends a line


def _streaming_server(raw: bytes) -> httpx.MockTransport:
    async def chunks():
        for i in range(0, len(raw), 5):
            yield raw[i : i + 5]

    return httpx.MockTransport(lambda request: httpx.Response(200, content=chunks()))


def test_bench_serve_reads_line_separators_inside_json():
    async def run():
        transport = _streaming_server(_stream(b"\n"))
        async with httpx.AsyncClient(base_url="http://bench.test", transport=transport) as client:
            return await _one(client, "/v1/completions", "m", BenchRequest("p", 3), ignore_eos=True)

    result = asyncio.run(run())
    assert result.ok, result.error
    assert (result.prompt_tokens, result.output_tokens, len(result.itl)) == (5, 3, 2)


def _soak_args(**overrides) -> argparse.Namespace:
    args = dict(base_url="http://127.0.0.1:8000", api_key=None, duration=0.0, concurrency=1)
    args |= dict(request_timeout=5.0, recovery_timeout=1.0, seed=0)
    return argparse.Namespace(**(args | overrides))


def test_soak_reads_line_separators_inside_json():
    soak = _load_soak().Soak(_soak_args(), transport=_streaming_server(_stream(b"\r\n")))
    soak.rng.random = lambda: 0.9  # keep the stream to its end (a third of them leave early)
    asyncio.run(soak.valid_stream())
    assert soak.counts["completed"] == 1 and not soak.problems, soak.problems


def test_soak_recovers_with_pages_only_the_prefix_cache_holds():
    """Idle, every slot free, 3 pages held by the prefix cache alone: recovered (free_pages alone
    never reaches total_pages with a warm cache)."""
    info = {
        "num_running": 0, "num_waiting": 0, "num_open_requests": 0, "free_slots": 4, "total_slots": 4,
        "free_pages": 61, "available_pages": 64, "total_pages": 64, "prefix_cache": {"pages": 3},
    }  # fmt: skip

    def server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            return httpx.Response(200, json=info)
        return httpx.Response(200, json={"choices": [{"text": "ok"}]})

    soak = _load_soak().Soak(_soak_args(), transport=httpx.MockTransport(server))
    assert asyncio.run(soak.recovery_s()) is not None
    info["available_pages"] = 63  # a request still holds a page: not recovered
    assert asyncio.run(soak.recovery_s()) is None


def test_sse_events_reads_an_async_byte_stream():
    async def chunks():
        yield "data: a\u2028b\r".encode()
        yield b"\n\r\ndata: [DONE]\n\n"

    async def collect():
        return [e async for e in sse_events(chunks())]

    assert asyncio.run(collect()) == ["a\u2028b", "[DONE]"]
