"""Anthropic Messages API request and error schemas (`/v1/messages`), and the chat request each
Messages request runs as: the same chat template, tool-call and reasoning parsers, sampling and
engine path as `/v1/chat/completions`. Like `protocol.py`, these models are the route's OpenAPI
schema, so every rule the route enforces statically lives here."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, model_validator

from hylo.sampling import MAX_STOP_STRINGS
from hylo.server.protocol import (
    _PARAMETERS_SCHEMA,
    _REQUEST,
    FUNCTION_NAME,
    StopString,
    Text,
    _int,
    _object_schema,
    required_with_type,
)


class TextBlock(BaseModel):
    model_config = _REQUEST

    type: Literal["text"]
    text: Text


class ThinkingBlock(BaseModel):
    """A reply's reasoning, sent back in a later turn; the chat template is not shown it."""

    model_config = _REQUEST

    type: Literal["thinking"]
    thinking: Text
    signature: str | None = None


class ToolUseBlock(BaseModel):
    """An assistant turn's call of a tool: rendered as the chat route's `tool_calls` entry."""

    model_config = _REQUEST

    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(pattern=FUNCTION_NAME)
    input: dict[str, Any]


class ToolResultBlock(BaseModel):
    """A user turn's answer to the `tool_use` of id `tool_use_id`: rendered as a `tool` message."""

    model_config = _REQUEST

    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: Text | list[TextBlock] = ""
    is_error: bool | None = None


ContentBlock = Annotated[
    TextBlock | ThinkingBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")
]


def _blocks_allowed(kinds: tuple[str, ...]) -> dict[str, Any]:
    """The schema of a turn's content whose blocks are of `kinds`."""
    blocks = {"type": "array", "items": {"properties": {"type": {"enum": list(kinds)}}}}
    return {"properties": {"content": {"anyOf": [{"type": "string"}, blocks]}}}


# the blocks each role's turn may hold (`InputMessage._blocks_of_role`)
BLOCKS_OF_ROLE = {"user": ("text", "tool_result"), "assistant": ("text", "thinking", "tool_use")}


class InputMessage(BaseModel):
    # the schema's form of `_blocks_of_role`
    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {"properties": {"role": {"const": "user"}}, "required": ["role"]},
            "then": _blocks_allowed(BLOCKS_OF_ROLE["user"]),
            "else": _blocks_allowed(BLOCKS_OF_ROLE["assistant"]),
        }
    )

    role: Literal["user", "assistant"]
    content: Text | Annotated[list[ContentBlock], Field(min_length=1)]

    @model_validator(mode="after")
    def _blocks_of_role(self) -> InputMessage:
        """A user turn holds text and tool_result blocks; an assistant turn text, thinking, tool_use."""
        allowed = BLOCKS_OF_ROLE[self.role]
        for block in self.content if isinstance(self.content, list) else ():
            if block.type not in allowed:
                raise ValueError(
                    f"{self.role} turns cannot hold {block.type} blocks (only {', '.join(allowed)})"
                )
        return self


class ToolDefinition(BaseModel):
    """A client tool. Other fields (`cache_control`, ...) are ignored."""

    model_config = _REQUEST

    type: Literal["custom"] | None = None
    name: str = Field(pattern=FUNCTION_NAME, description="a-z, A-Z, 0-9, _ and -; at most 64 characters")
    description: str | None = None
    input_schema: Annotated[dict[str, Any], AfterValidator(_object_schema)] = Field(
        description="the JSON schema of the tool's input (an object)", json_schema_extra=_PARAMETERS_SCHEMA
    )


class ToolChoice(BaseModel):
    """auto: calls parsed from the reply; any: the reply is tool calls only; tool: one call of `name`;
    none: calls stay text. Each is the chat route's auto / required / named function / none."""

    model_config = _REQUEST | ConfigDict(
        json_schema_extra={
            "if": {"properties": {"type": {"const": "tool"}}, "required": ["type"]},
            "then": {"required": ["name"], "properties": {"name": {"type": "string"}}},
        }
    )

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = Field(None, min_length=1, description="with type tool: one of tools (400 otherwise)")
    disable_parallel_tool_use: bool | None = None

    @model_validator(mode="after")
    def _named(self) -> ToolChoice:
        return required_with_type(self, "tool", "name")

    def chat(self) -> str | dict[str, Any]:
        """The chat route's `tool_choice` of the same meaning."""
        if self.type == "tool":
            return {"type": "function", "function": {"name": self.name}}
        return {"auto": "auto", "any": "required", "none": "none"}[self.type]


class ThinkingConfig(BaseModel):
    """disabled: the chat template is told `enable_thinking: false`; enabled: the template's default
    (the budget is not enforced: max_tokens bounds the whole reply)."""

    model_config = _REQUEST

    type: Literal["enabled", "disabled"]
    budget_tokens: _int(ge=1) | None = None


class MessagesRequest(BaseModel):
    """Unknown fields (`metadata`, `service_tier`, ...) are ignored."""

    model_config = _REQUEST

    model: str = Field(description="the served model name (404 otherwise)")
    max_tokens: _int(ge=1) = Field(description="the most tokens the reply may hold")
    messages: list[InputMessage] = Field(min_length=1)
    system: Text | list[TextBlock] | None = None
    stop_sequences: Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    temperature: float = Field(1.0, ge=0, le=1)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: _int(ge=1) | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: ToolChoice | None = None
    thinking: ThinkingConfig | None = None

    def chat_request(self) -> dict[str, Any]:
        """The `/v1/chat/completions` body this request runs as. Each stop sequence is kept in the
        output (`include_stop_str_in_output`) so the route can tell which one ended the reply (the
        engine ends a stopped reply's text with the whole stop string) and cut it."""
        messages: list[dict[str, Any]] = []
        if self.system is not None:
            system = self.system if isinstance(self.system, str) else "".join(b.text for b in self.system)
            messages.append({"role": "system", "content": system})
        for message in self.messages:
            messages += _chat_messages(message)
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": -1 if self.top_k is None else self.top_k,
            "stream": self.stream,
        }
        if self.stop_sequences:
            body |= {"stop": self.stop_sequences, "include_stop_str_in_output": True}
        if self.tools is not None:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "parameters": t.input_schema}
                    | ({} if t.description is None else {"description": t.description}),
                }
                for t in self.tools
            ]
        if self.tool_choice is not None:
            body["tool_choice"] = self.tool_choice.chat()
        if self.thinking is not None and self.thinking.type == "disabled":
            body["chat_template_kwargs"] = {"enable_thinking": False}
        return body


def _text(content: str | list[TextBlock]) -> str:
    return content if isinstance(content, str) else "".join(b.text for b in content)


def _chat_messages(message: InputMessage) -> list[dict[str, Any]]:
    """One Messages turn as chat messages, in order: a user turn's text as user messages and each
    `tool_result` as a `tool` message; an assistant turn's text as its content and each `tool_use`
    as a tool call (arguments as a JSON object string, as OpenAI clients send them). Thinking
    blocks are dropped (the chat route's messages carry no reasoning)."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        text = "".join(b.text for b in message.content if isinstance(b, TextBlock))
        calls = [
            {"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
            for b in message.content
            if isinstance(b, ToolUseBlock)
        ]
        return [
            {"role": "assistant", "content": text or (None if calls else "")}
            | ({"tool_calls": calls} if calls else {})
        ]
    out: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, ToolResultBlock):
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": _text(block.content)})
        elif isinstance(block, TextBlock):
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += block.text
            else:
                out.append({"role": "user", "content": block.text})
    return out


class AnthropicErrorDetail(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    """Anthropic's error shape: `{"type": "error", "error": {"type", "message"}}`."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int


class ResponseTextBlock(BaseModel):
    type: Literal["text"]
    text: str


class ResponseThinkingBlock(BaseModel):
    type: Literal["thinking"]
    thinking: str
    signature: str


class ResponseToolUseBlock(BaseModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ResponseTextBlock | ResponseThinkingBlock | ResponseToolUseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: MessagesUsage
