"""`POST /v1/messages`, the Anthropic Messages API, run as a chat request (`MessagesRequest.
chat_request`) through the chat route's own path (`start_chat`: template, sampling params,
`tool_choice` grammar, submission) and its reply parser (`--tool-call-parser`, `--reasoning-parser`).

A reply's parsed pieces become content blocks in the order they come: reasoning a `thinking` block,
text a `text` block, each tool call a `tool_use` block; consecutive pieces of one kind share a
block. Streams send Anthropic's events in its order: `message_start`; per block
`content_block_start`, its deltas (`thinking_delta`, `text_delta`, one `input_json_delta`),
`content_block_stop`; `message_delta` (stop reason and usage); `message_stop`. Every error on this
path is in Anthropic's shape (`AnthropicErrors`), with the status the rest of the server gives it.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from hylo.server.async_engine import AsyncEngine
from hylo.server.messages_protocol import MessagesRequest, MessagesResponse
from hylo.server.protocol import ChatCompletionRequest
from hylo.server.runs import ChatRun, RequestFailed, collect, merge, sse, until_disconnect

PATH = "/v1/messages"
# Anthropic's error type of each status (https://docs.claude.com/en/api/errors); another 4xx is an
# invalid_request_error, another 5xx an api_error.
ERROR_TYPES = {
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
}
# the engine's finish reason -> Anthropic's stop reason (a stop is refined by `_stop_reason`)
STOP_REASONS = {"length": "max_tokens", "stop": "end_turn", "abort": "end_turn"}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


class AnthropicErrors:
    """Rewrites every error answer (status 400 or more) of `PATH` from the server's OpenAI shape
    (`{"error": {"message", ...}}`) into Anthropic's, whatever raised it: validation, the body guard,
    the engine, a bug. Other paths pass untouched."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] != PATH:
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def reshaping(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start = message
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body"):
                return
            try:
                error = json.loads(b"".join(chunks))["error"]
                message_text = error["message"] if isinstance(error, dict) else str(error)
            except (ValueError, KeyError, TypeError):
                message_text = b"".join(chunks).decode("utf-8", "replace")
            body = json.dumps(anthropic_error(start["status"], message_text)).encode()
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send(start | {"headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping)


class _Blocks:
    """One reply's content blocks, built from the reply parser's pieces (`add`), each call also
    returning the stream events it makes. Invariant: at most one block is open (`open_kind`), always
    the last of `content`; a tool_use block closes as it opens (its input comes whole)."""

    def __init__(self) -> None:
        self.content: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.called = False

    def add(self, piece: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
        events: list[tuple[str, dict[str, Any]]] = []
        if "tool_calls" in piece:
            for call in piece["tool_calls"]:
                self.called = True
                events += self.close()
                block = {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                         "name": call["function"]["name"], "input": {}}  # fmt: skip
                events.append(self._start(block))
                arguments = call["function"]["arguments"]
                block["input"] = json.loads(arguments)
                delta = {"type": "input_json_delta", "partial_json": arguments}
                events.append(self._delta(delta))
                events += self.close()
            return events
        kind, field, text = (
            ("thinking", "thinking", piece["reasoning_content"])
            if "reasoning_content" in piece
            else ("text", "text", piece["content"])
        )
        if not text:
            return events
        if self.open_kind != kind:
            events += self.close()
            block = (
                {"type": "thinking", "thinking": "", "signature": ""}
                if kind == "thinking"
                else {"type": "text", "text": ""}
            )
            events.append(self._start(block))
            self.open_kind = kind
        self.content[-1][field] += text
        events.append(self._delta({"type": f"{kind}_delta", field: text}))
        return events

    def close(self) -> list[tuple[str, dict[str, Any]]]:
        """The open block's `content_block_stop` (none when no block is open)."""
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [("content_block_stop", {"type": "content_block_stop", "index": len(self.content) - 1})]

    def _start(self, block: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        self.content.append(block)
        self.open_kind = block["type"]
        event = {"type": "content_block_start", "index": len(self.content) - 1, "content_block": dict(block)}
        return "content_block_start", event

    def _delta(self, delta: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        return "content_block_delta", {
            "type": "content_block_delta",
            "index": len(self.content) - 1,
            "delta": delta,
        }


def _cut_stop(text: str, reason: str | None, stops: list[str] | None) -> tuple[str, str | None]:
    """A finished reply's last text without the stop sequence that ended it, and that sequence. The
    engine keeps a stop string whole at the end of the text when asked to include it (the chat
    request does), so one that ends `text` of a `stop` finish is the one that matched."""
    if reason != "stop" or not stops:
        return text, None
    ending = [s for s in stops if text.endswith(s)]
    if not ending:
        return text, None
    stop = max(ending, key=len)
    return text[: len(text) - len(stop)], stop


def _stop_reason(reason: str | None, stop_sequence: str | None, called: bool) -> str:
    if reason == "stop" and called:
        return "tool_use"
    if stop_sequence is not None:
        return "stop_sequence"
    return STOP_REASONS.get(reason or "stop", "end_turn")


def add_messages_route(
    app: FastAPI,
    engine: AsyncEngine,
    model_name: str,
    start_chat: Callable[[ChatCompletionRequest], Awaitable[ChatRun]],
) -> None:
    """`POST /v1/messages` on `app`, with its errors in Anthropic's shape (`AnthropicErrors`)."""
    app.add_middleware(AnthropicErrors)

    @app.post(PATH, response_model=MessagesResponse)
    async def messages(body: MessagesRequest, raw: Request) -> Response:
        # valid by construction: the Messages schema holds each rule the chat request's does
        run = await start_chat(ChatCompletionRequest.model_validate(body.chat_request()))
        parser, blocks = run.parser(), _Blocks()
        stops = body.stop_sequences
        message_id = f"msg_{uuid.uuid4().hex}"

        def pieces(text: str, finished: bool) -> list[dict[str, Any]]:
            return [*parser.feed(text), *(parser.finish() if finished else [])]

        if not body.stream:
            usage = [0, 0]
            (choice,) = await until_disconnect(raw, collect(engine, run.handles, usage))
            text, stop_sequence = _cut_stop(choice.text, choice.finish_reason, stops)
            for piece in pieces(text, True):
                blocks.add(piece)
            reply = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model_name,
                "content": blocks.content,
                "stop_reason": _stop_reason(choice.finish_reason, stop_sequence, blocks.called),
                "stop_sequence": stop_sequence,
                "usage": {"input_tokens": usage[0], "output_tokens": usage[1]},
            }
            return JSONResponse(reply)

        async def events() -> AsyncIterator[str]:
            start = {
                "id": message_id,
                "type": "message",
                "role": "assistant",
                "model": model_name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {"input_tokens": run.prompt_tokens, "output_tokens": 0},
            }
            yield sse({"type": "message_start", "message": start}, "message_start")
            usage = [0, 0]
            reason, stop_sequence = None, None
            try:
                async for _, delta in merge(engine, run.handles, usage):
                    text = delta.text
                    if delta.finish_reason is not None:
                        reason = delta.finish_reason
                        text, stop_sequence = _cut_stop(text, reason, stops)
                    for piece in pieces(text, reason is not None):
                        for name, payload in blocks.add(piece):
                            yield sse(payload, name)
            except RequestFailed as e:
                yield sse(anthropic_error(500, str(e)), "error")
                return
            for name, payload in blocks.close():
                yield sse(payload, name)
            stop = {
                "stop_reason": _stop_reason(reason, stop_sequence, blocks.called),
                "stop_sequence": stop_sequence,
            }
            yield sse(
                {"type": "message_delta", "delta": stop, "usage": {"output_tokens": usage[1]}},
                "message_delta",
            )
            yield sse({"type": "message_stop"}, "message_stop")

        return StreamingResponse(events(), media_type="text/event-stream")
