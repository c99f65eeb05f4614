"""What a connection may hold (issue 47, item 7): a request's headers and body must arrive in time
(a half-sent request is answered 408 and closed, an idle new connection closed), connections beyond
`--limit-concurrency` get a clear 503, and HEAD is answered wherever GET is."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from test_server import NAME, start_server, stop

HEADER_S = BODY_S = 1.0
MAX_CONNECTIONS = 4


@pytest.fixture(scope="module")
def server(model_dir):
    proc, url = start_server(
        model_dir,
        "--timeout-request-header", str(HEADER_S), "--timeout-request-body", str(BODY_S),
        "--limit-concurrency", str(MAX_CONNECTIONS), "--timeout-keep-alive", "60",
    )  # fmt: skip
    yield url
    stop(proc)


def send_then_read(url: str, data: bytes) -> tuple[bytes, float]:
    """What the server answers a connection that sends `data` and nothing more, until it closes
    the connection, and how long that took (a socket timeout if it never does)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10 * HEADER_S) as sock:
        start = time.monotonic()
        sock.sendall(data)
        received = b""
        while chunk := sock.recv(65536):
            received += chunk
        return received, time.monotonic() - start


def error_of(answer: bytes, status: int) -> dict:
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode()), answer
    assert b"connection: close" in head.lower()
    error = json.loads(body)["error"]
    assert error["code"] == status
    return error


def test_half_sent_headers_and_idle_connections_are_closed_in_time(server):
    answer, took = send_then_read(server, b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Ty")
    assert "--timeout-request-header" in error_of(answer, 408)["message"]
    assert HEADER_S * 0.9 <= took < HEADER_S + 3
    answer, took = send_then_read(server, b"")  # connected, never a byte: closed, nothing to say
    assert answer == b"" and took < HEADER_S + 3


def test_half_sent_body_gets_408_and_is_closed(server):
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    answer, took = send_then_read(server, head + b'Content-Length: 40\r\n\r\n{"prompt": "x", ')
    assert "--timeout-request-body" in error_of(answer, 408)["message"]
    assert BODY_S * 0.9 <= took < BODY_S + 3
    assert httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 1}).status_code == 200


def test_a_connection_beyond_the_limit_gets_503(server):
    """Connections held open (kept alive after a request) count; one more is refused with a 503
    and Retry-After and closed; once one closes, the next is served."""
    held = [httpx.Client(base_url=server) for _ in range(MAX_CONNECTIONS)]
    try:
        for client in held:
            assert client.get("/health").status_code == 200
        refused = httpx.get(f"{server}/health")
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.headers["connection"] == "close"
        assert "--limit-concurrency" in refused.json()["error"]["message"]
        held.pop().close()
        deadline = time.monotonic() + 5
        while (status := httpx.get(f"{server}/health").status_code) != 200 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert status == 200
    finally:
        for client in held:
            client.close()


def test_head_is_answered_wherever_get_is(server):
    """Every GET operation of the schema has its HEAD: the same status and headers, no body."""
    paths = httpx.get(f"{server}/openapi.json").json()["paths"]
    # a stored response's route is covered by tests/test_responses.py (no response is stored here)
    gets = [
        p.replace("{model_id}", NAME) for p, ops in paths.items() if "get" in ops and "{response_id}" not in p
    ]
    assert {"/health", "/metrics", "/v1/models", f"/v1/models/{NAME}"} <= set(gets)
    for path, ops in paths.items():
        assert ("head" in ops) == ("get" in ops), path
    for path in [*gets, "/openapi.json"]:
        get, head = httpx.get(f"{server}{path}"), httpx.head(f"{server}{path}")
        assert head.status_code == get.status_code == 200, path
        assert head.content == b"" and head.headers.get("content-type") == get.headers.get("content-type")
    assert httpx.head(f"{server}/v1/models/other").status_code == 404
    assert httpx.head(f"{server}/v1/completions").status_code == 405
