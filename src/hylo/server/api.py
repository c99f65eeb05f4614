"""OpenAI-compatible HTTP API over the async engine (FastAPI).

Every response that is not a success is an OpenAI-format error (`protocol.error_body`), whatever
raised it: validation, routing (404/405), the body guard (401/413), the engine, or a bug (500)."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import asdict
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from pydantic import ValidationError
from starlette.exceptions import HTTPException

from hylo.sampling import SamplingParams
from hylo.server.async_engine import AsyncEngine, Delta, EngineUnavailable, Handle, QueueFull
from hylo.server.guard import RETRY_AFTER_S, Guard, error_response
from hylo.server.logprobs import TextOffsets, chat_logprobs, completion_logprobs
from hylo.server.messages import add_messages_route
from hylo.server.openapi import describe
from hylo.server.parsers import THINK_START, ReplyParser, merge_deltas, tool_call_grammar, whole_reply
from hylo.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
    has_surrogate,
)
from hylo.server.responses import add_responses_route
from hylo.server.responses_store import ResponseStore
from hylo.server.runs import (
    APIError,
    ChatRun,
    Choice,
    RequestFailed,
    check_prompt,
    check_token_ids,
    collect,
    failed_rule,
    merge,
    sse,
    until_disconnect,
)
from hylo.server.worker_routes import add_worker_routes


def build_app(
    engine: AsyncEngine,
    model_name: str,
    api_key: str | None = None,
    max_request_bytes: int = 8 * 2**20,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    body_timeout: float | None = None,
    responses_store: ResponseStore | None = None,
) -> FastAPI:
    """The OpenAI-compatible routes over `engine`; with `tool_call_parser` / `reasoning_parser`
    (`hylo.server.parsers.PARSERS`) chat replies carry `tool_calls` / `reasoning_content`. Every GET
    route answers HEAD too. `/v1/responses` keeps what it stores in `responses_store` (default: one
    of the default bounds)."""
    app = FastAPI(title="hylo", docs_url=None, redoc_url=None)
    app.add_middleware(Guard, api_key=api_key, max_body_bytes=max_request_bytes, body_timeout=body_timeout)
    core = engine.engine
    tokenizer = core.tokenizer
    vocab = core.model.config.vocab_size
    special_ids = frozenset(tokenizer.special_ids()) if tokenizer is not None else frozenset()

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> Response:
        return error_response(e.status, e.message, e.kind, e.param)

    @app.exception_handler(QueueFull)
    async def _queue_full(_: Request, e: QueueFull) -> Response:
        return error_response(429, str(e), "rate_limit_error", headers={"Retry-After": str(RETRY_AFTER_S)})

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(_: Request, e: EngineUnavailable) -> Response:
        return error_response(503, str(e), "service_unavailable")

    @app.exception_handler(RequestFailed)
    async def _failed(_: Request, e: RequestFailed) -> Response:
        return error_response(500, str(e), "internal_server_error")

    @app.exception_handler(HTTPException)
    async def _http_error(_: Request, e: HTTPException) -> Response:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(e.status_code, str(e.detail), kind, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _invalid_body(_: Request, e: RequestValidationError) -> Response:
        first = e.errors()[0]
        if first["type"] == "json_invalid":
            return error_response(400, f"the body is not valid JSON: {first['ctx']['error']}")
        if first["type"] == "model_attributes_type" and tuple(first["loc"]) == ("body",):
            return error_response(400, "the body must be a JSON object (Content-Type: application/json)")
        errors = [err | {"loc": err["loc"][1:]} if err["loc"][:1] == ("body",) else err for err in e.errors()]
        param, failed = failed_rule(errors)
        message = f"{param}: {failed['msg']}" if param else failed["msg"]
        return error_response(400, message, param=param)

    @app.exception_handler(Exception)
    async def _bug(_: Request, e: Exception) -> Response:
        return error_response(500, f"internal error ({type(e).__name__})", "internal_server_error")

    def get(path: str, **kwargs: Any) -> Callable:
        """A GET route that answers HEAD as well (RFC 9110: HEAD wherever GET is served)."""
        return app.api_route(path, methods=["GET", "HEAD"], **kwargs)

    @get("/health")
    async def health() -> Response:
        if engine.alive:
            return Response(status_code=200)
        return error_response(503, "the engine has stopped", "service_unavailable")

    @get("/metrics")
    async def metrics() -> Response:
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @get("/server_info")
    async def server_info() -> dict[str, Any]:
        caches, plan = core.caches, core.plan
        return {
            "model": model_name,
            "served_model_name": model_name,  # sglang-router registers the worker's model by these
            "model_path": str(core.config.model or model_name),
            "config": asdict(core.config),
            "context_length": core.context_len,
            "max_total_num_tokens": plan.max_total_num_tokens,
            "max_running_requests": plan.num_slots,
            "bytes_per_token": plan.bytes_per_token,
            "bytes_per_slot": plan.bytes_per_slot,
            "free_pages": caches.pages.num_free,
            # free, or held by the prefix cache alone (given up when a request needs them)
            "available_pages": caches.num_available_pages,
            "total_pages": caches.pages.size,
            "free_slots": caches.slots.num_free,
            "total_slots": caches.slots.size,
            "num_running": len(core.scheduler.running),
            "num_waiting": engine.num_waiting,
            "memory": core.memory_report,
            "prefix_cache": _prefix_cache_info(caches),
            "kv_block_size": plan.page_size,  # tokens a KV event's block holds (vLLM routers read it)
            "parallel": core.ranks.describe(),
            "num_open_requests": engine.num_open,
        } | engine.metrics.speculative_info()

    created_at = int(time.time())
    card = ModelCard(
        id=model_name, object="model", created=created_at, owned_by="hylo", max_model_len=core.context_len
    )

    @get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(object="list", data=[card])

    @get("/v1/models/{model_id:path}", response_model=ModelCard)
    async def model(model_id: str) -> ModelCard:
        check_model(model_id)
        return card

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            raise APIError(
                404,
                f"model {name!r} does not exist; this server serves {model_name!r}",
                "model",
                "not_found_error",
            )

    def params_of(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValidationError as e:
            param, failed = failed_rule(e.errors())
            param = CONSTRAINT_FIELDS.get(param, param)
            raise APIError(400, f"{param}: {failed['msg']}" if param else failed["msg"], param) from None

    def need_tokenizer(param: str) -> None:
        if tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer; send token ids", param)

    def encode(texts: Sequence[str], param: str, add_special_tokens: bool = True) -> list[list[int]]:
        """Runs off the event loop: a long prompt takes seconds to tokenise."""
        for text in texts:
            if has_surrogate(text):
                raise APIError(400, f"{param}: contains a lone surrogate, which is not valid text", param)
        return [tokenizer.encode(t, add_special_tokens=add_special_tokens) for t in texts]

    async def encode_prompts(prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        if isinstance(prompt[0], int):
            return [list(prompt)]
        if isinstance(prompt[0], str):
            need_tokenizer("prompt")
            return await asyncio.to_thread(encode, prompt, "prompt")
        return [list(p) for p in prompt]

    async def compiled(params: SamplingParams) -> None:
        """A structured-output constraint compiles (off the event loop; cached for the engine), or a 400
        naming the request field it came from."""
        if params.constraint is None:
            return
        try:
            await asyncio.to_thread(engine.compile_constraint, params)
        except ValueError as e:
            field_name = CONSTRAINT_FIELDS[params.constraint[0]]
            message = str(e).split(":", 1)[-1].strip()
            raise APIError(400, f"{field_name}: {message}", field_name) from None

    def forced_tool_calls(
        body: ChatCompletionRequest, params: SamplingParams, tools: list[dict[str, Any]] | None
    ) -> SamplingParams:
        """`tool_choice` `required` or a named function: the reply constrained to tool calls in the
        parser's format (`tool_call_grammar`), or a 400 naming what stands in the way."""
        if tool_call_parser is None:
            raise APIError(400, "tool_choice: needs the server's --tool-call-parser", "tool_choice")
        if params.constraint is not None:
            message = (
                "tool_choice: required or a named function (a grammar) excludes response_format, regex, ebnf"
            )
            raise APIError(400, message, "tool_choice")
        name = None if body.tool_choice == "required" else body.tool_choice.function.name
        try:
            grammar = tool_call_grammar(tools or [], name)
        except ValueError as e:
            field_name = str(e).split(":", 1)[0]
            raise APIError(400, str(e), field_name) from None
        return params.model_copy(update={"ebnf": grammar})

    def submitted(prompts: Sequence[list[int]], params: SamplingParams, param: str) -> list[Handle]:
        """Every prompt valid and room in the queue for all of them, or an error before any work."""
        sequences = len(prompts) * params.n
        if engine.max_queued is not None and sequences > engine.max_queued:
            raise APIError(
                400,
                f"n: {sequences} sequences (prompts x n) can never fit the waiting queue of "
                f"{engine.max_queued} (--max-queued-requests)",
                "n",
            )
        checked = [check_prompt(engine, ids, params, param) for ids in prompts]
        engine.check_capacity(sequences)
        return [engine.submit(prompt, params) for prompt in checked]

    @app.post("/v1/completions", response_model=CompletionResponse)
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        check_model(body.model)
        params = params_of(body.sampling_params)
        prompts = await encode_prompts(body.prompt)
        await compiled(params)
        handles = submitted(prompts, params, "prompt")
        created, rid = int(time.time()), f"cmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "text_completion", "created": created, "model": model_name}

        # the text each prompt's choices echo
        n = body.n  # choices per prompt: the best n of params.n (best_of) when that is more
        prompt_texts = (
            [] if not body.echo
            else [body.prompt] if isinstance(body.prompt, str)
            else list(body.prompt) if isinstance(body.prompt[0], str)
            else [tokenizer.decode(ids, skip_special_tokens=False) if tokenizer else "" for ids in prompts]
        )  # fmt: skip

        offsets: dict[int, TextOffsets] = {}  # per choice, across its deltas

        def choice(index: int, c: Delta | Choice) -> dict:
            """A delta and a collected choice carry the same fields; a choice's first delta (a collected
            choice's only one) begins with its prompt when echoed."""
            ids, entries, text, text_offset = list(c.token_ids), list(c.logprobs), c.text, []
            first = index not in offsets
            if first:
                offsets[index] = TextOffsets(tokenizer, special_ids, params.skip_special_tokens)
            if body.echo and first:
                prompt, prompt_text = prompts[index // n], prompt_texts[index // n]
                text = prompt_text + text
                if body.logprobs is not None:
                    text_offset = offsets[index].feed(prompt, prompt_text)
                    ids, entries = [*prompt, *ids], [None, *(c.prompt_logprobs or ()), *entries]
            lp = None
            if body.logprobs is not None:
                text_offset += offsets[index].feed(c.token_ids)
                lp = completion_logprobs(tokenizer, ids, entries, text_offset) if ids else None
            return {"index": index, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}

        return await _reply(
            raw, engine, handles, body, base, choice, choice, pick=lambda cs: _best(cs, params.n, n)
        )

    async def start_chat(body: ChatCompletionRequest) -> ChatRun:
        """A chat request rendered by the chat template, its sampling params (`tool_choice`'s grammar
        included) and its sequences submitted; or an APIError naming the field at fault, before any
        work. Shared by /v1/chat/completions and /v1/messages (which builds the request it runs)."""
        check_model(body.model)
        need_tokenizer("messages")
        messages = [m.model_dump(exclude_none=True) for m in body.messages]
        tools = body.tool_dicts

        def render() -> tuple[str, list[int]]:
            try:
                text = tokenizer.apply_chat_template(
                    messages, body.add_generation_prompt, tools, **body.chat_template_kwargs
                )
            except Exception as e:  # the template is data: whatever it raises is about this input
                raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
            return text, encode([text], "messages", add_special_tokens=False)[0]

        rendered, ids = await asyncio.to_thread(render)
        room = min(core.context_len, core.plan.max_total_num_tokens) - len(ids)
        params = params_of(lambda: body.sampling_params(max(1, room)))
        if body.tool_choice not in (None, "none", "auto"):
            params = forced_tool_calls(body, params, tools)
        await compiled(params)
        handles = submitted([ids], params, "messages")
        return ChatRun(
            handles=handles,
            params=params,
            prompt_tokens=len(ids),
            tools=tools,
            parse_tools=tool_call_parser is not None and bool(tools) and body.tool_choice != "none",
            parse_reasoning=reasoning_parser is not None,
            thinking_open=rendered.rstrip().endswith(THINK_START),
        )

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse)
    async def chat(body: ChatCompletionRequest, raw: Request) -> Response:
        run = await start_chat(body)
        params, handles = run.params, run.handles
        parse_tools, parse_reasoning = run.parse_tools, run.parse_reasoning
        parsers: dict[int, ReplyParser] = {}

        def parser(i: int) -> ReplyParser:
            if i not in parsers:
                parsers[i] = run.parser()
            return parsers[i]

        def finish_reason(i: int, reason: str | None) -> str | None:
            return "tool_calls" if reason == "stop" and i in parsers and parsers[i].called else reason

        created, rid = int(time.time()), f"chatcmpl-{uuid.uuid4().hex}"
        base = {"id": rid, "object": "chat.completion", "created": created, "model": model_name}

        def logprobs_of(ids: Sequence[int], entries: Sequence[dict[int, float]]) -> dict | None:
            return (
                chat_logprobs(tokenizer, ids, entries, body.top_logprobs or 0)
                if body.logprobs and ids
                else None
            )

        def delta_choice(i: int, d: Delta) -> dict:
            if parse_tools or parse_reasoning:
                pieces = [*parser(i).feed(d.text), *(parser(i).finish() if d.finish_reason else [])]
                delta = merge_deltas(pieces)
            else:
                delta = {"content": d.text} if d.text else {}
            return {
                "index": i,
                "delta": delta,
                "logprobs": logprobs_of(d.token_ids, d.logprobs),
                "finish_reason": finish_reason(i, d.finish_reason),
            }

        def final_choice(i: int, c: Choice) -> dict:
            message = {"role": "assistant", "content": c.text}
            if parse_tools or parse_reasoning:
                message |= whole_reply(parser(i), c.text)
            return {
                "index": i,
                "message": message,
                "logprobs": logprobs_of(c.token_ids, c.logprobs),
                "finish_reason": finish_reason(i, c.finish_reason),
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

    @app.post("/v1/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: TokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        need_tokenizer("prompt")
        (ids,) = await asyncio.to_thread(encode, [body.prompt], "prompt", body.add_special_tokens)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=core.context_len)

    @app.post("/v1/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        need_tokenizer("tokens")
        check_token_ids(body.tokens, vocab, "tokens")
        text = await asyncio.to_thread(tokenizer.decode, body.tokens, False)
        return DetokenizeResponse(prompt=text)

    add_worker_routes(app, engine, model_name)  # what vllm-router and sglang-router call on a worker
    add_messages_route(app, engine, model_name, start_chat)
    store = ResponseStore() if responses_store is None else responses_store
    add_responses_route(app, engine, model_name, start_chat, store)
    describe(app, vocab, api_key is not None, tool_call_parser is not None)
    return app


async def _reply(
    raw: Request,
    engine: AsyncEngine,
    handles: Sequence[Handle],
    body: CompletionRequest | ChatCompletionRequest,
    base: dict[str, Any],
    delta_choice: Callable[[int, Delta], dict],
    final_choice: Callable[[int, Choice], dict],
    chunk_object: str | None = None,
    first_choices: Sequence[dict] = (),
    pick: Callable[[list[Choice]], list[Choice]] | None = None,
) -> Response:
    """SSE chunks (one per delta carrying text, tokens or a finish; usage last when asked; then
    [DONE]) when the body streams, else one JSON response with every choice and the usage. A
    sequence the engine failed ends the stream with an error event (or answers a 500)."""
    if body.stream:
        chunk = base | ({"object": chunk_object} if chunk_object else {})

        async def events() -> AsyncIterator[str]:
            for c in first_choices:
                yield sse(chunk | {"choices": [c]})
            usage = [0, 0]
            so_far: dict[int, tuple[int, int]] = {}  # choice -> (prompt, completion) tokens
            try:
                async for index, delta in merge(engine, handles, usage):
                    so_far[index] = (delta.prompt_tokens, delta.completion_tokens)
                    if delta.text or delta.finish_reason or delta.token_ids:
                        payload = chunk | {"choices": [delta_choice(index, delta)]}
                        if body.continuous_usage:
                            payload["usage"] = _usage(*map(sum, zip(*so_far.values(), strict=True)))
                        yield sse(payload)
            except RequestFailed as e:
                yield sse(
                    {
                        "error": {
                            "message": str(e),
                            "type": "internal_server_error",
                            "param": None,
                            "code": 500,
                        }
                    }
                )
            else:
                if body.include_usage:
                    yield sse(chunk | {"choices": [], "usage": _usage(*usage)})
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")
    usage = [0, 0]
    choices = await until_disconnect(raw, collect(engine, handles, usage))
    if pick is not None:
        choices = pick(choices)
    body_json = base | {
        "choices": [final_choice(i, c) for i, c in enumerate(choices)],
        "usage": _usage(*usage),
    }
    return JSONResponse(body_json)


def _best(choices: list[Choice], generated: int, kept: int) -> list[Choice]:
    """Of each prompt's `generated` choices (in prompt order), the `kept` with the highest mean token
    logprob, best first (OpenAI's `best_of`)."""
    if generated == kept:
        return choices

    def score(c: Choice) -> float:
        return sum(e[t] for t, e in zip(c.token_ids, c.logprobs, strict=True)) / max(1, len(c.token_ids))

    groups = [choices[i : i + generated] for i in range(0, len(choices), generated)]
    return [c for group in groups for c in sorted(group, key=score, reverse=True)[:kept]]


# the request field a SamplingParams constraint comes from
CONSTRAINT_FIELDS = {"json_schema": "response_format", "regex": "regex", "ebnf": "ebnf"}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def _prefix_cache_info(caches) -> dict[str, Any] | None:
    """The prefix cache's size and counters (None when it is off)."""
    prefix = caches.prefix
    if prefix is None:
        return None
    return {
        "pages": prefix.num_nodes,
        "tokens": prefix.num_nodes * prefix.page_size,
        "snapshots": prefix.num_snapshots,
        "max_snapshots": caches.plan.num_snapshots,
        "snapshot_interval": prefix.interval,
        "bytes_per_snapshot": caches.plan.bytes_per_snapshot,
        "hit_tokens": prefix.stats.hit_tokens,
        "query_tokens": prefix.stats.query_tokens,
        "hit_rate": prefix.stats.hit_rate,
        "evicted_pages": prefix.stats.evicted_pages,
        "evicted_snapshots": prefix.stats.evicted_snapshots,
    }
