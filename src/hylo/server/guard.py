"""The ASGI guard in front of the app: the API key on /v1 routes and the body-size limit.

A plain ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: behind that one,
`Request.is_disconnected()` never fires, so abandoned non-streaming requests would run to the end."""

from __future__ import annotations

import json
from collections.abc import Mapping

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hylo.server.protocol import error_body


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
    def __init__(self, app: ASGIApp, api_key: str | None, max_body_bytes: int):
        self.app, self.api_key, self.max_body_bytes = app, api_key, max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        guarded = self.api_key is not None and scope["path"].startswith("/v1")
        if guarded and headers.get("authorization") != f"Bearer {self.api_key}":
            response = error_response(401, "missing or invalid API key", "authentication_error")
            await response(scope, receive, send)
            return
        declared = headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._too_large(scope, receive, send)
            return
        body = bytearray()
        while True:  # a chunked body has no length: read it, up to the limit
            message = await receive()
            if message["type"] != "http.request":
                break
            body += message.get("body", b"")
            if len(body) > self.max_body_bytes:
                await self._too_large(scope, receive, send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(bytes(body), receive), send)

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
