"""The routes vllm-router and sglang-router call on a worker (issue 43, item 1), in the shapes they
read: /tokenize and /detokenize (a prompt or chat messages), the render routes, /get_load in each
router's shape, the model and server info they register the model by, /flush_cache."""

from __future__ import annotations

import time

import httpx
import pytest
from test_server import NAME, start_server, stop


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
        _running(worker, stream.iter_lines(), {"load": 1})
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
        _running(worker, stream.iter_lines(), {"load": 1})


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
