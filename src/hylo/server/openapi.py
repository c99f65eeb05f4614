"""`/openapi.json` as the server really behaves: OpenAI-format errors with the statuses each route
can answer (not FastAPI's 422), token ids bounded by this model's vocabulary, SSE for streams, and
the bearer key where `--api-key` guards /v1."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from hylo.server.protocol import TOKEN_ID_MARK, ErrorResponse

_ERRORS = {
    400: "invalid parameter (the message and `param` name it)",
    404: "unknown model",
    413: "body larger than --max-request-bytes",
    429: "waiting queue full (--max-queued-requests); see Retry-After",
    500: "the engine failed while serving this request",
    503: "the engine has stopped",
}
_POST_ERRORS = (400, 404, 413, 429, 500, 503)
# One server-sent event: `data` is a JSON chunk, an error object, or the final `[DONE]`.
_SSE_EVENT = {
    "type": "object",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def describe(app: FastAPI, vocab_size: int, keyed: bool) -> None:
    def build() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version="1", routes=app.routes)
            _patch(schema, vocab_size, keyed)
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
    _bound_token_ids(schema, vocab_size - 1)
    if keyed:
        components["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    for path, item in schema["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            responses.pop("422", None)
            codes = _POST_ERRORS if method == "post" else ()
            if path.startswith("/v1/models/"):
                codes = (404,)
            if keyed and path.startswith("/v1"):
                op["security"] = [{"bearer": []}]
                codes = (*codes, 401)
            for code in codes:
                description = "missing or wrong API key" if code == 401 else _ERRORS[code]
                responses[str(code)] = {
                    "description": description,
                    "content": {
                        "application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}
                    },
                }
            if "429" in responses:
                responses["429"]["headers"] = {"Retry-After": {"schema": {"type": "integer"}}}
            if path in ("/v1/completions", "/v1/chat/completions"):
                responses["200"]["description"] = "the completion, or with `stream: true` SSE chunks"
                responses["200"]["content"]["text/event-stream"] = {"schema": _SSE_EVENT}
    paths = schema["paths"]
    paths["/health"]["get"]["responses"] = {
        "200": {"description": "the engine is serving"},
        "503": {"description": "the engine has stopped"},
    }
    paths["/metrics"]["get"]["responses"] = {
        "200": {
            "description": "Prometheus metrics",
            "content": {"text/plain": {"schema": {"type": "string"}}},
        }
    }


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
