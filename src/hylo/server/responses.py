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

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from hylo.server.async_engine import AsyncEngine
from hylo.server.protocol import ChatCompletionRequest
from hylo.server.responses_output import OutputItems, ResponseDeleted, ResponseObject, response_usage
from hylo.server.responses_protocol import INPUT_ITEMS, FunctionToolChoice, ResponsesRequest
from hylo.server.responses_store import ResponseStore, StoredResponse
from hylo.server.runs import APIError, ChatRun, RequestFailed, collect, merge, sse, until_disconnect

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
    envelope: dict[str, Any], output: OutputItems, reason: str | None, usage: list[int]
) -> dict[str, Any]:
    status = STATUSES.get(reason or "stop", "completed")
    return envelope | {
        "status": status,
        "completed_at": int(time.time()) if status == "completed" else None,
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "output": output.items,
        "usage": response_usage(*usage),
    }


def _item_status(reason: str | None) -> str:
    """The status of the item a finished reply leaves open: incomplete where the reply was cut short."""
    return "incomplete" if reason in ("length", "abort") else "completed"


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
        parser, output = run.parser(), OutputItems(one_call=not body.parallel_tool_calls)
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

            def numbered(event: dict[str, Any]) -> str:
                return sse(event | {"sequence_number": next(numbers)}, event["type"])

            yield numbered({"type": "response.created", "response": envelope})
            yield numbered({"type": "response.in_progress", "response": envelope})
            usage, reason = [0, 0], None
            try:
                async for _, delta in merge(engine, run.handles, usage):
                    reason = delta.finish_reason or reason
                    for piece in pieces(delta.text, delta.finish_reason is not None):
                        for event in output.add(piece):
                            yield numbered(event)
            except RequestFailed as e:
                failed = _finished(envelope, output, None, usage)
                failed |= {
                    "status": "failed",
                    "completed_at": None,
                    "error": {"code": "server_error", "message": str(e)},
                }
                yield numbered({"type": "response.failed", "response": failed})
                return
            for event in output.close(_item_status(reason)):
                yield numbered(event)
            response = _finished(envelope, output, reason, usage)
            keep(response)
            ending = "response.completed" if response["status"] == "completed" else "response.incomplete"
            yield numbered({"type": ending, "response": response})

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
