"""The routes vllm-router and sglang-router call on a worker (issue 43, item 1), in the shapes they
read: /tokenize and /detokenize (a prompt or chat messages), the render routes, /get_load in each
router's shape, the model and server info they register the model by, /flush_cache, the KV events of
vllm-router's kv_aware policy; then the routers themselves in front of two replicas, one of which is
killed last."""

from __future__ import annotations

import concurrent.futures
import contextlib
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import msgpack
import pytest
import zmq
from test_server import HTTP, NAME, free_port, start_server, stop

CONTEXT = 1024  # the replicas' (the router tests' prompts take up to ~620 tokens)
REPLICA_FLAGS = ("--context-length", str(CONTEXT), "--kv-events-endpoint", "tcp://127.0.0.1:0")
SGLANG_LOAD = 2  # the index in `servers` of the one answering /get_load in sglang-router's shape


@pytest.fixture(scope="module")
def servers(shallow_model_dir):
    """The module's three servers, started at once (a start is ~4 s of CPU, mostly imports, and the
    three overlap): two replicas, each publishing its KV events on a port of its choosing (see
    /kv_event_sources), and one with `--get-load-format sglang`. They serve the 3-layer cut of the
    random test model (conftest `shallow_model_dir`): routing does not depend on the depth, and their
    prefills (the cache-aware test's 24 of ~620 tokens) cost ~35% of the 8-layer model's."""
    flag_sets = [REPLICA_FLAGS, REPLICA_FLAGS, ("--get-load-format", "sglang")]
    with concurrent.futures.ThreadPoolExecutor(len(flag_sets)) as pool:
        starts = [pool.submit(start_server, shallow_model_dir, *flags) for flags in flag_sets]
    started = [start.result() for start in starts if start.exception() is None]
    try:
        for start in starts:
            start.result()  # raises the first failed start's error, once the others are stopped
        yield started
    finally:
        for proc, _ in started:
            stop(proc)


@pytest.fixture(scope="module")
def replica_processes(servers):
    return servers[:2]


@pytest.fixture(scope="module")
def replicas(replica_processes):
    return [url for _, url in replica_processes]


@pytest.fixture(scope="module")
def worker(replicas):
    """The first of the module's two replicas: the worker routes need no server of their own."""
    return replicas[0]


def test_tokenize_a_prompt_or_chat_messages_as_vllm_does(worker):
    v1 = HTTP.post(f"{worker}/v1/tokenize", json={"prompt": "story water time"}).json()
    got = HTTP.post(f"{worker}/tokenize", json={"model": NAME, "prompt": "story water time"})
    assert got.status_code == 200
    assert got.json() == v1 and v1["count"] == len(v1["tokens"]) > 0
    messages = [{"role": "user", "content": "story water time"}]
    chat = HTTP.post(f"{worker}/tokenize", json={"messages": messages}).json()
    rendered = HTTP.post(f"{worker}/v1/chat/completions/render", json={"messages": messages}).json()
    assert chat["tokens"] == rendered["token_ids"] and len(chat["tokens"]) > len(v1["tokens"])
    back = HTTP.post(f"{worker}/detokenize", json={"tokens": v1["tokens"]})
    assert back.status_code == 200 and "story water time" in back.json()["prompt"]
    outside = HTTP.post(f"{worker}/detokenize", json={"tokens": [v1["tokens"][0], 10**6]})
    assert outside.status_code == 400 and outside.json()["error"]["param"] == "tokens"
    assert "token id 1000000 is outside the vocabulary" in outside.json()["error"]["message"]
    both = HTTP.post(f"{worker}/tokenize", json={"prompt": "a", "messages": messages})
    assert both.status_code == 400 and "exactly one of prompt and messages" in both.json()["error"]["message"]
    wrong = HTTP.post(f"{worker}/tokenize", json={"model": "other", "prompt": "a"})
    assert wrong.status_code == 404 and wrong.json()["error"]["param"] == "model"


def test_render_routes_answer_vllms_token_in_requests(worker):
    prompts = ["story water", "time book night"]
    got = HTTP.post(
        f"{worker}/v1/completions/render", json={"model": NAME, "prompt": prompts, "temperature": 0.5}
    )
    assert got.status_code == 200
    items = got.json()
    assert isinstance(items, list) and len(items) == 2
    for item, prompt in zip(items, prompts, strict=True):
        ids = HTTP.post(f"{worker}/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
        assert item["token_ids"] == ids
        assert item["model"] == NAME and item["request_id"].startswith("cmpl-")
        assert item["sampling_params"]["temperature"] == 0.5 and item["stream"] is False
    chat = HTTP.post(
        f"{worker}/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "hi"}], "stream": True, "max_completion_tokens": 3},
    ).json()
    assert isinstance(chat, dict) and chat["token_ids"] and chat["stream"] is True
    assert chat["sampling_params"]["max_tokens"] == 3
    bad = HTTP.post(f"{worker}/v1/completions/render", json={"prompt": "a", "temperature": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "temperature"
    vocab = HTTP.post(f"{worker}/v1/completions/render", json={"prompt": [[10**6]]})
    assert vocab.status_code == 400 and vocab.json()["error"]["param"] == "prompt"
    assert "outside the vocabulary" in vocab.json()["error"]["message"]
    stop_ids = HTTP.post(
        f"{worker}/v1/chat/completions/render",
        json={"messages": [{"role": "user", "content": "hi"}], "stop_token_ids": [10**6]},
    )
    assert stop_ids.status_code == 400 and stop_ids.json()["error"]["param"] == "stop_token_ids"


def test_model_and_server_info_name_the_served_model(worker, shallow_model_dir):
    for path in ("/model_info", "/get_model_info"):
        info = HTTP.get(f"{worker}{path}").json()
        assert info["served_model_name"] == NAME and info["model_path"] == str(shallow_model_dir)
        assert info["is_generation"] is True and info["max_model_len"] == CONTEXT
    for path in ("/server_info", "/get_server_info"):
        info = HTTP.get(f"{worker}{path}").json()
        assert info["served_model_name"] == NAME and info["model_path"] == str(shallow_model_dir)
        assert info["max_running_requests"] > 0


def _wait_idle(worker: str) -> None:
    deadline = time.monotonic() + 10
    while HTTP.get(f"{worker}/get_load").json()["load"] and time.monotonic() < deadline:
        time.sleep(0.05)


def _prefix_pages(worker: str) -> int:
    return HTTP.get(f"{worker}/server_info").json()["prefix_cache"]["pages"]


def _running(worker: str, lines, load: object) -> None:
    """Read a stream's events until `/get_load` answers `load` (its request is running)."""
    for _ in range(20):
        next(lines)
        if HTTP.get(f"{worker}/get_load").json() == load:
            return
    raise AssertionError(f"/get_load never answered {load} while a request streamed")


def _long(prompt: str) -> dict:
    return {"prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}


def test_flush_cache_empties_the_prefix_cache_when_idle_and_is_409_while_busy(worker):
    prompt = " ".join(["story water time book night game"] * 12)
    done = HTTP.post(f"{worker}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert done.status_code == 200 and _prefix_pages(worker) > 0
    with HTTP.stream("POST", f"{worker}/v1/completions", json=_long(prompt), timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response (an abort)
        _running(worker, lines, {"load": 1})
        busy = HTTP.post(f"{worker}/flush_cache")
        assert busy.status_code == 409 and "running" in busy.json()["error"]["message"]
        assert _prefix_pages(worker) > 0
    _wait_idle(worker)  # the stream closed: the request is aborted within a step or two
    flushed = HTTP.post(f"{worker}/flush_cache")
    assert flushed.status_code == 200, flushed.text
    assert _prefix_pages(worker) == 0
    again = HTTP.post(f"{worker}/v1/completions", json={"prompt": prompt, "max_tokens": 2})
    assert again.status_code == 200 and _prefix_pages(worker) > 0


def test_get_load_counts_open_requests_in_vllm_routers_shape(worker):
    _wait_idle(worker)
    assert HTTP.get(f"{worker}/get_load").json() == {"load": 0}
    prompt = " ".join(["story water"] * 8)
    with HTTP.stream("POST", f"{worker}/v1/completions", json=_long(prompt), timeout=60) as stream:
        lines = stream.iter_lines()  # kept: a dropped line iterator closes the response (an abort)
        _running(worker, lines, {"load": 1})
    _wait_idle(worker)  # the worker is a replica of the router tests, which count what each finished


def test_get_load_in_sglang_routers_shape_with_the_flag(servers):
    url = servers[SGLANG_LOAD][1]
    idle = {"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}
    assert HTTP.get(f"{url}/get_load").json() == [idle]
    with HTTP.stream("POST", f"{url}/v1/completions", json=_long("story water time"), timeout=60) as s:
        lines = s.iter_lines()
        for _ in range(20):
            next(lines)
            (entry,) = HTTP.get(f"{url}/get_load").json()
            if entry["num_reqs"] == 1:
                break
        assert entry["num_reqs"] == 1 and entry["num_tokens"] > 0, entry


# --- the routers themselves (vllm-router, sglang-router: Rust binaries from the test extras) in front
# of two CPU replicas


def _router(binary: str, *args: str) -> tuple[subprocess.Popen, str]:
    exe = shutil.which(binary) or str(Path(sys.executable).parent / binary)
    if not Path(exe).exists():
        pytest.skip(f"{binary} is not installed (pip install -e '.[dev]')")
    port = free_port()
    # each its own metrics port: both routers' default is 29000, and the module's round-robin router
    # runs beside the others
    metrics = ("--prometheus-port", str(free_port()))
    proc = subprocess.Popen(
        [exe, *args, "--host", "127.0.0.1", "--port", str(port), *metrics],
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
            if HTTP.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return proc, url
        time.sleep(0.2)
    stop(proc)
    raise RuntimeError(f"{binary} did not start: {proc.stdout.read()[-3000:]}")


def _served(url: str) -> float:
    """Requests this replica has finished (its `hylo_request_success` counters)."""
    text = HTTP.get(f"{url}/metrics").text
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

            def ask(i, prefix=prefix):
                return HTTP.post(
                    f"{router}/v1/completions",
                    json={"model": NAME, "prompt": f"{prefix} question {i}", "max_tokens": 1},
                    timeout=60,
                )

            # the router learns a prefix as it routes it: the first request goes alone (first arrivals of a
            # new prefix at once can each find it unknown and be balanced apart), the other five together
            answers = [ask(0)]
            with concurrent.futures.ThreadPoolExecutor(4) as pool:
                answers += list(pool.map(ask, range(1, 6)))
            assert all(a.status_code == 200 for a in answers), [a.text for a in answers]
            landed = [_served(url) - b for url, b in zip(replicas, before, strict=True)]
            assert sorted(landed) == [0, 6], f"prefix {p} was split across the replicas: {landed}"
    finally:
        stop(proc)


def _kv_endpoint(url: str) -> str:
    (source,) = HTTP.get(f"{url}/kv_event_sources").json().values()
    assert source["topic"] == "" and source["replay_endpoint"] is None
    return source["endpoint"]


def test_kv_events_reach_a_subscriber_in_vllms_wire_format(replicas):
    """A prompt's full pages but the last token's are announced in one BlockStored chain (the prefix
    cache keeps them once the prefill ends); /flush_cache's AllBlocksCleared follows in the next batch."""
    url = replicas[0]
    info = HTTP.get(f"{url}/server_info").json()
    assert info["kv_block_size"] == info["config"]["page_size"] == 16
    subscriber = zmq.Context.instance().socket(zmq.SUB)
    subscriber.setsockopt(zmq.LINGER, 0)
    subscriber.setsockopt(zmq.RCVTIMEO, 10_000)
    subscriber.connect(_kv_endpoint(url))
    subscriber.setsockopt(zmq.SUBSCRIBE, b"")
    try:
        time.sleep(0.5)  # ZMQ drops what is published before the subscription reaches the publisher
        prompt = " ".join(["lamp", "harbor", "violet"] * 30)
        ids = HTTP.post(f"{url}/v1/tokenize", json={"prompt": prompt}).json()["tokens"]
        done = HTTP.post(f"{url}/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=60)
        assert done.status_code == 200
        topic, seq, payload = subscriber.recv_multipart()
        ts, events, rank = msgpack.unpackb(payload)
        assert topic == b"" and rank == 0 and abs(ts - time.time()) < 60
        (stored,) = [e for e in events if e["type"] == "BlockStored"]
        cached = (len(ids) - 1) // 16 * 16  # the last token is always computed: it gives the logits
        assert stored["parent_block_hash"] is None and stored["token_ids"] == ids[:cached]
        assert len(stored["block_hashes"]) == cached // 16 and stored["block_size"] == 16
        assert stored["medium"] == "CPU"
        assert HTTP.post(f"{url}/flush_cache").status_code == 200
        topic, next_seq, payload = subscriber.recv_multipart()
        assert int.from_bytes(next_seq, "big") == int.from_bytes(seq, "big") + 1
        assert msgpack.unpackb(payload)[1] == [{"type": "AllBlocksCleared"}]
    finally:
        subscriber.close()


def test_vllm_router_kv_aware_sends_a_prefix_to_the_replica_holding_it(replicas):
    """Each prefix is computed on one replica (sent to it directly, alternately to each); the router,
    subscribed to both replicas' KV events (vllm-router 0.1.17 subscribes to an HTTP worker's events
    only from static sources), then sends every request sharing the prefix to that replica."""
    sources = [arg for url in replicas for arg in ("--kv-event-source", f"{url}={_kv_endpoint(url)}")]
    proc, router = _router(
        "vllm-router",
        "--worker-urls",
        *replicas,
        "--policy",
        "kv_aware",
        "--kv-event-model",
        NAME,
        "--kv-event-block-size",
        "16",
        *sources,
    )
    words = ["amber", "cedar", "delta", "ember", "fjord", "grove", "haven", "ivory"]
    try:
        time.sleep(0.5)  # the router's subscriptions reach the replicas' publishers
        for p, holder in enumerate([1, 0, 1, 0]):  # a fallback that prefers one replica fails half
            prefix = " ".join(words[(p + i) % len(words)] + str(p) for i in range(60))
            warm = HTTP.post(f"{replicas[holder]}/v1/completions", json={"prompt": prefix, "max_tokens": 1})
            assert warm.status_code == 200
            time.sleep(0.3)  # the batch reaches the router (sent within the step, read every 10 ms)
            before = [_served(url) for url in replicas]
            for i in range(2):
                got = HTTP.post(
                    f"{router}/v1/completions",
                    json={"model": NAME, "prompt": f"{prefix} question {i}", "max_tokens": 1},
                    timeout=60,
                )
                assert got.status_code == 200, got.text
            landed = [_served(url) - b for url, b in zip(replicas, before, strict=True)]
            assert landed[holder] == 2, f"prefix {p}, computed on replica {holder}, landed {landed}"
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
                streams.enter_context(HTTP.stream("POST", f"{busy}/v1/completions", json=body)).iter_lines()
                for _ in range(3)
            ]
            for line in lines:
                next(line)
            assert HTTP.get(f"{busy}/get_load").json() == {"load": 3}
            loads = {w["worker"]: w["load"] for w in HTTP.get(f"{router}/get_loads").json()["workers"]}
            assert loads == {busy: 3, idle: 0}  # what the router reads from each worker's /get_load
            time.sleep(2.5)  # its power_of_two polls them every --worker-startup-check-interval s
            before = _served(idle)
            for i in range(4):
                got = HTTP.post(
                    f"{router}/v1/completions", json={"prompt": f"hello {i}", "max_tokens": 1}, timeout=60
                )
                assert got.status_code == 200, got.text
            assert _served(idle) - before == 4
        finally:
            stop(proc)


@pytest.fixture(scope="module")
def round_robin_router(replicas):
    """vllm-router round robin over both replicas, checking their health every second (two failures
    mark a worker unhealthy: its --health-* flags): the flush and the killed-replica tests share it."""
    proc, router = _router(
        "vllm-router",
        "--worker-urls",
        *replicas,
        "--policy",
        "round_robin",
        "--health-check-interval-secs",
        "1",
        "--health-failure-threshold",
        "2",
        "--health-check-timeout-secs",
        "1",
    )
    yield router
    stop(proc)


def test_sglang_router_registers_the_served_model_and_both_routers_flush(replicas, round_robin_router):
    proc, router = _router("sglang-router", "launch", "--worker-urls", *replicas, "--policy", "round_robin")
    try:
        models = HTTP.get(f"{router}/v1/models").json()
        assert [m["id"] for m in models["data"]] == [NAME]
        got = HTTP.post(f"{router}/v1/completions", json={"model": NAME, "prompt": "hi", "max_tokens": 1})
        assert got.status_code == 200, got.text
        flushed = HTTP.post(f"{router}/flush_cache", timeout=30)
        assert flushed.status_code // 100 == 2, flushed.text
    finally:
        stop(proc)
    flushed = HTTP.post(f"{round_robin_router}/flush_cache", timeout=30)
    assert flushed.status_code // 100 == 2, flushed.text
    assert all(HTTP.get(f"{url}/server_info").json()["prefix_cache"]["pages"] == 0 for url in replicas)


def _finished(lines) -> bool:
    """Read a stream to its end: True if it finished (its last chunk with finish reason `length`, then
    `[DONE]`), False if it was cut short (the connection broken, or closed before `[DONE]`)."""
    seen = []
    with contextlib.suppress(httpx.HTTPError):
        seen.extend(line.removeprefix("data: ") for line in lines if line)
    if len(seen) < 2 or seen[-1] != "[DONE]":
        return False
    return json.loads(seen[-2])["choices"][0]["finish_reason"] == "length"


def _health(router: str) -> dict[str, bool]:
    return {w["url"]: w["is_healthy"] for w in HTTP.get(f"{router}/workers").json()["workers"]}


def test_vllm_router_keeps_serving_when_a_replica_is_killed_mid_run(replica_processes, round_robin_router):
    """Last in the file: it SIGKILLs replica 1 of the module's pair. Four streams through the module's
    round-robin router (two on each replica) are running; after the kill, the router's health check
    (every second, two failures mark a worker unhealthy) reports the victim unhealthy in `/workers`
    within seconds; new requests all go to the survivor and succeed; the survivor's two streams
    finish, the victim's two end cut short."""
    (_, survivor), (victim_proc, victim) = replica_processes
    router = round_robin_router
    # long enough to outlast opening the four and reading the loads (a few steps), short enough that
    # the survivor's two finish soon after
    body = {"prompt": "story water time", "max_tokens": 64, "ignore_eos": True, "stream": True}
    with contextlib.ExitStack() as streams:
        lines = [
            streams.enter_context(
                HTTP.stream("POST", f"{router}/v1/completions", json=body, timeout=60)
            ).iter_lines()
            for _ in range(4)
        ]
        for line in lines:
            next(line)  # every stream is running (kept: a dropped iterator aborts its request)
        loads = [HTTP.get(f"{url}/get_load").json()["load"] for url in (survivor, victim)]
        assert loads == [2, 2], loads
        before = _served(survivor)
        victim_proc.kill()
        killed = time.monotonic()
        while _health(router)[victim] and time.monotonic() - killed < 15:
            time.sleep(0.1)
        marked = time.monotonic() - killed
        assert _health(router) == {survivor: True, victim: False}, f"{marked:.1f} s after the kill"
        print(f"vllm-router marked the killed replica unhealthy {marked:.1f} s after the kill")
        for i in range(4):
            got = HTTP.post(
                f"{router}/v1/completions", json={"prompt": f"hi {i}", "max_tokens": 1}, timeout=60
            )
            assert got.status_code == 200, got.text
        finished = [_finished(line) for line in lines]
    assert sorted(finished) == [False, False, True, True], finished
    assert _served(survivor) - before == 4 + 2  # the new requests and its own two streams
