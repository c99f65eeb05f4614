"""What a `/v1/responses` reply becomes: its output items, built piece by piece from the reply
parser with the stream events each piece makes (`OutputItems`), its usage, and the schema of the
response object they make up (`ResponseObject`)."""

from __future__ import annotations

import copy
import uuid
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field


class OutputItems:
    """One reply's output items, built from the reply parser's pieces (`add`), each call also
    returning the stream events it makes (without sequence numbers). Invariant: at most one item is
    open (`open_kind`: a message or reasoning item), always the last of `items`; a function_call item
    closes as it opens (its arguments come whole). With `one_call`, calls after the first are dropped
    (`parallel_tool_calls: false`)."""

    def __init__(self, one_call: bool):
        self.items: list[dict[str, Any]] = []
        self.open_kind: str | None = None
        self.one_call = one_call
        self.num_calls = 0

    def add(self, piece: dict[str, Any]) -> list[dict[str, Any]]:
        if "tool_calls" in piece:
            events: list[dict[str, Any]] = []
            for call in piece["tool_calls"]:
                if not (self.one_call and self.num_calls):
                    events += self._call(call)
            return events
        kind, text = (
            ("reasoning", piece["reasoning_content"])
            if "reasoning_content" in piece
            else ("message", piece["content"])
        )
        if not text:
            return []
        events = []
        if self.open_kind != kind:
            events += self.close("completed")
            events += self._open(kind)
        part = self.items[-1]["content"][0]
        part["text"] += text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        events.append(self._of_part({"type": delta, "delta": text}) | self._logprobs(kind))
        return events

    def close(self, status: str) -> list[dict[str, Any]]:
        """The open item's closing events, the item marked `status` (none when no item is open)."""
        if self.open_kind is None:
            return []
        kind, self.open_kind = self.open_kind, None
        item, index = self.items[-1], len(self.items) - 1
        part = item["content"][0]
        done = "response.output_text.done" if kind == "message" else "response.reasoning_text.done"
        item["status"] = status
        return [
            self._of_part({"type": done, "text": part["text"]}) | self._logprobs(kind),
            self._of_part({"type": "response.content_part.done", "part": dict(part)}),
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    def _open(self, kind: str) -> list[dict[str, Any]]:
        if kind == "message":
            item = {"id": f"msg_{uuid.uuid4().hex}", "type": "message", "role": "assistant",
                    "status": "in_progress", "content": []}  # fmt: skip
            part = {"type": "output_text", "text": "", "annotations": []}
        else:
            item = {"id": f"rs_{uuid.uuid4().hex}", "type": "reasoning", "status": "in_progress",
                    "summary": [], "content": []}  # fmt: skip
            part = {"type": "reasoning_text", "text": ""}
        events = [self._added(item)]
        item["content"].append(part)
        self.open_kind = kind
        return [*events, self._of_part({"type": "response.content_part.added", "part": dict(part)})]

    def _call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close("completed")
        self.num_calls += 1
        function = call["function"]
        item = {"id": f"fc_{uuid.uuid4().hex}", "type": "function_call", "status": "in_progress",
                "call_id": call["id"], "name": function["name"], "arguments": ""}  # fmt: skip
        events.append(self._added(item))
        index, arguments = len(self.items) - 1, function["arguments"]
        item |= {"arguments": arguments, "status": "completed"}
        of_item = {"item_id": item["id"], "output_index": index}
        return [
            *events,
            {"type": "response.function_call_arguments.delta", "delta": arguments} | of_item,
            {"type": "response.function_call_arguments.done", "arguments": arguments, "name": item["name"]}
            | of_item,
            {"type": "response.output_item.done", "output_index": index, "item": copy.deepcopy(item)},
        ]

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.items.append(item)
        return {
            "type": "response.output_item.added",
            "output_index": len(self.items) - 1,
            "item": copy.deepcopy(item),
        }

    def _of_part(self, event: dict[str, Any]) -> dict[str, Any]:
        """`event` of the open item's one content part."""
        return event | {
            "item_id": self.items[-1]["id"],
            "output_index": len(self.items) - 1,
            "content_index": 0,
        }

    @staticmethod
    def _logprobs(kind: str) -> dict[str, Any]:
        """Text events carry `logprobs` (none here: /v1/responses does not take top_logprobs)."""
        return {"logprobs": []} if kind == "message" else {}


def response_usage(prompt_tokens: int, completion_tokens: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt_tokens,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt_tokens + completion_tokens,
    }


class OutputTextPart(BaseModel):
    type: Literal["output_text"]
    text: str
    annotations: list[dict[str, Any]]


class ReasoningTextPart(BaseModel):
    type: Literal["reasoning_text"]
    text: str


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    status: ItemStatus
    content: list[OutputTextPart]


class OutputReasoning(BaseModel):
    id: str
    type: Literal["reasoning"]
    status: ItemStatus
    summary: list[dict[str, Any]] = Field(description="always empty: content holds the whole reasoning")
    content: list[ReasoningTextPart]


class OutputFunctionCall(BaseModel):
    id: str
    type: Literal["function_call"]
    status: ItemStatus
    call_id: str
    name: str
    arguments: str = Field(description="a JSON object's text")


OutputItem = Annotated[OutputMessage | OutputReasoning | OutputFunctionCall, Field(discriminator="type")]


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="not counted per request: 0")


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="not counted per request: 0 (output_tokens holds them)")


class ResponsesUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class IncompleteDetails(BaseModel):
    reason: Literal["max_output_tokens"]


class ResponseErrorInfo(BaseModel):
    code: str
    message: str


class ResponseObject(BaseModel):
    """A response: `status` completed, incomplete (max_output_tokens), cancelled (aborted by the
    server's shutdown) or failed (the engine failed it: only in a stream's `response.failed`)."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None
    status: Literal["in_progress", "completed", "incomplete", "cancelled", "failed"]
    error: ResponseErrorInfo | None
    incomplete_details: IncompleteDetails | None
    model: str
    output: list[OutputItem]
    usage: ResponsesUsage | None
    instructions: str | None
    previous_response_id: str | None
    store: bool
    background: Literal[False]
    max_output_tokens: int | None
    temperature: float
    top_p: float
    tools: list[dict[str, Any]]
    tool_choice: str | dict[str, Any]
    parallel_tool_calls: bool
    reasoning: dict[str, Any]
    text: dict[str, Any]
    truncation: Literal["disabled"]
    metadata: dict[str, str]


class ResponseDeleted(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: Literal[True]
