"""`POST /v1/responses`, OpenAI's Responses API, run as a chat request (`ResponsesRequest.
chat_request`) through the chat route's own path (`start_chat`: template, sampling params,
`tool_choice` grammar, structured outputs, submission) and its reply parser (`--tool-call-parser`,
`--reasoning-parser`); `GET` and `DELETE /v1/responses/{id}` over the bounded `ResponseStore`.

A reply's parsed pieces become output items in the order they come: reasoning a `reasoning` item
(its text in one `reasoning_text` part), text a `message` item (one `output_text` part), each tool
call a `function_call` item; consecutive pieces of one kind share an item. A stream sends OpenAI's
typed events, each with its `sequence_number` (0, 1, ...): `response.created`,
`response.in_progress`; per item `response.output_item.added`, then for a message or reasoning
`response.content_part.added`, its text's deltas (`response.output_text.delta` /
`response.reasoning_text.delta`), the text's `.done`, `response.content_part.done`, for a call one
`response.function_call_arguments.delta` with the whole arguments and its `.done`; then
`response.output_item.done`; last `response.completed`, or `response.incomplete` (max_output_tokens,
or aborted by the server's shutdown), or `response.failed` (the engine failed the request)."""

from __future__ import annotations

import copy
import itertools
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hylo.server.async_engine import AsyncEngine
from hylo.server.protocol import ChatCompletionRequest
from hylo.server.responses_protocol import (
    INPUT_ITEMS,
    FunctionToolChoice,
    ResponseDeleted,
    ResponseObject,
    ResponsesRequest,
)
from hylo.server.responses_store import ResponseStore, StoredResponse
from hylo.server.runs import APIError, ChatRun, RequestFailed, collect, merge, until_disconnect

PATH = "/v1/responses"
# a field of the chat request a Responses request runs as -> the Responses field it comes from (the
# 400s of `start_chat` name the chat field)
CHAT_FIELDS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "response_format": "text.format",
    "reasoning_effort": "reasoning.effort",
}
# the engine's finish reason -> the response's status
STATUSES = {"stop": "completed", "length": "incomplete", "abort": "cancelled"}


def _renamed(error: APIError) -> APIError:
    """A 400 of the chat path with the chat field it names replaced by the Responses field."""
    param = CHAT_FIELDS.get(error.param or "")
    if param is None:
        return error
    message = error.message
    if message.startswith(error.param):
        message = param + message[len(error.param) :]
    return APIError(error.status, message, param, error.kind)


class _Output:
    """One reply's output items, built from the reply parser's pieces (`add`), each call also
    returning the stream events it makes (without sequence numbers). Invariant: at most one item is
    open (`open_kind`: a message or reasoning item), always the last of `items`; a function_call item
    closes as it opens (its arguments come whole). With `one_call`, calls after the first are dropped
    (`parallel_tool_calls: false`)."""

    def __init__(self, one_call: bool):
        self.items: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.one_call = one_call
        self.num_calls = 0

    def add(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        if "tool_calls" in piece:
            events: list[dict[str, Any]] = []
            for call in piece["tool_calls"]:
                if not (self.one_call and self.num_calls):
                    events += self._call(call)
            return events
        kind, text = (
            ("reasoning", piece["reasoning_content"])
            if "reasoning_content" in piece
            else ("message", piece["content"])
        )
        if not text:
            return []
        events = []
        if self.open_kind != kind:
            events += self.close("completed")
            events += self._open(kind)
        part = self.items[-1]["content"][0]
        part["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self._of_part({"type": delta, "delta": text}) | self._logprobs(kind))
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events, the item marked `status` (none when no item is open)."""
        if self.open_kind is None:
            return []
        kind, self.open_kind = self.open_kind, None
        item, index = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        item["status"] = status
        return [
            self._of_part({"type": done, "text": part["text"]}) | self._logprobs(kind),
            self._of_part({"type": "response.content_part.done", "part": dict(part)}),
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        events = [self._added(item)]
        item["content"].append(part)
        self.open_kind = kind
        return [*events, self._of_part({"type": "response.content_part.added", "part": dict(part)})]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.num_calls += 1
        function = call["function"]
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": function["name"], "arguments": ""}  # fmt: skip
        events.append(self._added(item))
        index, arguments = len(self.items) - 1, function["arguments"]
        item |= {"arguments": arguments, "status": "completed"}
        of_item = {"item_id": item["id"], "output_index": index}
        return [
            *events,
            {"type": "response.function_call_arguments.delta", "delta": arguments} | of_item,
            {"type": "response.function_call_arguments.done", "arguments": arguments, "name": item["name"]}
            | of_item,
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }

    def _of_part(self, event: dict[str, Any]) -> dict[str, Any]:
        """`event` of the open item's one content part."""
        return event | {
            "item_id": self.items[-1]["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }

    @staticmethod
    def _logprobs(kind: str) -> dict[str, Any]:
        """Text events carry `logprobs` (none here: /v1/responses does not take top_logprobs)."""
        return {"logprobs": []} if kind == "message" else {}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _envelope(body: ResponsesRequest, model_name: str) -> dict[str, Any]:
    """A response as it starts (in progress, no output): the request's settings echoed."""
    text_format = {"type": "text"}
    if body.text is not None and body.text.format is not None:
        text_format = body.text.format.model_dump(by_alias=True, exclude_none=True)
    choice = body.tool_choice or "auto"
    reasoning = (
        body.reasoning.model_dump() if body.reasoning is not None else {"effort": None, "summary": None}
    )
    return {
        "id": f"resp_{uuid.uuid4().hex}",
        "object": "response",
        "created_at": int(time.time()),
        "completed_at": None,
        "status": "in_progress",
        "error": None,
        "incomplete_details": None,
        "model": model_name,
        "output": [],
        "usage": None,
        "instructions": body.instructions,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "background": False,
        "max_output_tokens": body.max_output_tokens,
        "temperature": body.temperature,
        "top_p": body.top_p,
        "tools": [tool.model_dump() for tool in body.tools or ()],
        "tool_choice": choice.model_dump() if isinstance(choice, FunctionToolChoice) else choice,
        "parallel_tool_calls": body.parallel_tool_calls,
        "reasoning": reasoning,
        "text": {"format": text_format},
        "truncation": "disabled",
        "metadata": body.metadata or {},
    }


def _finished(
    envelope: dict[str, Any], output: _Output, reason: str | None, usage: list[int]
) -> dict[str, Any]:
    status = STATUSES.get(reason or "stop", "completed")
    return envelope | {
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "output": output.items,
        "usage": _usage(*usage),
    }


def _item_status(reason: str | None) -> str:
    """The status of the item a finished reply leaves open: incomplete where the reply was cut short."""
    return "incomplete" if reason in ("length", "abort") else "completed"


def _sse(event: dict[str, Any]) -> str:
    """One named event. The JSON is ASCII (every other character escaped), so no reader can take a
    character of it for a line end (U+2028 and the like)."""
    return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"


def add_responses_route(
    app: FastAPI,
    engine: AsyncEngine,
    model_name: str,
    start_chat: Callable[[ChatCompletionRequest], Awaitable[ChatRun]],
    store: ResponseStore,
) -> None:
    """`POST /v1/responses`, `GET` and `DELETE /v1/responses/{response_id}` on `app`."""

    def stored(response_id: str, param: str) -> StoredResponse:
        found = store.get(response_id)
        if found is None:
            message = (
                f"{param}: no stored response {response_id!r} (unknown, deleted, evicted from the store, "
                "or created with store: false)"
            )
            raise APIError(404, message, param, "not_found_error")
        return found

    @app.post(PATH, response_model=ResponseObject)
    async def create(body: ResponsesRequest, raw: Request) -> Response:
        earlier = (
            ()
            if body.previous_response_id is None
            else stored(body.previous_response_id, "previous_response_id").conversation
        )
        try:
            # valid by construction: each Responses field is at least as strict as its chat field
            run = await start_chat(ChatCompletionRequest.model_validate(body.chat_request(earlier)))
        except APIError as e:
            raise _renamed(e) from None
        parser, output = run.parser(), _Output(one_call=not body.parallel_tool_calls)
        envelope = _envelope(body, model_name)

        def pieces(text: str, finished: bool) -> list[dict[str, Any]]:
            return [*parser.feed(text), *(parser.finish() if finished else [])]

        def keep(response: dict[str, Any]) -> None:
            if body.store:
                said = INPUT_ITEMS.validate_python(response["output"])  # the output as input items
                conversation = (*earlier, *body.input_items(), *said)
                store.put(response["id"], StoredResponse(response, conversation))

        if not body.stream:
            usage = [0, 0]
            (choice,) = await until_disconnect(raw, collect(engine, run.handles, usage))
            for piece in pieces(choice.text, True):
                output.add(piece)
            output.close(_item_status(choice.finish_reason))
            response = _finished(envelope, output, choice.finish_reason, usage)
            keep(response)
            return JSONResponse(response)

        async def events() -> AsyncIterator[str]:
            numbers = itertools.count()

            def sse(event: dict[str, Any]) -> str:
                return _sse(event | {"sequence_number": next(numbers)})

            yield sse({"type": "response.created", "response": envelope})
            yield sse({"type": "response.in_progress", "response": envelope})
            usage, reason = [0, 0], None
            try:
                async for _, delta in merge(engine, run.handles, usage):
                    reason = delta.finish_reason or reason
                    for piece in pieces(delta.text, delta.finish_reason is not None):
                        for event in output.add(piece):
                            yield sse(event)
            except RequestFailed as e:
                failed = _finished(envelope, output, None, usage)
                failed |= {
                    "status": "failed",
                    "completed_at": None,
                    "error": {"code": "server_error", "message": str(e)},
                }
                yield sse({"type": "response.failed", "response": failed})
                return
            for event in output.close(_item_status(reason)):
                yield sse(event)
            response = _finished(envelope, output, reason, usage)
            keep(response)
            ending = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield sse({"type": ending, "response": response})

        return StreamingResponse(events(), media_type="text/event-stream")

    # one route for every method, so that a 405 names them all in `Allow` (routes of one path would
    # each name their own); `describe_responses` gives each method its own answer in the schema
    @app.api_route(
        PATH + "/{response_id}",
        methods=["GET", "HEAD", "DELETE"],
        response_model=ResponseObject | ResponseDeleted,
    )
    async def stored_response(response_id: str, raw: Request) -> Response:
        found = stored(response_id, "response_id")
        if raw.method != "DELETE":
            return JSONResponse(found.response)
        store.delete(response_id)
        return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
