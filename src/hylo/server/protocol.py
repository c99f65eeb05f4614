"""OpenAI request and response schemas (with the usual vLLM/SGLang extensions) and their
SamplingParams. These models are the server's OpenAPI schema, so every constraint the server
enforces statically lives here; what depends on the model (vocabulary, context) is patched into the
schema by `openapi.py` and checked by the engine."""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hylo.sampling import (
    MAX_CONSTRAINT_LENGTH,
    MAX_LOGIT_BIAS,
    MAX_N,
    MAX_STOP_LENGTH,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)

JSON_SAFE_INT = 2**53 - 1
# Marks token-id schemas so the app can set their maximum to the model's vocabulary.
TOKEN_ID_MARK = "x-hylo-token-id"
TOKEN_ID_KEY = "(0|[1-9][0-9]{0,8})"
# Arguments of the template call itself; a kwarg of the same name would collide with them.
RESERVED_TEMPLATE_KWARGS = ("messages", "add_generation_prompt", "tools")
RequestT = TypeVar("RequestT", bound=BaseModel)


def has_surrogate(text: str) -> bool:
    """A lone UTF-16 surrogate (valid in JSON's \\uD800 escapes, invalid Unicode text)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False


def _unicode(text: str) -> str:
    if has_surrogate(text):
        raise ValueError("contains a lone surrogate, which is not valid Unicode text")
    return text


def _json_int(value: object) -> object:
    """JSON Schema's integer: 2.0 is one, true is not (Python's bool is an int)."""
    if isinstance(value, bool):
        raise ValueError("Input should be a valid integer")
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _int(**bounds: Any) -> Any:
    """An integer field type with its bounds. They go inside, before the validator, so that the
    schema states them as JSON Schema's minimum/maximum."""
    return Annotated[int, Field(**bounds), BeforeValidator(_json_int)]


def _no_reserved(kwargs: dict[str, Any]) -> dict[str, Any]:
    clash = [k for k in RESERVED_TEMPLATE_KWARGS if k in kwargs]
    if clash:
        raise ValueError(f"{clash[0]!r} is set by the request itself, not by a template kwarg")
    return kwargs


Text = Annotated[str, AfterValidator(_unicode)]
# A request's `chat_template_kwargs`: extra variables of the chat template, none named as an argument
# of the template call itself (the schema states it, the validator says which one clashes)
TemplateKwargs = Annotated[
    dict[str, Any],
    Field(json_schema_extra={"propertyNames": {"not": {"enum": list(RESERVED_TEMPLATE_KWARGS)}}}),
    AfterValidator(_no_reserved),
]
TokenId = _int(ge=0, json_schema_extra={TOKEN_ID_MARK: True})
StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_LENGTH)]
Penalty = Annotated[float, Field(ge=-2, le=2)]


def required_with_type(model: RequestT, kind: str, field: str) -> RequestT:
    """`model` where it has its `field` whenever its `type` is `kind` (the rule a schema's if/then on
    `type` states), else a ValueError naming both."""
    if model.type == kind and getattr(model, field) is None:
        raise ValueError(f"{field} is required with type {kind}")
    return model


# Strict: JSON's types as the schema states them (no "1" for 1, no true for 1.0)
_REQUEST = ConfigDict(extra="ignore", strict=True, allow_inf_nan=False)


class StreamOptions(BaseModel):
    model_config = _REQUEST

    include_usage: bool = False
    continuous_usage_stats: bool = Field(False, description="usage so far in every chunk (vLLM)")


class JsonSchemaFormat(BaseModel):
    model_config = _REQUEST

    name: str = Field(max_length=64)
    description: str | None = None
    # the JSON schema itself ("schema" is a BaseModel attribute: the field keeps its JSON name)
    schema_: dict[str, Any] = Field(default_factory=dict, alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """text (the default), json_object (any JSON object) or json_schema (output that matches it)."""

    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
            "then": {"required": ["json_schema"], "properties": {"json_schema": {"not": {"type": "null"}}}},
        }
    )

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        return required_with_type(self, "json_schema", "json_schema")

    def constraint(self) -> str | None:
        """The JSON schema (text) the output must match, if any."""
        if self.type == "json_object":
            return json.dumps({"type": "object"})
        if self.type == "json_schema":
            return json.dumps(self.json_schema.schema_)
        return None


Constraint = Annotated[str, Field(min_length=1, max_length=MAX_CONSTRAINT_LENGTH)]


def _given(field: str, value: dict) -> dict:
    return {"required": [field], "properties": {field: value}}


_REGEX, _EBNF = _given("regex", {"type": "string"}), _given("ebnf", {"type": "string"})
_JSON_FORMAT = _given(
    "response_format",
    {
        "type": "object",
        "required": ["type"],
        "properties": {"type": {"enum": ["json_object", "json_schema"]}},
    },
)
# a request that gives one of the structured-output constraints
CONSTRAINT_GIVEN = [_REGEX, _EBNF, _JSON_FORMAT]


def describe_tool_choice(request: dict[str, Any], tool_calls: bool, excluded: dict[str, Any]) -> None:
    """`tool_choice` in a request's JSON schema (chat's, the Responses API's) as this server honours it:
    without a --tool-call-parser (`tool_calls` False) only none or auto; with one, `required` or a
    named function needs `tools`, and the request must not match `excluded` (the output constraints
    a forced call cannot share the reply with). That a named function is among `tools` the schema
    cannot say: the field's description does, and the 400 names it."""
    choice = request["properties"]["tool_choice"]
    if not tool_calls:
        choice["anyOf"] = [{"type": "string", "enum": ["none", "auto"]}, {"type": "null"}]
        choice["description"] = "none or auto (required or a named function needs --tool-call-parser)"
        return
    forced = {"anyOf": [{"const": "required"}, {"type": "object"}]}
    request["if"] = {"properties": {"tool_choice": forced}, "required": ["tool_choice"]}
    request["then"] = {
        "required": ["tools"],
        "properties": {"tools": {"type": "array", "minItems": 1}},
        "not": excluded,
    }


# the schema's form of SamplingParams' one-constraint rule: no two of a JSON format, regex and ebnf
ONE_CONSTRAINT = {
    "not": {
        "anyOf": [
            {"allOf": pair} for pair in ([_REGEX, _EBNF], [_REGEX, _JSON_FORMAT], [_EBNF, _JSON_FORMAT])
        ]
    }
}


class _Common(BaseModel):
    """Fields both endpoints share. Unknown fields are ignored, as OpenAI's API does."""

    model_config = _REQUEST | ConfigDict(json_schema_extra=ONE_CONSTRAINT)

    model: str | None = None
    n: _int(ge=1, le=MAX_N) = 1
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: _int(ge=-1) = -1
    min_p: float = Field(0.0, ge=0, le=1)
    # JSON integers beyond 2**53 are not portable (RFC 8259 section 6: many parsers hold numbers in
    # doubles); well inside the sampler's range, seed + i (sequence i) included.
    seed: _int(ge=-JSON_SAFE_INT, le=JSON_SAFE_INT) | None = None
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stop_token_ids: list[TokenId] = Field(default_factory=list, max_length=MAX_STOP_TOKEN_IDS)
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = Field(
        None,
        max_length=MAX_LOGIT_BIAS,
        description="token id (as a string) -> added to its logit",
        json_schema_extra={"propertyNames": {"pattern": f"^{TOKEN_ID_KEY}$", TOKEN_ID_MARK: "key"}},
    )
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0)
    ignore_eos: bool = False
    min_tokens: _int(ge=0, description="at most max_tokens are generated whatever this says") = 0
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    user: str | None = None
    response_format: ResponseFormat | None = Field(
        None, description="json_object / json_schema: the output is JSON matching it (structured outputs)"
    )
    # whether a constraint compiles is more than a schema can say: one that does not is a 400 naming it
    regex: Constraint | None = Field(
        None, description="extension: the output matches this regular expression (400 if it does not compile)"
    )
    ebnf: Constraint | None = Field(
        None, description="extension: the output matches this GBNF grammar (400 if it does not compile)"
    )

    @field_validator("logit_bias")
    @classmethod
    def _bias_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(re.fullmatch(TOKEN_ID_KEY, k) for k in value):
            raise ValueError("keys must be token ids")
        return value

    def _sampling(
        self, max_tokens: int, logprobs: int | None, prompt_logprobs: int | None = None, n: int | None = None
    ) -> SamplingParams:
        return SamplingParams(
            n=n or self.n, temperature=self.temperature, top_p=self.top_p, top_k=self.top_k, min_p=self.min_p,
            seed=self.seed, max_tokens=max_tokens, min_tokens=min(self.min_tokens, max_tokens),
            stop=self.stop, stop_token_ids=self.stop_token_ids, ignore_eos=self.ignore_eos,
            repetition_penalty=self.repetition_penalty, frequency_penalty=self.frequency_penalty,
            presence_penalty=self.presence_penalty, logprobs=logprobs, prompt_logprobs=prompt_logprobs,
            skip_special_tokens=self.skip_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logit_bias={int(k): v for k, v in (self.logit_bias or {}).items()},
            json_schema=self.response_format.constraint() if self.response_format else None,
            regex=self.regex, ebnf=self.ebnf,
        )  # fmt: skip

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats


class CompletionRequest(_Common):
    # the schema's form of `_zero_tokens_echo`: without `echo: true`, max_tokens is at least 1
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {"not": {"properties": {"echo": {"const": True}}, "required": ["echo"]}},
            "then": {
                "properties": {"max_tokens": {"anyOf": [{"type": "integer", "minimum": 1}, {"type": "null"}]}}
            },
        }
        | ONE_CONSTRAINT
    )
    prompt: (
        Annotated[Text, Field(min_length=1)]
        | Annotated[list[Annotated[Text, Field(min_length=1)]], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    # before max_tokens, whose validator reads it
    echo: StrictBool = Field(
        False, description="the prompt before the completion, with its logprobs when logprobs is set"
    )
    max_tokens: _int(ge=0) | None = Field(
        16, description="null means 16, OpenAI's default; 0 (with echo) scores the prompt only"
    )
    logprobs: _int(ge=0, le=20) | None = None
    # after n and stream (in _Common), which its validator reads
    best_of: _int(ge=1, le=MAX_N) | None = Field(
        None,
        description="sequences generated per prompt, of which the n with the highest mean token logprob "
        "are returned; at least n, and n itself with stream (400 otherwise)",
    )

    @field_validator("best_of")
    @classmethod
    def _best_of_n(cls, value: int | None, info: ValidationInfo) -> int | None:
        n = info.data.get("n", 1)
        if value is not None and value < n:
            raise ValueError(f"must be at least n ({n}): the n best of best_of sequences are returned")
        if value is not None and value != n and info.data.get("stream"):
            raise ValueError(f"must equal n ({n}) with stream: the best are known once all have finished")
        return value

    @field_validator("max_tokens")
    @classmethod
    def _zero_tokens_echo(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value == 0 and not info.data.get("echo"):
            raise ValueError("0 generates nothing: it scores the prompt, with echo: true")
        return value

    def sampling_params(self) -> SamplingParams:
        max_tokens = 16 if self.max_tokens is None else self.max_tokens
        scored = self.echo and (self.logprobs is not None or max_tokens == 0)
        n = self.best_of or self.n
        # the best of best_of are ranked by their tokens' logprobs (the sampled token's is always there)
        logprobs = 0 if self.logprobs is None and n > self.n else self.logprobs
        return self._sampling(max_tokens, logprobs, (self.logprobs or 0) if scored else None, n)


class TextPart(BaseModel):
    model_config = _REQUEST

    type: Literal["text"]
    text: Text


class ChatMessage(BaseModel):
    """The fields chat templates read; other fields are ignored."""

    # the schema's form of `_content_or_calls`
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {
                "properties": {
                    "role": {"const": "assistant"},
                    "tool_calls": {"type": "array", "minItems": 1},
                },
                "required": ["role", "tool_calls"],
            },
            "else": {"required": ["content"], "properties": {"content": {"not": {"type": "null"}}}},
        }
    )

    role: Literal["system", "user", "assistant", "tool"]
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant turn's calls (agent loops)
    tool_call_id: str | None = None  # a tool turn's answer to that call
    # after role and tool_calls, which its validator reads
    content: Text | list[TextPart] | None = Field(None, validate_default=True)

    @field_validator("content")
    @classmethod
    def _content_or_calls(cls, value: object, info: ValidationInfo) -> object:
        if value is None and not (info.data.get("role") == "assistant" and info.data.get("tool_calls")):
            raise ValueError("required, except for an assistant message with tool_calls")
        return value


class FunctionName(BaseModel):
    model_config = _REQUEST

    name: str = Field(min_length=1)


class NamedToolChoice(BaseModel):
    model_config = _REQUEST

    type: Literal["function"]
    function: FunctionName


# OpenAI's rule for a function's name
FUNCTION_NAME = "^[a-zA-Z0-9_-]{1,64}$"
_PARAMETERS_SCHEMA = {
    "properties": {
        "type": {"const": "object"},
        "properties": {"type": "object", "additionalProperties": {"type": ["object", "boolean"]}},
        "required": {"type": "array", "items": {"type": "string"}},
    }
}


def _object_schema(value: dict[str, Any]) -> dict[str, Any]:
    """A function's parameters: the JSON schema of an object (`_PARAMETERS_SCHEMA`, OpenAI's rule)."""
    if value.get("type", "object") != "object":
        raise ValueError(f"must be the JSON schema of an object (type 'object'), not {value['type']!r}")
    properties = value.get("properties", {})
    if not isinstance(properties, dict) or not all(isinstance(p, dict | bool) for p in properties.values()):
        raise ValueError("properties must map each argument's name to its JSON schema (an object)")
    required = value.get("required", [])
    if not isinstance(required, list) or not all(isinstance(r, str) for r in required):
        raise ValueError("required must be a list of argument names")
    return value


class FunctionSpec(BaseModel):
    """A function the model may call, as OpenAI defines one: chat's `tools[].function`, the Responses
    API's function tool."""

    model_config = _REQUEST

    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -; at most 64 characters")
    description: str | None = None
    parameters: Annotated[dict[str, Any], AfterValidator(_object_schema)] | None = Field(
        None,
        description="the JSON schema of the arguments (an object); none means no arguments",
        json_schema_extra=_PARAMETERS_SCHEMA,
    )
    strict: bool | None = None


class FunctionDefinition(FunctionSpec):
    """Other fields are kept: the chat template renders the tool as it came."""

    model_config = _REQUEST | ConfigDict(extra="allow")


class Tool(BaseModel):
    model_config = _REQUEST | ConfigDict(extra="allow")

    type: Literal["function"]
    function: FunctionDefinition


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: _int(ge=1) | None = Field(None, description="deprecated alias of max_completion_tokens")
    max_completion_tokens: _int(ge=1) | None = None
    logprobs: bool = False
    top_logprobs: _int(ge=0, le=20) | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: TemplateKwargs = Field(default_factory=dict)
    tools: list[Tool] | None = None
    # whether a choice can be honoured (a tool of that name, the server's --tool-call-parser) is more
    # than a schema can say: a 400 naming tool_choice says when it cannot
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None,
        description="none: tool calls stay text; auto (the default with tools): parsed; required or a "
        "named function: the reply is tool calls only (of that function), constrained by a grammar",
    )
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = Field(
        None,
        description="a chat template variable of that name; none also turns thinking off "
        "(enable_thinking and thinking false) unless chat_template_kwargs sets a switch",
    )

    @model_validator(mode="after")
    def _thinking_switches(self) -> ChatCompletionRequest:
        self.chat_template_kwargs = thinking_kwargs(self.chat_template_kwargs, self.reasoning_effort)
        return self

    @property
    def tool_dicts(self) -> list[dict[str, Any]] | None:
        """The tools as they came (for the chat template and the tool-call parsers)."""
        return None if self.tools is None else [t.model_dump(exclude_unset=True) for t in self.tools]

    def sampling_params(self, default_max_tokens: int) -> SamplingParams:
        """`max_completion_tokens`, else `max_tokens`, else what room the context leaves."""
        max_tokens = next(
            (v for v in (self.max_completion_tokens, self.max_tokens) if v is not None), default_max_tokens
        )
        return self._sampling(max_tokens, (self.top_logprobs or 0) if self.logprobs else None)


def thinking_kwargs(kwargs: dict[str, Any], reasoning_effort: str | None = None) -> dict[str, Any]:
    """Chat template variables with the thinking switches the GLM recipes use made one: GLM's
    templates read `enable_thinking`, other templates (and SGLang's docs) `thinking`; whichever the
    request sets (`enable_thinking` first) sets both. `reasoning_effort` becomes a variable too, and
    `none` turns thinking off where no switch is set."""
    kwargs = dict(kwargs)
    switch = kwargs.get("enable_thinking", kwargs.get("thinking"))
    if reasoning_effort is not None:
        kwargs.setdefault("reasoning_effort", reasoning_effort)
        if switch is None and reasoning_effort == "none":
            switch = False
    if switch is not None:
        kwargs["enable_thinking"] = kwargs["thinking"] = switch
    return kwargs


class TokenizeRequest(BaseModel):
    model_config = _REQUEST

    model: str | None = None
    prompt: Text
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = _REQUEST

    model: str | None = None
    tokens: list[TokenId]


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: Literal["stop", "length", "abort"] | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: Literal["stop", "length", "abort", "tool_calls"] | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    tokens: list[int]
    count: int
    max_model_len: int


class DetokenizeResponse(BaseModel):
    prompt: str


def error_body(message: str, kind: str, code: int, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}
