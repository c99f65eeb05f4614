"""What a request under way is on the server side, shared by every route that runs one (the OpenAI
routes in `api`, `/v1/messages`, `/v1/responses`, the router-facing routes): its error, its sequences'
deltas merged and collected, its run until the client leaves, its stream's events, and the rule a 400
names."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from hylo.engine.engine import CheckedPrompt, checked_token_ids
from hylo.sampling import SamplingParams
from hylo.server.async_engine import AsyncEngine, Delta, Handle
from hylo.server.parsers import ReplyParser

# Characters JSON allows raw in strings that some line readers (Python's str.splitlines, JavaScript
# before ES2019) take for line ends; escaped, an event's data stays one line to every reader.
_LINE_BREAKING = str.maketrans({"\u0085": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"})


def sse(payload: dict[str, Any], event: str | None = None) -> str:
    """One server-sent event carrying `payload`, named `event` if given; the JSON is UTF-8, with U+0085,
    U+2028 and U+2029 escaped (JSON escapes every other line end: CR, LF and the rest of the C0
    controls)."""
    name = "" if event is None else f"event: {event}\n"
    return f"{name}data: {json.dumps(payload, ensure_ascii=False).translate(_LINE_BREAKING)}\n\n"


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


class RequestFailed(Exception):
    """The engine failed one of this request's sequences (finish reason `error`)."""


@dataclass
class Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_logprobs: tuple[dict[int, float], ...] | None = None


@dataclass
class ChatRun:
    """A chat request under way: its sequences' handles (one per prompt, here one), its params, and
    how its replies are parsed (`parser`)."""

    handles: list[Handle]
    params: SamplingParams
    prompt_tokens: int
    tools: list[dict[str, Any]] | None
    parse_tools: bool
    parse_reasoning: bool
    thinking_open: bool  # the rendered prompt ends with `<think>`: replies begin inside reasoning

    def parser(self) -> ReplyParser:
        """A fresh parser for one reply (each choice needs its own)."""
        return ReplyParser(self.parse_reasoning, self.parse_tools, self.tools, self.thinking_open)


async def merge(
    engine: AsyncEngine, handles: Sequence[Handle], usage: list[int]
) -> AsyncIterator[tuple[int, Delta]]:
    """Deltas of every request's sequences as they come, as (choice index, delta); `usage` collects
    [prompt tokens, completion tokens]. Closing the iterator early aborts whatever still runs;
    a failed sequence raises RequestFailed (which closes it)."""
    merged: asyncio.Queue[tuple[int, Delta] | None] = asyncio.Queue()

    async def pump(first_index: int, handle: Handle) -> None:
        try:
            async for delta in engine.stream(handle):
                merged.put_nowait((first_index + delta.index, delta))
        finally:
            merged.put_nowait(None)

    tasks = [asyncio.create_task(pump(i * h.unfinished, h)) for i, h in enumerate(handles)]
    try:
        for _ in tasks:
            while (item := await merged.get()) is not None:
                index, delta = item
                if delta.finish_reason == "error":
                    raise RequestFailed(delta.error or "the engine failed while serving this request")
                if delta.finish_reason is not None:
                    usage[0] += delta.prompt_tokens
                    usage[1] += delta.completion_tokens
                yield index, delta
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for handle in handles:
            if handle.unfinished:
                engine.abort(handle)


async def collect(engine: AsyncEngine, handles: Sequence[Handle], usage: list[int]) -> list[Choice]:
    choices = [Choice() for h in handles for _ in range(h.unfinished)]
    async for index, delta in merge(engine, handles, usage):
        c = choices[index]
        c.text += delta.text
        c.token_ids.extend(delta.token_ids)
        c.logprobs.extend(delta.logprobs)
        c.finish_reason = delta.finish_reason or c.finish_reason
        if delta.prompt_logprobs is not None:
            c.prompt_logprobs = delta.prompt_logprobs
    return choices


async def until_disconnect(raw: Request, work: Awaitable[list[Choice]]) -> list[Choice]:
    """Run `work`, cancelling it (and so aborting its requests) if the client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=0.25)
            if done:
                return task.result()
            if await raw.is_disconnected():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
    finally:
        if not task.done():
            task.cancel()


def _mismatch(error: Mapping[str, Any]) -> bool:
    """A union member's error for an input of another type than the member's (`string_type`, ...)."""
    return error["type"].endswith("_type") or error["type"] in ("literal_error", "none_required")


def failed_rule(errors: Sequence[Mapping[str, Any]]) -> tuple[str | None, Mapping[str, Any]]:
    """The field path and the error that name the rule a body broke. A union field reports one error
    per member: the rule is that of the member the input's type fits (33 stop strings break the list's
    length, not "Input should be a valid string"), whose error is the first that is no type mismatch."""
    field = errors[0]["loc"][:1]
    same_field = [err for err in errors if err["loc"][:1] == field]
    failed = next((err for err in same_field if not _mismatch(err)), errors[0])
    return param_of([failed["loc"], *(err["loc"] for err in errors if err is not failed)]), failed


def param_of(locs: Sequence[Sequence[int | str]]) -> str | None:
    """The field path of the first validation error. A union reports one error per member, each
    under the member's tag (`list[int]`, `function-after[...]`), which is pydantic's, not the
    client's: the path is what the first error's siblings share, up to any such tag."""
    first = locs[0]
    shared = len(first)
    for loc in locs[1:]:
        if loc[:1] == first[:1]:
            same = 0
            while same < min(len(first), len(loc)) and first[same] == loc[same]:
                same += 1
            shared = min(shared, same)
    parts = []
    for part in first[:shared]:
        if isinstance(part, str) and not (part.isidentifier() or part.isdigit()):
            break
        parts.append(str(part))
    return ".".join(parts) or None


def check_token_ids(ids: Sequence[int], vocab: int, param: str) -> None:
    """Every id of `ids` inside the vocabulary `[0, vocab)`, or a 400 naming `param` and the first that is
    not (the engine's own check: `checked_token_ids`)."""
    try:
        checked_token_ids(param, ids, vocab)
    except ValueError as e:
        raise APIError(400, str(e), param) from None


def check_prompt(
    engine: AsyncEngine, ids: Sequence[int], params: SamplingParams, param: str
) -> CheckedPrompt:
    """`ids` and `params` checked as a generation of them would be (token ids, length, the params'
    ids), or a 400 naming the field: the params' own field, else `param` (where the prompt came from).
    The checked prompt is what `AsyncEngine.submit` takes without checking it again."""
    try:
        return engine.validate(ids, params)
    except ValueError as e:
        message = str(e)
        field_name = message.split(":", 1)[0]
        if field_name in ("stop_token_ids", "logit_bias", "stop"):
            raise APIError(400, message, field_name) from None
        raise APIError(400, message if param == "prompt" else f"{param}: {message}", param) from None
