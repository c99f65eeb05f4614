"""The OpenAI-compatible server, driven by the official `openai` client against a real process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest

from hylo import SamplingParams

KEY = "test-key"
NAME = "demo"
# One client for this module's plain requests: `httpx.get` and `httpx.post` build a client a call,
# whose SSL context alone costs ~50 ms of CPU. (Its connections stay open: the helpers other modules
# import poll with clients of their own, closed on return, so no idle connection is left on their
# servers, e.g. one counted against --limit-concurrency.)
HTTP = httpx.Client(timeout=60)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(proc: subprocess.Popen, port: int) -> str:
    """The server's URL once its /health answers 200; the server's output in the error if it exits."""
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + 120
    with httpx.Client(timeout=1) as client:  # one for the polls (see `HTTP`)
        while time.time() < deadline:
            try:
                if client.get(f"{url}/health").status_code == 200:
                    return url
            except httpx.HTTPError:
                pass
            if proc.poll() is not None:
                raise RuntimeError(f"server exited: {proc.stdout.read()}")
            time.sleep(0.2)
    proc.kill()
    raise RuntimeError("server did not become ready")


def on_a_free_port(start):
    """`start(port)` on a free port: a port another process takes between `free_port` and the server's bind
    (an outgoing connection of the other test worker, say) is given up for a new one, twice at most."""
    for attempt in range(3):
        try:
            return start(free_port())
        except RuntimeError as exc:
            if "address already in use" not in str(exc) or attempt == 2:
                raise


def start_server(model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    return on_a_free_port(lambda port: _start_on(port, model, *flags))


def _start_on(port: int, model: Path, *flags: str) -> tuple[subprocess.Popen, str]:
    cmd = [
        sys.executable,
        "-m",
        "hylo.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        NAME,
        "--device",
        "cpu",
        "--page-size",
        "16",
        "--max-memory-gb",
        "0.25",
        *flags,
    ]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=os.environ | {"PYTHONUNBUFFERED": "1"},
    )
    return proc, wait_ready(proc, port)


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def model_dir(shallow_model_dir):
    """This module's servers and offline engine (conftest `offline`) run the 3-layer cut of the random
    test model (conftest `shallow_model_dir`): the API does not depend on the depth, and each step costs
    ~40% of the 8-layer model's."""
    return shallow_model_dir


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = start_server(model_dir, "--api-key", KEY, "--context-length", "512")
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0)


PROMPTS = [
    " ".join(["story", "water", "time", "book", "night", "game"][: 1 + i % 6]) + f" {i}" for i in range(32)
]


def test_echo_scores_the_prompt_as_offline_prompt_logprobs(client, offline):
    """`echo` with `logprobs` and `max_tokens: 0` (how lm-eval scores choices): the prompt as the
    text, its tokens' logprobs (null for the first) and top-2 those of the offline API; with tokens
    to generate, streamed, the prompt comes first, then the offline completion."""
    prompt = PROMPTS[5]
    (ref,) = offline.generate(
        prompt, SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=2), use_tqdm=False
    )
    out = client.completions.create(model=NAME, prompt=prompt, max_tokens=0, echo=True, logprobs=2)
    (c,) = out.choices
    assert c.text == prompt and c.finish_reason == "length" and out.usage.completion_tokens == 0
    lp = c.logprobs
    assert len(lp.tokens) == len(ref.prompt_token_ids) and lp.token_logprobs[0] is None
    expected = [e[t] for e, t in zip(ref.prompt_logprobs[1:], ref.prompt_token_ids[1:], strict=True)]
    assert lp.token_logprobs[1:] == pytest.approx(expected, abs=1e-5)
    assert lp.top_logprobs[0] is None and all(len(top) >= 2 for top in lp.top_logprobs[1:])
    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=1, stream=True
    )
    chunks = [ch.choices[0] for ch in stream if ch.choices]
    assert "".join(ch.text for ch in chunks) == prompt + ref.text
    first = chunks[0].logprobs
    assert first.tokens[: len(ref.prompt_token_ids)] == lp.tokens and first.token_logprobs[0] is None


def sse_lines(url: str, path: str, body: dict) -> tuple[bytes, list[dict]]:
    """A stream's raw bytes, and its JSON events read as a line reader that also breaks lines at
    U+0085, U+2028 and U+2029 (Python's str.splitlines, JavaScript before ES2019) would read them."""
    headers = {"Authorization": f"Bearer {KEY}"}
    with HTTP.stream("POST", f"{url}{path}", json=body | {"stream": True}, headers=headers, timeout=60) as r:
        assert r.status_code == 200, r.read()
        raw = r.read()
    lines = raw.decode().splitlines()
    return raw, [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_streamed_echo_without_logprobs_begins_with_the_prompt(server):
    body = {"prompt": "Hello world", "echo": True, "max_tokens": 2, "temperature": 0}
    whole = post(server, "/v1/completions", body).json()["choices"][0]["text"]
    assert whole.startswith("Hello world") and len(whole) > len("Hello world")
    for n in (1, 2):
        _, events = sse_lines(server, "/v1/completions", body | {"n": n})
        for i in range(n):
            texts = [c["text"] for e in events for c in e["choices"] if c["index"] == i]
            assert texts[0].startswith("Hello world") and "".join(texts) == whole


def test_streamed_json_escapes_line_separators(server):
    """U+0085, U+2028 and U+2029 reach the stream (an echoed prompt, a chat reply) escaped: each
    event stays one line to every line reader, and its JSON reads back the same text."""
    prompt = "one\u2028two\u2029three\u0085four"
    raw, events = sse_lines(server, "/v1/completions", {"prompt": prompt, "echo": True, "max_tokens": 1})
    for char in ("\u0085", "\u2028", "\u2029"):
        assert char.encode() not in raw
    assert b"\\u2028" in raw and b"\\u2029" in raw and b"\\u0085" in raw
    assert events[0]["choices"][0]["text"].startswith(prompt)


def test_text_offset_is_where_each_token_starts(server):
    """Echoed prompt and completion, whole and streamed: each token's text at its offset in the
    choice's text (a token ending inside a UTF-8 character is named by its bytes, and the character's
    offset is that of its first byte)."""
    body = {"prompt": "Hello é€ world", "echo": True, "max_tokens": 5, "logprobs": 0, "temperature": 0}
    body |= {"ignore_eos": True}
    choice = post(server, "/v1/completions", body).json()["choices"][0]
    text, lp = choice["text"], choice["logprobs"]
    offsets, tokens = lp["text_offset"], lp["tokens"]
    assert len(offsets) == len(tokens) > 5 and offsets[0] == 0 and offsets == sorted(offsets)
    whole = 0
    for offset, token in zip(offsets, tokens, strict=True):
        if not token.startswith("bytes:"):
            assert text[offset : offset + len(token)] == token
            whole += 1
    assert whole >= 5
    assert offsets[tokens.index(" w")] == len("Hello é€")
    _, events = sse_lines(server, "/v1/completions", body)
    streamed = [o for e in events if e["choices"] for o in e["choices"][0]["logprobs"]["text_offset"]]
    assert streamed == offsets
    plain = post(server, "/v1/completions", body | {"echo": False}).json()["choices"][0]["logprobs"]
    assert plain["text_offset"][0] == 0 and len(plain["text_offset"]) == 5


def test_completions_match_offline_generate(client, offline):
    out = client.completions.create(model=NAME, prompt=PROMPTS[3], max_tokens=12, temperature=0)
    (ref,) = offline.generate(PROMPTS[3], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert out.choices[0].text == ref.text
    assert out.choices[0].finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == len(ref.prompt_token_ids) and out.usage.completion_tokens == len(
        ref.token_ids
    )
    stream = client.completions.create(
        model=NAME,
        prompt=PROMPTS[3],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ref.text
    assert chunks[-1].usage.completion_tokens == len(ref.token_ids)


def test_chat_streaming_and_not(client, offline):
    messages = [{"role": "user", "content": "Tell me a story"}]
    (ref,) = offline.chat(messages, SamplingParams(temperature=0, max_tokens=10), use_tqdm=False)
    out = client.chat.completions.create(model=NAME, messages=messages, max_tokens=10, temperature=0)
    assert out.choices[0].message.content == ref.text and out.choices[0].message.role == "assistant"
    chunks = list(
        client.chat.completions.create(
            model=NAME, messages=messages, max_tokens=10, temperature=0, stream=True
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == ref.text
    assert chunks[-1].choices[0].finish_reason == ref.finish_reason


def test_32_concurrent_streams_equal_offline(server, offline):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    expected = [o.text for o in offline.generate(PROMPTS, params, use_tqdm=False)]

    async def one(aclient: openai.AsyncOpenAI, prompt: str) -> str:
        stream = await aclient.completions.create(
            model=NAME,
            prompt=prompt,
            max_tokens=16,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        return "".join([c.choices[0].text async for c in stream if c.choices])

    async def run() -> list[str]:
        async with openai.AsyncOpenAI(base_url=f"{server}/v1", api_key=KEY, max_retries=0) as aclient:
            return await asyncio.gather(*(one(aclient, p) for p in PROMPTS))

    assert asyncio.run(run()) == expected


def test_n_seed_and_logprobs(client):
    out = client.completions.create(
        model=NAME,
        prompt="Hello",
        max_tokens=6,
        temperature=1.0,
        n=2,
        seed=3,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in out.choices] == [0, 1] and out.usage.completion_tokens == 12
    for choice in out.choices:
        lp = choice.logprobs
        assert len(lp.tokens) == 6 and len(lp.token_logprobs) == 6 and all(v <= 0 for v in lp.token_logprobs)
        assert all(2 <= len(top) <= 3 for top in lp.top_logprobs)
    again = client.completions.create(
        model=NAME,
        prompt="Hello",
        max_tokens=6,
        temperature=1.0,
        n=2,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert [c.text for c in again.choices] == [c.text for c in out.choices]
    chat = client.chat.completions.create(
        model=NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    assert all(c.logprob == max(t.logprob for t in c.top_logprobs) for c in content)


def post(url: str, path: str, body: dict, key: str | None = KEY) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return HTTP.post(f"{url}{path}", json=body, headers=headers)


@pytest.mark.parametrize(
    ("path", "body", "status", "param"),
    [
        ("/v1/completions", {"prompt": "x", "max_tokens": 0}, 400, "max_tokens"),
        ("/v1/completions", {"prompt": "x", "temperature": -1}, 400, "temperature"),
        ("/v1/completions", {"prompt": "x", "top_p": "high"}, 400, "top_p"),
        ("/v1/completions", {"max_tokens": 3}, 400, "prompt"),
        ("/v1/completions", {"prompt": "word " * 600}, 400, "prompt"),
        ("/v1/completions", {"prompt": [1, 2, 100000]}, 400, "prompt"),
        ("/v1/completions", {"prompt": []}, 400, "prompt"),
        ("/v1/completions", {"prompt": "x", "model": "other"}, 404, "model"),
        ("/v1/chat/completions", {"messages": []}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "word " * 600}]}, 400, "messages"),
        ("/v1/chat/completions", {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 0}, 400, "n"),
    ],
)
def test_bad_input_gets_its_status_and_server_keeps_serving(server, path, body, status, param):
    response = post(server, path, body)
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["code"] == status and error["param"] == param and param in error["message"]
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200


def test_auth(server):
    assert post(server, "/v1/completions", {"prompt": "x"}, key=None).status_code == 401
    bad = post(server, "/v1/completions", {"prompt": "x"}, key="wrong")
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error"
    assert HTTP.get(f"{server}/v1/models").status_code == 401
    models = HTTP.get(f"{server}/v1/models", headers={"Authorization": f"Bearer {KEY}"}).json()
    assert models["data"][0]["id"] == NAME and models["data"][0]["max_model_len"] == 512
    assert HTTP.get(f"{server}/health").status_code == 200


def wait_idle(url: str) -> dict:
    deadline = time.time() + 30
    with httpx.Client() as client:  # one for the polls (see `HTTP`)
        while time.time() < deadline:
            info = client.get(f"{url}/server_info").json()
            if (
                info["num_running"] == 0
                and info["num_waiting"] == 0
                and info["available_pages"] == info["total_pages"]
            ):
                return info
            time.sleep(0.1)
    raise AssertionError(f"server never went idle: {info}")


def test_disconnect_mid_stream_frees_resources(server):
    wait_idle(server)
    body = {"prompt": "Once upon a time", "max_tokens": 400, "stream": True, "ignore_eos": True}
    with HTTP.stream(
        "POST", f"{server}/v1/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60
    ) as response:
        lines = response.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(line.startswith("data: ") for line in got)
        info = HTTP.get(f"{server}/server_info").json()
        assert info["num_running"] == 1 and info["free_slots"] == info["total_slots"] - 1
    info = wait_idle(server)
    assert info["free_slots"] == info["total_slots"]
    metrics = HTTP.get(f"{server}/metrics").text
    assert 'hylo_request_success_total{finish_reason="abort"}' in metrics


def test_metrics_expose_serving_figures(server):
    text = HTTP.get(f"{server}/metrics").text
    for name in (
        "hylo_num_requests_running",
        "hylo_num_requests_waiting",
        "hylo_token_usage",
        "hylo_state_slot_usage",
        "hylo_time_to_first_token_seconds_bucket",
        "hylo_inter_token_latency_seconds_bucket",
        "hylo_e2e_request_latency_seconds_bucket",
        "hylo_prompt_tokens_total",
        "hylo_generation_tokens_total",
    ):
        assert name in text, name


def test_prefix_cache_figures_in_metrics_and_server_info(server):
    """The same prompt twice: the second resumes from the first's last full page (16 tokens)."""
    before = wait_idle(server)["prefix_cache"]
    body = {"prompt": "the same long prompt, sent twice " * 6, "max_tokens": 2}
    for _ in range(2):
        assert post(server, "/v1/completions", body).status_code == 200
    after = wait_idle(server)["prefix_cache"]
    assert after["hit_tokens"] >= before["hit_tokens"] + 16 and after["snapshots"] >= 1
    assert after["max_snapshots"] > 0 and after["tokens"] == 16 * after["pages"] > 0
    metrics = HTTP.get(f"{server}/metrics").text
    assert f"hylo_prefix_cache_hit_tokens {float(after['hit_tokens'])}" in metrics
    for name in ("hit_rate", "snapshots", "pages", "evicted_pages", "evicted_snapshots", "query_tokens"):
        assert f"hylo_prefix_cache_{name} " in metrics, name


def test_bench_serve_writes_every_metric(server, tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "hylo.cli",
            "bench",
            "serve",
            "--base-url",
            server,
            "--dataset",
            "random",
            "--num-prompts",
            "8",
            "--random-input-len",
            "12",
            "--random-output-len",
            "6",
            "--api-key",
            KEY,
            "--max-concurrency",
            "4",
            "--output-json",
            str(out),
            "--disable-tqdm",
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "Serving Benchmark Result" in result.stdout
    report = json.loads(out.read_text())
    assert report["completed"] == 8 and report["failed"] == 0 and report["total_output_tokens"] == 48
    for key in (
        "request_throughput",
        "input_throughput",
        "output_throughput",
        "mean_ttft_ms",
        "median_ttft_ms",
        "p99_ttft_ms",
        "mean_tpot_ms",
        "p99_itl_ms",
        "median_e2e_latency_ms",
    ):
        assert report[key] > 0, key


def test_queue_limit_and_graceful_sigterm(model_dir):
    """One request runs, one waits, the others are refused at once with 429. SIGTERM while the
    first still streams and the second still waits: both complete, then the process exits cleanly."""
    proc, url = start_server(model_dir, "--max-running-requests", "1", "--max-queued-requests", "1")
    long = {"prompt": "Once", "max_tokens": 60, "ignore_eos": True, "stream": True}

    async def scenario() -> tuple[list[httpx.Response], httpx.Response, list[dict]]:
        async with (
            httpx.AsyncClient(base_url=url, timeout=120) as c,
            c.stream("POST", "/v1/completions", json=long) as first,
        ):
            lines = first.aiter_lines()
            await anext(lines)
            short = {"prompt": "a", "max_tokens": 2, "ignore_eos": True}  # two tokens, whatever is sampled
            burst = [asyncio.create_task(c.post("/v1/completions", json=short)) for _ in range(4)]
            refused: list[httpx.Response] = []
            waiting = set(burst)
            while len(refused) < 3:
                done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                refused += [task.result() for task in done]
            # the one left waits for the long stream: both are open when the signal comes
            (queued,) = waiting
            proc.send_signal(signal.SIGTERM)
            rest = [json.loads(x[6:]) async for x in lines if x.startswith("data: {")]
            return refused, await queued, rest

    try:
        refused, queued, rest = asyncio.run(scenario())
        assert [r.status_code for r in refused] == [429] * 3
        # a client told to slow down is told for how long (issue 21, defect 9)
        assert all(r.headers["retry-after"] == "1" for r in refused)
        assert queued.status_code == 200 and queued.json()["usage"]["completion_tokens"] == 2
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert proc.wait(timeout=60) == 0
    finally:
        stop(proc)


def test_tokenize_detokenize_and_model_card(server, offline):
    text = "Once upon a time"
    ids = post(server, "/v1/tokenize", {"prompt": text}).json()
    assert ids["tokens"] == offline.tokenizer.encode(text) and ids["count"] == len(ids["tokens"])
    assert ids["max_model_len"] == 512
    bare = post(server, "/v1/tokenize", {"prompt": text, "add_special_tokens": False}).json()["tokens"]
    assert bare == offline.tokenizer.encode(text, add_special_tokens=False)
    assert post(server, "/v1/detokenize", {"tokens": bare}).json() == {"prompt": text}
    bad = post(server, "/v1/detokenize", {"tokens": [100000]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    headers = {"Authorization": f"Bearer {KEY}"}
    card = HTTP.get(f"{server}/v1/models/{NAME}", headers=headers).json()
    assert card["id"] == NAME and card["object"] == "model" and card["max_model_len"] == 512
    missing = HTTP.get(f"{server}/v1/models/other", headers=headers)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model"


def test_logit_bias_steers_sampling(client, offline):
    token = offline.tokenizer.encode(" water", add_special_tokens=False)[0]
    forced = client.completions.create(
        model=NAME, prompt="Hello", max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert forced.choices[0].text == offline.tokenizer.decode([token]) * 4
    # logprobs are of the unbiased model: banning the argmax makes greedy pick a less likely token
    (ref,) = offline.generate("Hello", SamplingParams(temperature=0, max_tokens=1), use_tqdm=False)
    banned = client.completions.create(
        model=NAME,
        prompt="Hello",
        max_tokens=1,
        temperature=0,
        logprobs=1,
        logit_bias={str(ref.token_ids[0]): -100},
    )
    lp = banned.choices[0].logprobs
    assert lp.token_logprobs[0] < max(lp.top_logprobs[0].values())


def test_continuous_usage_stats(server):
    body = {
        "prompt": "Once upon a time",
        "max_tokens": 6,
        "ignore_eos": True,
        "stream": True,
        "n": 2,
        "stream_options": {"include_usage": True, "continuous_usage_stats": True},
    }
    headers = {"Authorization": f"Bearer {KEY}"}
    with HTTP.stream("POST", f"{server}/v1/completions", json=body, headers=headers, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    counts = [c["usage"]["completion_tokens"] for c in chunks if c["choices"]]
    assert counts == sorted(counts) and counts[-1] == 12
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
