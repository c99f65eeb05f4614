"""The GLM chat format's reasoning and tool calls, parsed from generated text (`--reasoning-parser
glm45`, `--tool-call-parser glm45`, SGLang's names).

Reasoning is the text inside `<think>` ... `</think>` at the start of a reply (or, when the rendered
prompt already opened `<think>`, everything before `</think>`). A tool call is

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

where a VALUE is the argument's text when the tool's JSON schema declares it a string, else JSON
(kept as text when it does not parse). One `ReplyParser` serves streams and whole replies: it turns
text, piece by piece, into OpenAI delta fields, holding back any suffix that might begin a tag and a
tool call until it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

PARSERS = ("glm45",)
THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _string_arguments(tools: list[dict[str, Any]] | None, name: str) -> set[str]:
    """The arguments of tool `name` its schema declares strings."""
    for tool in tools or ():
        function = _function(tool)
        if function.get("name") == name:
            properties = (function.get("parameters") or {}).get("properties") or {}
            return {k for k, v in properties.items() if isinstance(v, dict) and v.get("type") == "string"}
    return set()


def parse_tool_call(body: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One call's `{"name", "arguments"}` (arguments as a JSON object string) from the text between
    its tags."""
    name = body.split("<arg_key>", 1)[0].strip()
    strings = _string_arguments(tools, name)
    arguments: dict[str, Any] = {}
    for key, raw in _ARGUMENT.findall(body):
        key, value = key.strip(), raw.strip()
        if key in strings:
            arguments[key] = value
            continue
        try:
            arguments[key] = json.loads(value)
        except ValueError:
            arguments[key] = value
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _function(tool: Any) -> dict[str, Any]:
    """A `tools` entry's function (OpenAI's `{"type": "function", "function": {...}}` or bare)."""
    function = tool.get("function", tool) if isinstance(tool, dict) else {}
    return function if isinstance(function, dict) else {}


def tool_names(tools: list[dict[str, Any]] | None) -> list[str]:
    """The function names of a request's `tools`, in order (entries without one are skipped)."""
    names = [_function(tool).get("name") for tool in tools or ()]
    return [name for name in names if isinstance(name, str) and name]


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A GBNF grammar of replies that are only tool calls in this format: one call of `name`, or (None)
    one or more calls of any of `tools`, each with argument keys from its JSON schema's properties
    (any key where it declares none) and values free of `<`. `tool_choice` `required` and named
    functions constrain the reply with it."""
    rules, calls = [], []
    for i, tool in enumerate(tools):
        function = _function(tool)
        tool_name = function.get("name")
        if not isinstance(tool_name, str) or not tool_name or name not in (None, tool_name):
            continue
        parameters = function.get("parameters")
        properties = parameters.get("properties") if isinstance(parameters, dict) else None
        keys = [k for k in properties if k] if isinstance(properties, dict) else []
        key = " | ".join(json.dumps(k) for k in keys) or "[^<\\n]+"
        rules += [
            f'call_{i} ::= "<tool_call>" {json.dumps(tool_name)} "\\n" arg_{i}* "</tool_call>"',
            f'arg_{i} ::= "<arg_key>" ({key}) "</arg_key>\\n<arg_value>" [^<]* "</arg_value>\\n"',
        ]
        calls.append(f"call_{i}")
    if not calls:
        raise ValueError(
            f"tool_choice: no tool named {name!r} in tools" if name else "tools: no function names"
        )
    if name is not None:
        return "\n".join([f"root ::= {calls[0]}", *rules])
    return "\n".join(['root ::= call ("\\n" call)*', f"call ::= {' | '.join(calls)}", *rules])


class ReplyParser:
    """Splits a reply's text into `content`, `reasoning_content` and `tool_calls` deltas.

    Invariant: the concatenation of every `content` and `reasoning_content` emitted, with each tool
    call's tags and body, and the reasoning tags, is the text fed so far, less what is held back (at
    most a tag's length, or an unclosed tool call); `finish` emits what is held as it stands.
    """

    def __init__(self, reasoning: bool, tools: bool, tool_specs: list[dict[str, Any]] | None = None,
                 thinking_open: bool = False):  # fmt: skip
        self.reasoning, self.tools, self.tool_specs = reasoning, tools, tool_specs
        self.mode = "reasoning" if reasoning and thinking_open else "start" if reasoning else "content"
        self.pending = ""
        self.num_calls = 0

    def feed(self, text: str) -> list[dict[str, Any]]:
        self.pending += text
        out: list[dict[str, Any]] = []
        while self.pending:
            before = (self.mode, len(self.pending))
            if self.mode == "start":
                stripped = self.pending.lstrip()
                if stripped.startswith(THINK_START):
                    self.pending, self.mode = stripped[len(THINK_START) :], "reasoning"
                elif stripped and not THINK_START.startswith(stripped):
                    self.mode = "content"
                else:
                    break  # only whitespace or a part of `<think>` so far
            elif self.mode == "reasoning":
                self._until(THINK_END, "reasoning_content", "content", out)
            elif self.mode == "content":
                if not self.tools:
                    out.append({"content": self.pending})
                    self.pending = ""
                else:
                    self._until(CALL_START, "content", "call", out)
            else:  # inside a tool call: nothing goes out before it closes
                end = self.pending.find(CALL_END)
                if end < 0:
                    break
                call = parse_tool_call(self.pending[:end], self.tool_specs)
                out.append({"tool_calls": [{"index": self.num_calls, "id": f"call_{uuid.uuid4().hex[:24]}",
                                            "type": "function", "function": call}]})  # fmt: skip
                self.num_calls += 1
                self.pending, self.mode = self.pending[end + len(CALL_END) :], "content"
            if (self.mode, len(self.pending)) == before:
                break  # waiting for more text
        return out

    def _until(self, tag: str, field: str, next_mode: str, out: list[dict[str, Any]]) -> None:
        """Emit `pending` as `field` up to `tag` (then switch to `next_mode`), holding back a suffix
        that may begin it."""
        at = self.pending.find(tag)
        if at >= 0:
            if at:
                out.append({field: self.pending[:at]})
            self.pending, self.mode = self.pending[at + len(tag) :], next_mode
            return
        keep = _held(self.pending, tag)
        if len(self.pending) > keep:
            out.append({field: self.pending[: len(self.pending) - keep]})
            self.pending = self.pending[len(self.pending) - keep :]

    def finish(self) -> list[dict[str, Any]]:
        """What is held back, as it stands (an unclosed tool call is content)."""
        text, self.pending = self.pending, ""
        if not text:
            return []
        if self.mode == "call":
            return [{"content": CALL_START + text}]
        return [{"reasoning_content" if self.mode == "reasoning" else "content": text}]

    @property
    def called(self) -> bool:
        return self.num_calls > 0


def merge_deltas(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """One stream chunk's delta from several: text fields joined, tool calls listed."""
    delta: dict[str, Any] = {}
    for d in deltas:
        for key, value in d.items():
            delta[key] = delta.get(key, [] if key == "tool_calls" else "") + value
    return delta


def whole_reply(parser: ReplyParser, text: str) -> dict[str, Any]:
    """A whole reply's message fields: `content` (None when empty and there are tool calls),
    `reasoning_content` where there was reasoning, `tool_calls` where there were calls."""
    content, reasoning, calls = "", None, []
    for d in [*parser.feed(text), *parser.finish()]:
        if "content" in d:
            content += d["content"]
        elif "reasoning_content" in d:
            reasoning = (reasoning or "") + d["reasoning_content"]
        else:
            calls += [{k: v for k, v in c.items() if k != "index"} for c in d["tool_calls"]]
    message: dict[str, Any] = {"content": content if content or not calls else None}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls:
        message["tool_calls"] = calls
    return message
