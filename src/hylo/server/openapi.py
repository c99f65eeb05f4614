"""`/openapi.json` as the server really behaves: OpenAI-format errors with the statuses each route
can answer (not FastAPI's 422), token ids bounded by this model's vocabulary, the tool choices this
server can honour, SSE for streams, HEAD beside GET, and the bearer key where `--api-key` guards
/v1. What no JSON schema can state (a regex that compiles, a named tool among `tools`, best_of
against n) the fields' descriptions say, and the 400 names."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hylo.server.messages_protocol import AnthropicError
from hylo.server.protocol import CONSTRAINT_GIVEN, TOKEN_ID_MARK, ErrorResponse, describe_tool_choice
from hylo.server.responses_protocol import describe_responses

_ERRORS = {
    400: "invalid parameter (the message and `param` name it)",
    401: "missing or wrong API key",
    404: "unknown model, or no stored response of that id",
    409: "requests are running (the prefix cache is flushed only when the server is idle)",
    408: "the body did not arrive within --timeout-request-body seconds (the connection closes)",
    413: "body larger than --max-request-bytes",
    429: "waiting queue full (--max-queued-requests); see Retry-After",
    500: "the engine failed while serving this request",
    503: "the engine has stopped, or --limit-concurrency connections are open (see Retry-After)",
}
# Any request: its body may be late, the connections full.
_ANY_ERRORS = (408, 503)
_POST_ERRORS = (400, 404, 413, 429, 500)
# Where errors take Anthropic's shape (`hylo.server.messages.AnthropicErrors`), not OpenAI's.
_ANTHROPIC_PATHS = ("/v1/messages",)
_STREAMING = {
    "/v1/completions": "the completion, or with `stream: true` SSE chunks",
    "/v1/chat/completions": "the completion, or with `stream: true` SSE chunks",
    "/v1/messages": "the message, or with `stream: true` SSE events (Anthropic's, each named by `event`)",
    "/v1/responses": "the response, or with `stream: true` SSE events (OpenAI's, each named by `event`)",
}
# One server-sent event: `data` is a JSON chunk, an error object, or the final `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def describe(app: FastAPI, vocab_size: int, keyed: bool, tool_calls: bool) -> None:
    """`app.openapi` builds the schema once; `tool_calls`: the server has a --tool-call-parser."""

    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", routes=app.routes)
            _patch(schema, vocab_size, keyed)
            chat = schema["components"]["schemas"]["ChatCompletionRequest"]
            describe_tool_choice(chat, tool_calls, {"anyOf": CONSTRAINT_GIVEN})
            if tool_calls:
                chat["properties"]["tool_choice"]["description"] += (
                    "; a named function must be one of tools (400 otherwise)"
                )
            _anthropic_tool_choices(schema["components"]["schemas"], tool_calls)
            describe_responses(schema, tool_calls)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = build


def _patch(schema: dict[str, Any], vocab_size: int, keyed: bool) -> None:
    components = schema.setdefault("components", {})
    schemas = components.setdefault("schemas", {})
    for unused in ("HTTPValidationError", "ValidationError"):
        schemas.pop(unused, None)
    schemas["ErrorResponse"] = ErrorResponse.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schemas["ErrorResponse"].pop("$defs", {}))
    schemas["AnthropicError"] = AnthropicError.model_json_schema(ref_template="#/components/schemas/{model}")
    schemas.update(schemas["AnthropicError"].pop("$defs", {}))
    _bound_token_ids(schema, vocab_size - 1)
    if keyed:
        components["securitySchemes"] = {
            "bearer": {"type": "http", "scheme": "bearer"},
            "x-api-key": {"type": "apiKey", "in": "header", "name": "x-api-key"},  # Anthropic clients'
        }
    paths = schema["paths"]
    paths["/health"]["get"]["responses"] = {"200": {"description": "the engine is serving"}}
    paths["/metrics"]["get"]["responses"] = {
        "200": {
            "description": "Prometheus metrics",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }
    for path, item in paths.items():
        for method, op in item.items():
            responses = op["responses"]
            responses.pop("422", None)
            codes = (*(_POST_ERRORS if method == "post" else ()), *_ANY_ERRORS)
            if path.startswith(("/v1/models/", "/v1/responses/")):
                codes = (404, *codes)
            if path == "/flush_cache":
                codes = (409, *codes)
            if keyed and path.startswith("/v1"):
                op["security"] = [{"bearer": []}, {"x-api-key": []}]  # either one
                codes = (*codes, 401)
            error = "AnthropicError" if path in _ANTHROPIC_PATHS else "ErrorResponse"
            for code in sorted(codes):
                responses[str(code)] = {
                    "description": _ERRORS[code],
                    "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{error}"}}},
                }
            for code in ("429", "503"):
                if code in responses:
                    responses[code]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
            if path in _STREAMING:
                responses["200"]["description"] = _STREAMING[path]
                responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
        if "head" in item:  # GET's answers, without their bodies
            item["head"]["responses"] = {
                code: {k: v for k, v in answer.items() if k != "content"}
                for code, answer in item["get"]["responses"].items()
            }


def _anthropic_tool_choices(schemas: dict[str, Any], tool_calls: bool) -> None:
    """/v1/messages' `tool_choice` as this server honours it: without a --tool-call-parser only auto
    or none; with one, any or tool needs `tools` (that the named tool is among them the `name`
    field's description says)."""
    choice = schemas["ToolChoice"]
    if not tool_calls:
        choice["properties"]["type"] = {"type": "string", "enum": ["auto", "none"]}
        choice["description"] = "auto or none (any and tool need --tool-call-parser)"
        for rule in ("if", "then"):
            choice.pop(rule)
        return
    forced = {"properties": {"type": {"enum": ["any", "tool"]}}, "required": ["type"]}
    request = schemas["MessagesRequest"]
    request["if"] = {"properties": {"tool_choice": forced}, "required": ["tool_choice"]}
    request["then"] = {"required": ["tools"], "properties": {"tools": {"type": "array", "minItems": 1}}}


def _bound_token_ids(node: Any, maximum: int) -> None:
    """Token ids (and logit_bias's keys, token ids spelled as strings) up to `maximum`."""
    if isinstance(node, dict):
        mark = node.pop(TOKEN_ID_MARK, None)
        if mark == "key":
            node["pattern"] = f"^({_digits_up_to(maximum)})$"
        elif mark:
            node["maximum"] = maximum
        for value in node.values():
            _bound_token_ids(value, maximum)
    elif isinstance(node, list):
        for value in node:
            _bound_token_ids(value, maximum)


def _digits_up_to(maximum: int) -> str:
    """A regex alternation matching the decimal numbers 0..maximum, without leading zeros."""
    top = str(maximum)
    options = ["0"] if maximum >= 0 else []
    if len(top) > 1:
        options.append(f"[1-9][0-9]{{0,{len(top) - 2}}}")  # fewer digits than maximum
    for i, digit in enumerate(top):  # as many digits: equal up to i, then a smaller digit
        low = 1 if i == 0 else 0
        if int(digit) > low:
            options.append(f"{top[:i]}[{low}-{int(digit) - 1}][0-9]{{{len(top) - i - 1}}}")
    options.append(top)
    return "|".join(dict.fromkeys(options))
