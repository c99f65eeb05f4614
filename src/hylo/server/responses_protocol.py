"""OpenAI Responses API request and response schemas (`/v1/responses`), and the chat request each
Responses request runs as: the same chat template, tool-call and reasoning parsers, sampling,
structured outputs and engine path as `/v1/chat/completions`. Like `protocol.py`, these models are
the route's OpenAPI schema, so every rule the route enforces statically lives here; a feature this
server does not have (built-in tools, background mode, ...) is a rule of its own whose 400 names it.

Safe to use when: every `ResponsesRequest` (with any stored conversation of valid items) makes a
chat request that `ChatCompletionRequest` accepts: each field here is at least as strict as the
chat field it becomes."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    Tag,
    TypeAdapter,
    ValidationInfo,
    field_validator,
    model_validator,
)

from hylo.sampling import MAX_STOP_STRINGS
from hylo.server.protocol import (
    _REQUEST,
    JSON_SAFE_INT,
    FunctionSpec,
    Penalty,
    StopString,
    Text,
    _int,
    describe_tool_choice,
)


def _only(kinds: tuple[str, ...], what: str, why: str) -> Any:
    """A validator run before a tagged object's own: an object whose `type` is not one of `kinds` is
    refused with a message naming that type as a feature this server lacks (not pydantic's tag error)."""

    def check(value: Any) -> Any:
        kind = value.get("type") if isinstance(value, dict) else None
        if isinstance(kind, str) and kind not in kinds:
            raise ValueError(f"{what} of type {kind!r} are not supported ({why}; only {', '.join(kinds)})")
        return value

    return BeforeValidator(check)


class TextContent(BaseModel):
    """A message's text: `input_text` (what clients send) or `output_text` (an earlier reply sent back)."""

    model_config = _REQUEST

    type: Literal["input_text", "output_text"]
    text: Text


ContentPart = Annotated[
    TextContent, _only(("input_text", "output_text"), "content parts", "the model reads text")
]


class MessageItem(BaseModel):
    """A turn of the conversation; `developer` is rendered as `system`. Other fields (`id`, `status`)
    are ignored."""

    model_config = _REQUEST

    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: Text | list[ContentPart]


class FunctionCallItem(BaseModel):
    """An earlier reply's call of a function (an output item sent back): rendered as an assistant
    turn's tool call."""

    model_config = _REQUEST

    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    # not held to the rule of a tool's name: a reply in `tool_choice` auto may call any name it wrote
    name: str
    arguments: Text = Field(description="the arguments as a JSON object's text")


class FunctionCallOutputItem(BaseModel):
    """The client's result of the call `call_id`: rendered as a `tool` turn."""

    model_config = _REQUEST

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Text | list[ContentPart]


class ReasoningItem(BaseModel):
    """An earlier reply's reasoning (an output item sent back); the chat template is not shown it."""

    model_config = _REQUEST

    type: Literal["reasoning"]
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None


ITEM_KINDS = ("message", "function_call", "function_call_output", "reasoning")


def _item_kind(value: Any) -> str | None:
    """An input item's tag: its `type`, `message` where it has none (OpenAI's short form)."""
    if isinstance(value, dict):
        return value.get("type", "message")
    return getattr(value, "type", None)


InputItem = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningItem, Tag("reasoning")],
    Discriminator(
        _item_kind,
        custom_error_type="input_item",
        custom_error_message="an input item is an object: a message, function_call, function_call_output or "
        "reasoning item",
    ),
    _only(ITEM_KINDS, "input items", "items of built-in tools and item references do not exist here"),
]
INPUT_ITEMS = TypeAdapter(list[InputItem])
# an input of reasoning items alone has nothing to render: the schema's form of `_renders_something`
_NOT_REASONING = {"not": {"properties": {"type": {"const": "reasoning"}}, "required": ["type"]}}


def _renders_something(items: list[Any]) -> list[Any]:
    if all(isinstance(item, ReasoningItem) for item in items):
        raise ValueError("needs an item other than reasoning (reasoning items are not rendered)")
    return items


class FunctionTool(FunctionSpec):
    type: Literal["function"]


class FunctionToolChoice(BaseModel):
    model_config = _REQUEST

    type: Literal["function"]
    name: str = Field(min_length=1, description="one of tools (400 otherwise)")


class TextFormat(BaseModel):
    """text (the default), json_object (any JSON object) or json_schema (output matching `schema`)."""

    # the schema's form of `_schema_with_its_type`
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "json_schema"}}, "required": ["type"]},
            "then": {
                "required": ["name", "schema"],
                "properties": {"name": {"type": "string"}, "schema": {"type": "object"}},
            },
        }
    )

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(None, max_length=64)
    description: str | None = None
    # the JSON schema itself ("schema" is a BaseModel attribute: the field keeps its JSON name)
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> TextFormat:
        if self.type == "json_schema" and (self.name is None or self.schema_ is None):
            raise ValueError("name and schema are required with type json_schema")
        return self

    def chat(self) -> dict[str, Any]:
        """The chat route's `response_format` of the same meaning."""
        if self.type != "json_schema":
            return {"type": self.type}
        schema = {"name": self.name, "schema": self.schema_}
        return {
            "type": "json_schema",
            "json_schema": schema | ({} if self.strict is None else {"strict": self.strict}),
        }


class TextConfig(BaseModel):
    """Other fields (`verbosity`) are ignored: the chat template has no such switch."""

    model_config = _REQUEST

    format: TextFormat | None = None


class ReasoningConfig(BaseModel):
    """`effort` is the chat route's `reasoning_effort` (a chat template variable; none turns thinking
    off). The reply's reasoning comes whole in the reasoning item's `content`: `summary` asks for
    nothing more (its `summary` stays empty)."""

    model_config = _REQUEST

    effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


# Features this server does not have, each with its one value meaning "off" (None aside) and why
# it is refused otherwise (`ResponsesRequest._unsupported`)
UNSUPPORTED = {
    "background": (False, "background mode is not supported: a response runs while its request is open"),
    "conversation": (None, "conversations are not supported: chain responses with previous_response_id"),
    "prompt": (None, "prompt templates are not supported"),
    "include": ([], "include is not supported: outputs carry what they have (reasoning as text)"),
    "top_logprobs": (0, "logprobs are not supported here (/v1/chat/completions has them)"),
    "truncation": ("disabled", "truncation auto is not supported: an input longer than the context is a 400"),
}


class ResponsesRequest(BaseModel):
    """Unknown fields (`user`, `service_tier`, `prompt_cache_key`, `stream_options`, ...) are ignored."""

    model_config = _REQUEST

    model: str | None = None
    input: (
        Annotated[Text, Field(description="a user message")]
        | Annotated[
            list[InputItem],
            Field(min_length=1, json_schema_extra={"contains": _NOT_REASONING}),
            AfterValidator(_renders_something),
        ]
    )
    instructions: Text | None = Field(
        None, description="a system message before the input (not carried to a later previous_response_id)"
    )
    previous_response_id: str | None = Field(
        None,
        min_length=1,
        description="a stored response whose conversation (input and output items) comes before input "
        "(404 when unknown, deleted, evicted from the store, or created with store: false)",
    )
    store: bool = Field(
        True, description="keep the response for GET and previous_response_id (bounded store)"
    )
    stream: bool = False
    max_output_tokens: _int(ge=1) | None = Field(None, description="absent: what room the context leaves")
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: _int(ge=-1) = Field(-1, description="extension: sample among the k likeliest tokens (-1: all)")
    min_p: float = Field(0.0, ge=0, le=1, description="extension")
    seed: _int(ge=-JSON_SAFE_INT, le=JSON_SAFE_INT) | None = Field(None, description="extension")
    presence_penalty: Penalty = 0.0
    frequency_penalty: Penalty = 0.0
    repetition_penalty: float = Field(1.0, gt=0, description="extension")
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = Field(
        None, description="extension: strings that end the reply (not included in it)"
    )
    tools: (
        list[
            Annotated[FunctionTool, _only(("function",), "tools", "built-in tools do not run on this server")]
        ]
        | None
    ) = None
    tool_choice: (
        Literal["none", "auto", "required"]
        | Annotated[
            FunctionToolChoice,
            _only(("function",), "tool choices", "built-in tools do not run on this server"),
        ]
        | None
    ) = Field(
        None,
        description="none: calls stay text; auto (the default with tools): parsed; required or a named "
        "function: the reply is calls only (of that function), constrained by a grammar",
    )
    parallel_tool_calls: bool = Field(True, description="false: calls after a reply's first are dropped")
    reasoning: ReasoningConfig | None = None
    text: TextConfig | None = None
    metadata: dict[Annotated[str, Field(max_length=64)], Annotated[str, Field(max_length=512)]] | None = (
        Field(None, max_length=16, description="returned with the response as it came")
    )
    # the features of UNSUPPORTED: each takes null or its "off" value
    background: Literal[False] | None = Field(None, description=UNSUPPORTED["background"][1])
    conversation: None = Field(None, description=UNSUPPORTED["conversation"][1])
    prompt: None = Field(None, description=UNSUPPORTED["prompt"][1])
    include: Annotated[list[str], Field(max_length=0)] | None = Field(
        None, description=UNSUPPORTED["include"][1]
    )
    top_logprobs: Literal[0] | None = Field(None, description=UNSUPPORTED["top_logprobs"][1])
    truncation: Literal["disabled"] | None = Field(None, description=UNSUPPORTED["truncation"][1])

    @field_validator(*UNSUPPORTED, mode="before")
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        off, why = UNSUPPORTED[info.field_name]
        if value is not None and value != off:
            raise ValueError(why)
        return value

    def input_items(self) -> list[Any]:
        """The input as items (a text input is one user message)."""
        if isinstance(self.input, str):
            return [MessageItem(role="user", content=self.input)]
        return list(self.input)

    def chat_request(self, earlier: tuple[Any, ...] = ()) -> dict[str, Any]:
        """The `/v1/chat/completions` body this request runs as, after the `earlier` conversation
        (a previous response's, as input items)."""
        messages = [] if self.instructions is None else [{"role": "system", "content": self.instructions}]
        messages += chat_messages([*earlier, *self.input_items()])
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "min_p": self.min_p,
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "stop": self.stop,
            "stream": self.stream,
        }
        if self.max_output_tokens is not None:
            body["max_completion_tokens"] = self.max_output_tokens
        if self.tools is not None:
            body["tools"] = [{"type": "function", "function": self.tool_function(t)} for t in self.tools]
        if isinstance(self.tool_choice, FunctionToolChoice):
            body["tool_choice"] = {"type": "function", "function": {"name": self.tool_choice.name}}
        elif self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice
        if self.reasoning is not None and self.reasoning.effort is not None:
            body["reasoning_effort"] = self.reasoning.effort
        if self.text is not None and self.text.format is not None:
            body["response_format"] = self.text.format.chat()
        return body

    @staticmethod
    def tool_function(tool: FunctionTool) -> dict[str, Any]:
        """A tool as the chat route's `function` (the fields that were sent)."""
        return tool.model_dump(exclude_unset=True, exclude={"type"})


def _text(content: str | list[TextContent]) -> str:
    return content if isinstance(content, str) else "".join(part.text for part in content)


def chat_messages(items: list[Any]) -> list[dict[str, Any]]:
    """Input items as chat messages, in order: a message as its role's turn (`developer` as
    `system`), function calls as tool calls of the assistant turn just before them (a new one where
    the turn before is not the assistant's), a function call's output as a `tool` turn. Reasoning
    items are dropped (the chat route's messages carry no reasoning)."""
    out: list[dict[str, Any]] = []
    for item in items:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            out.append({"role": role, "content": _text(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}  # fmt: skip
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            out.append({"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output)})
    return out


# a request whose `text.format` asks for JSON output
_JSON_OUTPUT = {
    "required": ["text"],
    "properties": {
        "text": {
            "type": "object",
            "required": ["format"],
            "properties": {
                "format": {
                    "type": "object",
                    "required": ["type"],
                    "properties": {"type": {"enum": ["json_object", "json_schema"]}},
                }
            },
        }
    },
}


def describe_responses(schema: dict[str, Any], tool_calls: bool) -> None:
    """The OpenAPI schema of /v1/responses as this server behaves (`openapi.describe`, after the
    common patches): GET of a stored response answers it, DELETE a `ResponseDeleted` (one route
    serves both); `tool_choice` as `protocol.describe_tool_choice` says."""
    stored = schema["paths"]["/v1/responses/{response_id}"]
    for method, model, description in (
        ("get", "ResponseObject", "the stored response"),
        ("delete", "ResponseDeleted", "the response is deleted"),
    ):
        answer = stored[method]["responses"]["200"]
        answer["description"] = description
        answer["content"]["application/json"]["schema"] = {"$ref": f"#/components/schemas/{model}"}
    stored["head"]["responses"]["200"]["description"] = "the response is stored"  # GET's, without a body
    # no JSON output format beside a forced call
    describe_tool_choice(schema["components"]["schemas"]["ResponsesRequest"], tool_calls, _JSON_OUTPUT)
