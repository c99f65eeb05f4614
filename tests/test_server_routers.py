"""The routes vllm-router and sglang-router call on a worker (issue 43, item 1), in the shapes they
read: /tokenize and /detokenize (a prompt or chat messages), the render routes, /get_load in each
router's shape, the model and server info they register the model by, /flush_cache."""

from __future__ import annotations

import concurrent.futures
import contextlib
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from test_server import NAME, free_port, start_server, stop


@pytest.fixture(scope="module")
def worker(model_dir):
    proc, url = start_server(model_dir, "--context-length", "512")
    yield url
    stop(proc)


def test_tokenize_a_prompt_or_chat_messages_as_vllm_does(worker):
    v1 = httpx.post(f"{worker}/v1/tokenize", json={"prompt": "story water time"}).json()
    got = httpx.post(f"{worker}/tokenize", json={"model": NAME, "prompt": "story water time"})
    assert got.status_code == 200
    assert got.json() == v1 and v1["count"] == len(v1["tokens"]) > 0
    messages = [{"role": "user", "content": "story water time"}]
    chat = httpx.post(f"{worker}/tokenize", json={"messages": messages}).json()
    rendered = httpx.post(f"{worker}/v1/chat/completions/render", json={"messages": messages}).json()
    assert chat["tokens"] == rendered["token_ids"] and len(chat["tokens"]) > len(v1["tokens"])
    back = httpx.post(f"{worker}/detokenize", json={"tokens": v1["tokens"]})
    assert back.status_code == 200 and "story water time" in back.json()["prompt"]
    both = httpx.post(f"{worker}/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400 and "exactly one of prompt and messages" in both.json()["error"]["message"]
    wrong = httpx.post(f"{worker}/tokenize", json={"model": "other", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_render_routes_answer_vllms_token_in_requests(worker):
    prompts = ["story water", "time book night"]
    got = httpx.post(
        f"{worker}/v1/completions/render", json={"model": NAME, "prompt": prompts, "temperature": 0.5}
    )
    assert got.status_code == 200
    items = got.json()
    assert isinstance(items, list) and len(items) == 2
    for item, prompt in zip(items, prompts, strict=True):
        ids = httpx.post(f"{worker}/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert item["token_ids"] == ids
        assert item["model"] == NAME and item["request_id"].startswith("cmpl-")
        assert item["sampling_params"]["temperature"] == 0.5 and item["stream"] is False
    chat = httpx.post(
        f"{worker}/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 3},
    ).json()
    assert isinstance(chat, dict) and chat["token_ids"] and chat["stream"] is True
    assert chat["sampling_params"]["max_tokens"] == 3
    bad = httpx.post(f"{worker}/v1/completions/render", json={"prompt": "a", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    vocab = httpx.post(f"{worker}/v1/completions/render", json={"prompt": [[10**6]]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "prompt"
    assert "outside the vocabulary" in vocab.json()["error"]["message"]
    stop_ids = httpx.post(
        f"{worker}/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**6]},
    )
    assert stop_ids.status_code == 400 and stop_ids.json()["error"]["param"] == "stop_token_ids"


def test_model_and_server_info_name_the_served_model(worker, model_dir):
    for path in ("/model_info", "/get_model_info"):
        info = httpx.get(f"{worker}{path}").json()
        assert info["served_model_name"] == NAME and info["model_path"] == str(model_dir)
        assert info["is_generation"] is True and info["max_model_len"] == 512
    for path in ("/server_info", "/get_server_info"):
        info = httpx.get(f"{worker}{path}").json()
        assert info["served_model_name"] == NAME and info["model_path"] == str(model_dir)
        assert info["max_running_requests"] > 0


def _wait_idle(worker: str) -> None:
    deadline = time.monotonic() + 10
    while httpx.get(f"{worker}/get_load").json()["load"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _prefix_pages(worker: str) -> int:
    return httpx.get(f"{worker}/server_info").json()["prefix_cache"]["pages"]


def _running(worker: str, lines, load: object) -> None:
    """Read a stream's events until `/get_load` answers `load` (its request is running)."""
    for _ in range(20):
        next(lines)
        if httpx.get(f"{worker}/get_load").json() == load:
            return
    raise AssertionError(f"/get_load never answered {load} while a request streamed")


def _long(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_flush_cache_empties_the_prefix_cache_when_idle_and_is_409_while_busy(worker):
    prompt = " ".join(["story water time book night game"] * 12)
    done = httpx.post(f"{worker}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert done.status_code == 200 and _prefix_pages(worker) > 0
    with httpx.stream("POST", f"{worker}/v1/completions", json=_long(prompt), timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response (an abort)
        _running(worker, lines, {"load": 1})
        busy = httpx.post(f"{worker}/flush_cache")
        assert busy.status_code == 409 and "running" in busy.json()["error"]["message"]
        assert _prefix_pages(worker) > 0
    _wait_idle(worker)  # the stream closed: the request is aborted within a step or two
    flushed = httpx.post(f"{worker}/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert _prefix_pages(worker) == 0
    again = httpx.post(f"{worker}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert again.status_code == 200 and _prefix_pages(worker) > 0


def test_get_load_counts_open_requests_in_vllm_routers_shape(worker):
    _wait_idle(worker)
    assert httpx.get(f"{worker}/get_load").json() == {"load": 0}
    prompt = " ".join(["story water"] * 8)
    with httpx.stream("POST", f"{worker}/v1/completions", json=_long(prompt), timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response (an abort)
        _running(worker, lines, {"load": 1})


def test_get_load_in_sglang_routers_shape_with_the_flag(model_dir):
    proc, url = start_server(model_dir, "--get-load-format", "sglang")
    try:
        idle = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
        assert httpx.get(f"{url}/get_load").json() == [idle]
        with httpx.stream("POST", f"{url}/v1/completions", json=_long("story water time"), timeout=60) as s:
            lines = s.iter_lines()
            for _ in range(20):
                next(lines)
                (entry,) = httpx.get(f"{url}/get_load").json()
                if entry["num_reqs"] == 1:
                    break
            assert entry["num_reqs"] == 1 and entry["num_tokens"] > 0, entry
    finally:
        stop(proc)


# --- the routers themselves (vllm-router, sglang-router: Rust binaries from the test extras) in front
# of two CPU replicas


def _router(binary: str, *args: str) -> tuple[subprocess.Popen, str]:
    exe = shutil.which(binary) or str(Path(sys.executable).parent / binary)
    if not Path(exe).exists():
        pytest.skip(f"{binary} is not installed (pip install -e '.[dev]')")
    port = free_port()
    proc = subprocess.Popen(
        [exe, *args, "--host", "127.0.0.1", "--port", str(port)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{binary} exited: {proc.stdout.read()[-3000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{binary} did not start: {proc.stdout.read()[-3000:]}")


@pytest.fixture(scope="module")
def replicas(model_dir):
    procs = [start_server(model_dir, "--context-length", "1024") for _ in range(2)]
    yield [url for _, url in procs]
    for proc, _ in procs:
        stop(proc)


def _served(url: str) -> float:
    """Requests this replica has finished (its `hylo_request_success` counters)."""
    text = httpx.get(f"{url}/metrics").text
    return sum(
        float(line.split()[-1]) for line in text.splitlines() if line.startswith("hylo_request_success_total")
    )


def test_vllm_router_cache_aware_keeps_each_prefix_on_one_replica(replicas):
    proc, router = _router("vllm-router", "--worker-urls", *replicas, "--policy", "cache_aware")
    words = ["story", "water", "time", "book", "night", "game", "river", "stone"]
    try:
        for p in range(4):
            prefix = " ".join(words[(p + i) % len(words)] + str(p) for i in range(120))
            before = [_served(url) for url in replicas]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers = list(
                    pool.map(
                        lambda i, prefix=prefix: httpx.post(
                            f"{router}/v1/completions",
                            json={"model": NAME, "prompt": f"{prefix} question {i}", "max_tokens": 1},
                            timeout=60,
                        ),
                        range(6),
                    )
                )
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            landed = [_served(url) - b for url, b in zip(replicas, before, strict=True)]
            assert sorted(landed) == [0, 6], f"prefix {p} was split across the replicas: {landed}"
    finally:
        stop(proc)


def test_vllm_router_power_of_two_reads_the_load(replicas):
    """Replica 0 holds three long streams (sent to it directly): the router's power_of_two sends the
    next requests to replica 1, whose `/get_load` is lower."""
    proc, router = _router(
        "vllm-router",
        "--worker-urls",
        *replicas,
        "--policy",
        "power_of_two",
        "--worker-startup-check-interval",
        "1",
    )
    busy, idle = replicas
    body = {"prompt": "story water time", "max_tokens": 400, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as streams:
        try:
            # each stream's line iterator is kept: a dropped one closes its response (an abort)
            lines = [
                streams.enter_context(httpx.stream("POST", f"{busy}/v1/completions", json=body)).iter_lines()
                for _ in range(3)
            ]
            for line in lines:
                next(line)
            assert httpx.get(f"{busy}/get_load").json() == {"load": 3}
            loads = {w["worker"]: w["load"] for w in httpx.get(f"{router}/get_loads").json()["workers"]}
            assert loads == {busy: 3, idle: 0}  # what the router reads from each worker's /get_load
            time.sleep(2.5)  # its power_of_two polls them every --worker-startup-check-interval s
            before = _served(idle)
            for i in range(4):
                got = httpx.post(
                    f"{router}/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 1}, timeout=60
                )
                assert got.status_code == 200, got.text
            assert _served(idle) - before == 4
        finally:
            stop(proc)


def test_sglang_router_registers_the_served_model_and_both_routers_flush(replicas):
    proc, router = _router("sglang-router", "launch", "--worker-urls", *replicas, "--policy", "round_robin")
    try:
        models = httpx.get(f"{router}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [NAME]
        got = httpx.post(f"{router}/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1})
        assert got.status_code == 200, got.text
        flushed = httpx.post(f"{router}/flush_cache", timeout=30)
        assert flushed.status_code // 100 == 2, flushed.text
    finally:
        stop(proc)
    proc, router = _router("vllm-router", "--worker-urls", *replicas, "--policy", "round_robin")
    try:
        flushed = httpx.post(f"{router}/flush_cache", timeout=30)
        assert flushed.status_code // 100 == 2, flushed.text
        assert all(httpx.get(f"{url}/server_info").json()["prefix_cache"]["pages"] == 0 for url in replicas)
    finally:
        stop(proc)
