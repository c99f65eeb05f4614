"""OpenAI-compatible HTTP API over the async engine (FastAPI)."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError

from hylo.sampling import SamplingParams
from hylo.server.async_engine import AsyncEngine, Delta, Handle, QueueFull
from hylo.server.protocol import ChatCompletionRequest, CompletionRequest, error_body


class APIError(Exception):
    def __init__(
        self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind


@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    finish_reason: str | None = None


def build_app(engine: AsyncEngine, model_name: str, api_key: str | None = None) -> FastAPI:
    app = FastAPI(title="hylo", docs_url=None, redoc_url=None)
    tokenizer = engine.engine.tokenizer

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return JSONResponse(error_body(e.message, e.kind, e.status, e.param), status_code=e.status)

    @app.exception_handler(QueueFull)
    async def _queue_full(_: Request, e: QueueFull) -> JSONResponse:
        return JSONResponse(error_body(str(e), "rate_limit_error", 429), status_code=429)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, e: RequestValidationError) -> JSONResponse:
        first = e.errors()[0]
        param = ".".join(str(p) for p in first["loc"] if p != "body") or None
        message = f"{param}: {first['msg']}" if param else first["msg"]
        return JSONResponse(error_body(message, "invalid_request_error", 400, param), status_code=400)

    @app.middleware("http")
    async def _auth(request: Request, call_next):
        guarded = api_key is not None and request.url.path.startswith("/v1")
        if guarded and request.headers.get("authorization") != f"Bearer {api_key}":
            body = error_body("missing or invalid API key", "authentication_error", 401)
            return JSONResponse(body, status_code=401)
        return await call_next(request)

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if engine.alive else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/server_info")
    async def server_info() -> dict[str, Any]:
        core = engine.engine
        caches, plan = core.caches, core.plan
        return {
            "model": model_name,
            "config": asdict(core.config),
            "context_length": core.context_len,
            "max_total_num_tokens": plan.max_total_num_tokens,
            "max_running_requests": plan.num_slots,
            "bytes_per_token": plan.bytes_per_token,
            "bytes_per_slot": plan.bytes_per_slot,
            "free_pages": caches.pages.num_free,
            "total_pages": caches.pages.size,
            "free_slots": caches.slots.num_free,
            "total_slots": caches.slots.size,
            "num_running": len(core.scheduler.running),
            "num_waiting": engine.num_waiting,
            "memory": core.memory_report,
        } | (
            {} if (tau := engine.metrics.mean_acceptance_length) is None else {"avg_spec_accept_length": tau}
        )

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": model_name,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "hylo",
            "max_model_len": engine.engine.context_len,
        }
        return {"object": "list", "data": [card]}

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "not_found_error",
            )

    def params_of(build) -> SamplingParams:
        try:
            return build()
        except ValidationError as e:
            first = e.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param}: {first['msg']}" if param else first["msg"], param) from None

    def encode_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if prompt and all(isinstance(t, int) for t in prompt):
            return [list(prompt)]
        if not prompt:
            raise APIError(400, "prompt: must not be empty", "prompt")
        if all(isinstance(p, str) for p in prompt):
            if tokenizer is None:
                raise APIError(400, "prompt: this model has no tokenizer; send token ids", "prompt")
            return [tokenizer.encode(p) for p in prompt]
        return [list(p) for p in prompt]

    def submitted(prompts: Sequence[list[int]], params: SamplingParams, param: str) -> list[Handle]:
        """Every prompt valid and room in the queue for all of them, or an error before any work."""
        for ids in prompts:
            try:
                engine.validate(ids, params)
            except ValueError as e:
                raise APIError(400, str(e) if param == "prompt" else f"{param}: {e}", param) from None
        engine.check_capacity(len(prompts) * params.n)
        return [engine.submit(ids, params) for ids in prompts]

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = params_of(body.sampling_params)
        prompts = encode_prompts(body.prompt)
        handles = submitted(prompts, params, "prompt")
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        def choice(index: int, c: Delta | _Choice) -> dict:
            """A delta and a collected choice carry the same fields."""
            ids = c.token_ids
            lp = (
                _completion_logprobs(tokenizer, ids, c.logprobs)
                if body.logprobs is not None and ids
                else None
            )
            return {"index": index, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}

        return await _reply(raw, engine, handles, body, base, choice, choice)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        if tokenizer is None:
            raise APIError(400, "messages: this model has no tokenizer or chat template", "messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        try:
            text = tokenizer.apply_chat_template(
                messages, body.add_generation_prompt, body.tools, **body.chat_template_kwargs
            )
        except ValueError as e:
            raise APIError(400, f"messages: {e}", "messages") from None
        prompts = [tokenizer.encode(text, add_special_tokens=False)]
        core = engine.engine
        room = min(core.context_len, core.plan.max_total_num_tokens) - len(prompts[0])
        params = params_of(lambda: body.sampling_params(max(1, room)))
        handles = submitted(prompts, params, "messages")
        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        def logprobs_of(ids: Sequence[int], entries: Sequence[dict[int, float]]) -> dict | None:
            return (
                _chat_logprobs(tokenizer, ids, entries, body.top_logprobs or 0)
                if body.logprobs and ids
                else None
            )

        def delta_choice(i: int, d: Delta) -> dict:
            return {
                "index": i,
                "delta": {"content": d.text} if d.text else {},
                "logprobs": logprobs_of(d.token_ids, d.logprobs),
                "finish_reason": d.finish_reason,
            }

        def final_choice(i: int, c: _Choice) -> dict:
            return {
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs_of(c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
            }

        role = [
            {
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            for i in range(params.n)
        ]
        return await _reply(
            raw,
            engine,
            handles,
            body,
            base,
            delta_choice,
            final_choice,
            chunk_object="chat.completion.chunk",
            first_choices=role,
        )

    return app


async def _reply(
    raw: Request,
    engine: AsyncEngine,
    handles: Sequence[Handle],
    body: CompletionRequest | ChatCompletionRequest,
    base: dict[str, Any],
    delta_choice: Callable[[int, Delta], dict],
    final_choice: Callable[[int, _Choice], dict],
    chunk_object: str | None = None,
    first_choices: Sequence[dict] = (),
) -> Response:
    """SSE chunks (one per delta carrying text, tokens or a finish; usage last when asked; then
    [DONE]) when the body streams, else one JSON response with every choice and the usage."""
    if body.stream:
        chunk = base | ({"object": chunk_object} if chunk_object else {})

        async def events() -> AsyncIterator[str]:
            for c in first_choices:
                yield _sse(chunk | {"choices": [c]})
            usage = [0, 0]
            async for index, delta in _merge(engine, handles, usage):
                if delta.text or delta.finish_reason or delta.token_ids:
                    yield _sse(chunk | {"choices": [delta_choice(index, delta)]})
            if body.include_usage:
                yield _sse(chunk | {"choices": [], "usage": _usage(*usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    usage = [0, 0]
    choices = await _until_disconnect(raw, _collect(engine, handles, usage))
    body_json = base | {
        "choices": [final_choice(i, c) for i, c in enumerate(choices)],
        "usage": _usage(*usage),
    }
    return JSONResponse(body_json)


async def _merge(
    engine: AsyncEngine, handles: Sequence[Handle], usage: list[int]
) -> AsyncIterator[tuple[int, Delta]]:
    """Deltas of every request's sequences as they come, as (choice index, delta); `usage` collects
    [prompt tokens, completion tokens]. Closing the iterator early aborts whatever still runs."""
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


async def _collect(engine: AsyncEngine, handles: Sequence[Handle], usage: list[int]) -> list[_Choice]:
    choices = [_Choice() for h in handles for _ in range(h.unfinished)]
    async for index, delta in _merge(engine, handles, usage):
        c = choices[index]
        c.text += delta.text
        c.token_ids.extend(delta.token_ids)
        c.logprobs.extend(delta.logprobs)
        c.finish_reason = delta.finish_reason or c.finish_reason
    return choices


async def _until_disconnect(raw: Request, work: Awaitable[list[_Choice]]) -> list[_Choice]:
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


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _token_text(tokenizer, token_id: int) -> str:
    return tokenizer.decode([token_id], skip_special_tokens=False) if tokenizer is not None else str(token_id)


def _completion_logprobs(
    tokenizer, ids: Sequence[int], entries: Sequence[dict[int, float]]
) -> dict[str, Any]:
    """The legacy completions format: tokens, their logprobs, and the top-n per position."""
    return {
        "tokens": [_token_text(tokenizer, t) for t in ids],
        "token_logprobs": [entry[t] for t, entry in zip(ids, entries, strict=True)],
        "top_logprobs": [{_token_text(tokenizer, t): lp for t, lp in entry.items()} for entry in entries],
        "text_offset": None,
    }


def _chat_logprobs(tokenizer, ids: Sequence[int], entries: Sequence[dict[int, float]], top_n: int) -> dict:
    def item(token_id: int, logprob: float) -> dict[str, Any]:
        text = _token_text(tokenizer, token_id)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return {
        "content": [
            item(t, entry[t])
            | {
                "top_logprobs": [
                    item(i, lp) for i, lp in sorted(entry.items(), key=lambda kv: -kv[1])[:top_n]
                ]
            }
            for t, entry in zip(ids, entries, strict=True)
        ]
    }
