"""The routes the routers users scale out with call on a worker (vllm-router, sglang-router): tokenize
and detokenize (a prompt or chat messages), render (a request's prompt token ids, for cache-aware
routing), load (for power-of-two), model and server info (the model id they register), flushing
the prefix cache, and where the KV events are published (`hylo.server.kv_events`). Each answers in
the shape the router reads (vLLM's or SGLang's)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Callable
from typing import Any, Literal

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from hylo.sampling import SamplingParams
from hylo.server.async_engine import AsyncEngine
from hylo.server.protocol import (
    _REQUEST,
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    DetokenizeRequest,
    DetokenizeResponse,
    TemplateKwargs,
    Text,
    TokenizeResponse,
    Tool,
    thinking_kwargs,
)
from hylo.server.runs import APIError, check_prompt, check_token_ids, failed_rule

# `GET /get_load`'s shape: vllm-router reads `{"load": N}`, sglang-router a list of per-DP-rank entries.
LOAD_FORMATS = ("vllm", "sglang")


class WorkerTokenizeRequest(BaseModel):
    """vLLM's `/tokenize`: a `prompt`, or chat `messages` rendered by the chat template first."""

    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "oneOf": [
                {"required": ["prompt"], "properties": {"prompt": {"type": "string"}}},
                {"required": ["messages"], "properties": {"messages": {"type": "array"}}},
            ]
        }
    )

    model: str | None = None
    prompt: Text | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(
        None, description="default: true for a prompt, false for messages (the template adds them)"
    )
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    tools: list[Tool] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> WorkerTokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("exactly one of prompt and messages is required")
        return self


class RenderedRequest(BaseModel):
    """vLLM's token-in `GenerateRequest`: what the render routes answer for one prompt."""

    request_id: str
    model: str
    token_ids: list[int]
    sampling_params: dict[str, Any]
    stream: bool


class VllmLoad(BaseModel):
    load: int = Field(description="requests open on this worker (running, waiting or queued)")


class SglangLoad(BaseModel):
    dp_rank: int
    num_reqs: int = Field(description="requests running")
    num_waiting_reqs: int = Field(description="requests waiting for a slot, or queued")
    num_tokens: int = Field(description="tokens the cache holds for running requests")


class KVEventSource(BaseModel):
    endpoint: str = Field(description="the ZMQ PUB socket's bound address")
    replay_endpoint: None = Field(description="no replay: a subscriber that misses batches sees the gap")
    topic: str


class FlushResponse(BaseModel):
    message: str


class ModelInfo(BaseModel):
    """SGLang's `/get_model_info` (what sglang-router registers a worker's model by)."""

    model_path: str
    tokenizer_path: str | None
    served_model_name: str
    is_generation: Literal[True] = True
    model_type: str
    max_model_len: int


_LOAD_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "--get-load-format vllm (the default): `{load}`; sglang: a list of one entry",
        "content": {
            "application/json": {
                "schema": {
                    "anyOf": [
                        VllmLoad.model_json_schema(),
                        {"type": "array", "items": SglangLoad.model_json_schema()},
                    ]
                }
            }
        },
    }
}


def add_worker_routes(app: FastAPI, engine: AsyncEngine, model_name: str, load_format: str = "vllm") -> None:
    """The router-facing routes on `app` (built by `hylo.server.api.build_app`); `load_format` is
    `/get_load`'s shape (LOAD_FORMATS), also settable later as `app.state.load_format`;
    `app.state.kv_events` is the server's `KVEventPublisher`, or None (the default) where it has none."""

    if load_format not in LOAD_FORMATS:
        raise ValueError(f"load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    app.state.load_format = load_format
    app.state.kv_events = None
    core = engine.engine
    tokenizer = core.tokenizer
    vocab = core.model.config.vocab_size
    model_path = str(core.config.model) if core.config.model else model_name

    def check_model(name: str | None) -> None:
        if name is not None and name != model_name:
            message = f"model {name!r} does not exist; this server serves {model_name!r}"
            raise APIError(404, message, "model", "not_found_error")

    def need_tokenizer(param: str) -> None:
        if tokenizer is None:
            raise APIError(400, f"{param}: this model has no tokenizer; send token ids", param)

    def template(
        messages: list[ChatMessage],
        add_generation_prompt: bool,
        tools: list[dict[str, Any]] | None,
        kwargs: dict[str, Any],
    ) -> list[int]:
        """The chat template's prompt, tokenised (off the event loop)."""
        dumped = [m.model_dump(exclude_none=True) for m in messages]
        try:
            text = tokenizer.apply_chat_template(dumped, add_generation_prompt, tools, **kwargs)
        except Exception as e:  # the template is data: whatever it raises is about this input
            raise APIError(400, f"messages: the chat template failed: {e}", "messages") from None
        return tokenizer.encode(text, add_special_tokens=False)

    def sampling(build: Callable[[], SamplingParams]) -> SamplingParams:
        try:
            return build()
        except ValidationError as e:
            param, failed = failed_rule(e.errors())
            raise APIError(400, f"{param}: {failed['msg']}" if param else failed["msg"], param) from None

    def rendered(ids: list[int], params: SamplingParams, param: str) -> dict[str, Any]:
        """`ids` checked as a generation of them would be (token ids, length, the params' ids), or a
        400 naming the field; then the params as JSON."""
        check_prompt(engine, ids, params, param)
        return params.model_dump(mode="json", exclude_none=True)

    def room(ids: list[int]) -> int:
        return max(1, min(core.context_len, core.plan.max_total_num_tokens) - len(ids))

    @app.post("/tokenize", response_model=TokenizeResponse)
    async def tokenize(body: WorkerTokenizeRequest) -> TokenizeResponse:
        check_model(body.model)
        if body.messages is not None:
            need_tokenizer("messages")
            tools = None if body.tools is None else [t.model_dump(exclude_unset=True) for t in body.tools]
            ids = await asyncio.to_thread(
                template,
                body.messages,
                body.add_generation_prompt,
                tools,
                thinking_kwargs(body.chat_template_kwargs),
            )
            if body.add_special_tokens:
                ids = tokenizer.encode(tokenizer.decode(ids, False), add_special_tokens=True)
        else:
            need_tokenizer("prompt")
            special = True if body.add_special_tokens is None else body.add_special_tokens
            ids = await asyncio.to_thread(tokenizer.encode, body.prompt, add_special_tokens=special)
        return TokenizeResponse(tokens=ids, count=len(ids), max_model_len=core.context_len)

    @app.post("/detokenize", response_model=DetokenizeResponse)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        check_model(body.model)
        need_tokenizer("tokens")
        check_token_ids(body.tokens, vocab, "tokens")
        return DetokenizeResponse(prompt=await asyncio.to_thread(tokenizer.decode, body.tokens, False))

    @app.post("/v1/completions/render", response_model=list[RenderedRequest])
    async def render_completion(body: CompletionRequest) -> list[RenderedRequest]:
        """One token-in request per prompt (vLLM's shape); nothing is generated."""
        check_model(body.model)
        prompt = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if isinstance(prompt[0], int):
            prompts = [list(prompt)]
        elif isinstance(prompt[0], str):
            need_tokenizer("prompt")
            prompts = await asyncio.to_thread(lambda: [tokenizer.encode(p) for p in prompt])
        else:
            prompts = [list(p) for p in prompt]
        params = sampling(body.sampling_params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        return [
            RenderedRequest(
                request_id=rid if len(prompts) == 1 else f"{rid}-{i}",
                model=model_name,
                token_ids=ids,
                sampling_params=rendered(ids, params, "prompt"),
                stream=body.stream,
            )
            for i, ids in enumerate(prompts)
        ]

    @app.post("/v1/chat/completions/render", response_model=RenderedRequest)
    async def render_chat(body: ChatCompletionRequest) -> RenderedRequest:
        """The chat template's prompt as a token-in request (vLLM's shape); nothing is generated."""
        check_model(body.model)
        need_tokenizer("messages")
        ids = await asyncio.to_thread(
            template, body.messages, body.add_generation_prompt, body.tool_dicts, body.chat_template_kwargs
        )
        return RenderedRequest(
            request_id=f"chatcmpl-{uuid.uuid4().hex}",
            model=model_name,
            token_ids=ids,
            sampling_params=rendered(ids, sampling(lambda: body.sampling_params(room(ids))), "messages"),
            stream=body.stream,
        )

    @app.api_route("/get_load", methods=["GET", "HEAD"], responses=_LOAD_RESPONSES, response_model=None)
    async def get_load(request: Request) -> Response:
        running = len(core.scheduler.running)
        if request.app.state.load_format == "vllm":
            return JSONResponse({"load": engine.num_open})
        caches = core.caches
        used_pages = caches.pages.size - caches.num_available_pages
        entry = SglangLoad(
            dp_rank=0,
            num_reqs=running,
            num_waiting_reqs=engine.num_waiting,
            num_tokens=used_pages * core.config.page_size,
        )
        return JSONResponse([entry.model_dump()])

    def model_info() -> ModelInfo:
        return ModelInfo(
            model_path=model_path,
            tokenizer_path=None if tokenizer is None else str(core.config.tokenizer or model_path),
            served_model_name=model_name,
            model_type="glm5_next",
            max_model_len=core.context_len,
        )

    for path in ("/model_info", "/get_model_info"):
        app.api_route(path, methods=["GET", "HEAD"], response_model=ModelInfo)(model_info)

    @app.api_route("/get_server_info", methods=["GET", "HEAD"], response_model=dict[str, Any])
    async def get_server_info() -> dict[str, Any]:
        """`/server_info` under SGLang's name."""
        (server_info,) = [r.endpoint for r in app.routes if getattr(r, "path", None) == "/server_info"]
        return await server_info()

    @app.api_route("/kv_event_sources", methods=["GET", "HEAD"], response_model=dict[str, KVEventSource])
    async def kv_event_sources(request: Request) -> dict[str, Any]:
        """Where this server publishes its KV events, keyed by data-parallel rank (vLLM's shape); empty
        without `--kv-events-endpoint`."""
        publisher = request.app.state.kv_events
        return {} if publisher is None else publisher.describe()

    @app.post("/flush_cache", response_model=FlushResponse)
    async def flush_cache() -> FlushResponse:
        """Empty the prefix cache, on the engine thread between steps, when no request is open."""
        if not await engine.call(lambda core: flush_prefix_cache(core, engine.num_open)):
            raise APIError(409, "requests are running; flush the cache when the server is idle", None)
        return FlushResponse(message="the prefix cache is empty")


def flush_prefix_cache(engine, num_open: int) -> bool:
    """On the engine thread: empty the prefix cache (True), or False while any request is unfinished
    (in the engine, or `num_open` requests the server has not finished answering)."""
    if num_open or engine.has_unfinished():
        return False
    prefix = engine.caches.prefix
    if prefix is not None:
        prefix.clear()
    return True
