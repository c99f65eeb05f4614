"""What stands between a client and the app. Per connection (`GuardedHTTP`, uvicorn's HTTP/1.1
protocol): the time a request's headers may take and the number of open connections. Per request
(`Guard`, an ASGI middleware): the API key on /v1 routes, the body's size and the time it may take.

`Guard` is a plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: behind that one,
`Request.is_disconnected()` never fires, so abandoned non-streaming requests would run to the end."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import h11
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send
from uvicorn.protocols.http.h11_impl import H11Protocol

from hylo.server.protocol import error_body

# What a client told to slow down (429) or refused by a full server (503) should wait, in seconds.
RETRY_AFTER_S = 1


def error_response(
    status: int,
    message: str,
    kind: str = "invalid_request_error",
    param: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> Response:
    """An OpenAI-format error. ASCII-escaped JSON: a message may quote input that is not valid
    Unicode (a lone surrogate), which UTF-8 cannot encode."""
    body = json.dumps(error_body(message, kind, status, param))
    return Response(body, status, headers=dict(headers or {}), media_type="application/json")


class Guard:
    def __init__(
        self, app: ASGIApp, api_key: str | None, max_body_bytes: int, body_timeout: float | None = None
    ):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        guarded = self.api_key is not None and scope["path"].startswith("/v1")
        # the key as a bearer token (OpenAI clients) or in `x-api-key` (Anthropic clients)
        given = (headers.get("authorization"), headers.get("x-api-key"))
        if guarded and given[0] != f"Bearer {self.api_key}" and given[1] != self.api_key:
            response = error_response(401, "missing or invalid API key", "authentication_error")
            await response(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        try:
            async with asyncio.timeout(self.body_timeout):
                body = await self._body(receive)
        except TimeoutError:
            message = (
                f"the request body did not arrive within {self.body_timeout:g} s of its headers "
                "(--timeout-request-body)"
            )
            await error_response(408, message, headers={"Connection": "close"})(scope, receive, send)
            return
        if body is None:
            await self._too_large(scope, receive, send)
            return
        await self.app(scope, _replay(body, receive), send)

    async def _body(self, receive: Receive) -> bytes | None:
        """The whole body, or None past the size limit (a chunked body has no length: it is counted
        as it arrives)."""
        body = bytearray()
        while True:
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                return None
            if not message.get("more_body", False):
                break
        return bytes(body)

    async def _too_large(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"the request body is larger than {self.max_body_bytes} bytes (--max-request-bytes)"
        await error_response(413, message)(scope, receive, send)


def _replay(body: bytes, receive: Receive) -> Receive:
    """The body read by the guard, then the real channel (which reports a disconnect)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


class GuardedHTTP(H11Protocol):
    """uvicorn's HTTP/1.1 protocol, plus what uvicorn lacks: a request's headers must arrive within
    `header_timeout` seconds of the connection opening (or, on a kept-alive connection, of the
    request's first byte), else the connection is closed (with a 408 if part of a request came);
    while `max_connections` others are open, a new connection's request gets a 503 and the
    connection closes. `with_limits` makes the class uvicorn is given (`uvicorn.Config(http=...)`)."""

    header_timeout: float = 10.0
    max_connections: int | None = None

    @classmethod
    def with_limits(cls, header_timeout: float, max_connections: int | None) -> type[GuardedHTTP]:
        return type(
            cls.__name__, (cls,), {"header_timeout": header_timeout, "max_connections": max_connections}
        )

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._headers_due: asyncio.TimerHandle | None = None
        if self.max_connections is not None and len(self.connections) > self.max_connections:
            self.app = _full(self.max_connections)
        self._await_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        if self.conn.their_state is h11.IDLE:  # (part of) the next request's headers
            self._await_headers()
        elif self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None

    def connection_lost(self, exc: Exception | None) -> None:
        if self._headers_due is not None:
            self._headers_due.cancel()
            self._headers_due = None
        super().connection_lost(exc)

    def _await_headers(self) -> None:
        if self._headers_due is None:
            self._headers_due = self.loop.call_later(self.header_timeout, self._headers_late)

    def _headers_late(self) -> None:
        self._headers_due = None
        if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
            return
        if self.conn.trailing_data[0]:  # part of a request came: say why the connection closes
            message = (
                f"the request headers did not arrive within {self.header_timeout:g} s "
                "(--timeout-request-header)"
            )
            self.transport.write(_raw_error(408, "Request Timeout", message))
        self.transport.close()


def _full(max_connections: int) -> ASGIApp:
    """The app of a connection opened while `max_connections` others were: a 503, then close."""
    message = f"the server has {max_connections} open connections (--limit-concurrency); retry later"
    headers = {"Retry-After": str(RETRY_AFTER_S), "Connection": "close"}
    return error_response(503, message, "service_unavailable", headers=headers)


def _raw_error(status: int, reason: str, message: str) -> bytes:
    """An OpenAI-format error as raw HTTP/1.1 bytes, for a connection whose request never parsed."""
    body = json.dumps(error_body(message, "invalid_request_error", status)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body
