"""The GLM chat format's reasoning and tool calls, parsed from generated text (`--reasoning-parser`
and `--tool-call-parser` `glm45`, SGLang's name, or `glm47`, the GLM-5.3-Flash vLLM recipe's).

Reasoning is the text inside `<think>` ... `</think>` at the start of a reply (or, when the rendered
prompt already opened `<think>`, everything before `</think>`). A tool call is

    <tool_call>NAME
    <arg_key>KEY</arg_key>
    <arg_value>VALUE</arg_value>
    ...
    </tool_call>

(GLM-4.7 writes it without the newlines) where a VALUE is the argument's text when the tool's JSON
schema declares it a string (or an enum or const of strings), else JSON (kept as text when it does
not parse); whitespace around a key or value is dropped. `tool_call_grammar` builds a grammar of
exactly these calls from each tool's schema. One `ReplyParser` serves streams and whole replies: it
turns text, piece by piece, into OpenAI delta fields, holding back any suffix that might begin a tag
and a tool call until it closes.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

# glm45: SGLang's name; glm47: vLLM's (GLM-4.7 and later write a call without newlines: the name
# directly followed by `<arg_key>`, whitespace between a key and its value). One parser reads both.
PARSERS = ("glm45", "glm47")
THINK_START, THINK_END = "<think>", "</think>"
CALL_START, CALL_END = "<tool_call>", "</tool_call>"
_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def _held(text: str, tag: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `tag`."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _is_text(schema: Any) -> bool:
    """Whether a value of `schema` is written as raw text in a call (a string type, or an enum or
    const of strings only): the rule of xgrammar's `glm_xml` style, which `tool_call_grammar` uses."""
    if not isinstance(schema, dict):
        return False
    if "const" in schema:
        return isinstance(schema["const"], str)
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return all(isinstance(v, str) for v in schema["enum"])
    return schema.get("type") == "string"


def _argument(raw: str, schema: Any) -> Any:
    """An argument's value from its text: the text where `schema` writes it raw (`_is_text`), else
    its JSON; the text where it is not JSON, or where the schema admits strings but not the JSON's
    type (`12` of `["string", "null"]` is the text "12": xgrammar writes such a string raw)."""
    if _is_text(schema):
        return raw
    try:
        value = json.loads(raw)
    except ValueError:
        return raw
    types = _types(schema)
    return raw if "string" in types and not _json_types(value) & types else value


def _types(schema: Any) -> set[str]:
    """The JSON types a schema names: its `type` (a name or a list) and its `anyOf` / `oneOf`
    branches' (none where it names none)."""
    if not isinstance(schema, dict):
        return set()
    named = schema.get("type")
    names = [named] if isinstance(named, str) else named if isinstance(named, list) else []
    types = {t for t in names if isinstance(t, str)}
    for branch in [*(schema.get("anyOf") or ()), *(schema.get("oneOf") or ())]:
        types |= _types(branch)
    return types


def _json_types(value: Any) -> set[str]:
    """The JSON schema types a parsed JSON value has (an integer is also a number)."""
    if value is None:
        return {"null"}
    if isinstance(value, bool):
        return {"boolean"}
    if isinstance(value, int):
        return {"integer", "number"}
    return {{float: "number", str: "string", list: "array", dict: "object"}[type(value)]}


def _properties(tools: list[dict[str, Any]] | None, name: str) -> dict[str, Any]:
    """The argument schemas (`parameters.properties`) of the tool called `name`, {} where none."""
    for tool in tools or ():
        function = _function(tool)
        if function.get("name") == name:
            parameters = function.get("parameters")
            properties = parameters.get("properties") if isinstance(parameters, dict) else None
            return properties if isinstance(properties, dict) else {}
    return {}


def parse_tool_call(body: str, tools: list[dict[str, Any]] | None) -> dict[str, Any]:
    """One call's `{"name", "arguments"}` (arguments as a JSON object string) from the text between
    its tags; values typed by the tool's schema (`_argument`), surrounding whitespace dropped."""
    name = body.split("<arg_key>", 1)[0].strip()
    properties = _properties(tools, name)
    arguments = {
        key.strip(): _argument(raw.strip(), properties.get(key.strip()))
        for key, raw in _ARGUMENT.findall(body)
    }
    return {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}


def _function(tool: Any) -> dict[str, Any]:
    """A `tools` entry's function (OpenAI's `{"type": "function", "function": {...}}` or bare)."""
    function = tool.get("function", tool) if isinstance(tool, dict) else {}
    return function if isinstance(function, dict) else {}


# A function without `parameters` (or with null) takes no arguments, as OpenAI reads it.
NO_ARGUMENTS: dict[str, Any] = {"type": "object", "properties": {}}


def _call_format(name: str, parameters: Any) -> dict[str, Any]:
    """The xgrammar structural-tag format of one call of `name`: `<tool_call>NAME`, its arguments in
    the `glm_xml` style of the `parameters` schema, `</tool_call>`. That style writes declared keys
    in the schema's order, each at most once, the required ones always (a schema without
    `properties` takes any keys), a string (`_is_text`) raw and any other value as JSON of its
    schema; at most one whitespace character between parts (a model cannot pad a call forever)."""
    content = {"type": "json_schema", "json_schema": parameters, "style": "glm_xml", "max_whitespace_cnt": 1}
    return {"type": "tag", "begin": CALL_START + name, "content": content, "end": CALL_END}


def _grammar_text(format_: dict[str, Any], field: str) -> str:
    """The GBNF text of a structural-tag format, or a ValueError starting with `field`."""
    import xgrammar

    from hylo.structured import xgrammar_message

    try:
        return str(xgrammar.Grammar.from_structural_tag({"type": "structural_tag", "format": format_}))
    except (RuntimeError, ValueError) as exc:  # xgrammar's errors, or its pydantic check of the format
        raise ValueError(f"{field}: {xgrammar_message(exc)}") from None


def tool_call_grammar(tools: list[dict[str, Any]], name: str | None = None) -> str:
    """A GBNF grammar of replies that are only tool calls in this format, each built from its tool's
    JSON schema (`_call_format`): exactly one call of `name`, or (None, `tool_choice` `required`) one
    or more calls of any of `tools`, back to back. A schema xgrammar cannot convert is a ValueError
    starting with "tools" that names the function."""
    formats = []
    for tool in tools:
        function = _function(tool)
        tool_name = function.get("name")
        if not isinstance(tool_name, str) or not tool_name or name not in (None, tool_name):
            continue
        parameters = function.get("parameters")
        format_ = _call_format(tool_name, NO_ARGUMENTS if parameters is None else parameters)
        grammar = _grammar_text(format_, f"tools: function {tool_name!r} parameters")  # names the tool
        if name is not None:
            return grammar
        formats.append(format_)
    if not formats:
        raise ValueError(
            f"tool_choice: no tool named {name!r} in tools" if name else "tools: no function names"
        )
    calls = {"type": "tags_with_separator", "tags": formats, "separator": "", "at_least_one": True}
    return _grammar_text(calls, "tools")


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
