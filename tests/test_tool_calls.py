"""Forced tool calls end to end: the shipped demo model served with `--tool-call-parser glm45`, asked
with `tool_choice` `required` and a named function, replies with tool calls whose arguments match the
tool's JSON schema, sampled at temperature 1, within 200 tokens each."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import pytest
from test_server import NAME, start_server, stop

from hylo.models.demo import DEMO_DIR

# Every value bounded (a string's length, an integer's range, an enum), so every call the grammar
# takes fits in 200 tokens: the longest get_weather call is 149 characters (a whitespace at every
# place the layout allows one), and a token holds at least one byte (186 bytes at most). The demo
# model, trained on chat text, spells the tags a character or two per token and would write a free
# string on and on (the grammar takes any string the schema does); what else a call may hold is
# tested against the grammar alone (tests/test_parsers.py).
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather forecast of a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 12},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
            },
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC", "CET", "PST"]}},
            "required": ["zone"],
        },
    },
}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
JSON_TYPES = {"string": str, "integer": int, "boolean": bool, "object": dict}


def schema_errors(value: Any, schema: dict[str, Any]) -> list[str]:
    """What in `value` breaks `schema` (the keywords the tools above use), [] when it validates."""
    if "enum" in schema and value not in schema["enum"]:
        return [f"{value!r} not in {schema['enum']}"]
    kind = JSON_TYPES.get(schema.get("type"), object)
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        return [f"{value!r} is not {schema['type']}"]
    errors = []
    if kind is str and len(value) > schema.get("maxLength", len(value)):
        errors.append(f"{value!r} longer than {schema['maxLength']}")
    if kind is int and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        errors.append(f"{value} outside [{schema['minimum']}, {schema['maximum']}]")
    if kind is dict:
        errors += [f"missing {key}" for key in schema.get("required", ()) if key not in value]
        for key, item in value.items():
            if key not in schema["properties"]:
                errors.append(f"undeclared {key}")
            else:
                errors += schema_errors(item, schema["properties"][key])
    return errors


@pytest.fixture(scope="module")
def demo_server():
    proc, url = start_server(DEMO_DIR, "--tool-call-parser", "glm45")
    yield url
    stop(proc)


def ask(url: str, tool_choice: Any, seed: int, n: int) -> dict:
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}],
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "temperature": 1.0,
        "seed": seed,
        "n": n,
        "max_tokens": 200,
    }
    reply = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=300)
    assert reply.status_code == 200, reply.text
    return reply.json()


def test_forced_tool_calls_of_the_demo_model_match_their_schemas(demo_server):
    """Ten sampled replies (five of `required`, five naming get_weather; each sequence its own seed)
    each hold a tool call of a tool in `tools` whose arguments validate against its schema, within
    200 tokens: a named choice is exactly one call, ended by the grammar (`tool_calls`); `required`
    ends so too, or at the token limit only after a whole call (one or more calls may follow)."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    with ThreadPoolExecutor(2) as pool:  # both in one batch of the engine
        replies = list(pool.map(lambda c, seed: ask(demo_server, c, seed, 5), ["required", named], [7, 17]))
    for reply, tool_choice in zip(replies, ["required", named], strict=True):
        assert len(reply["choices"]) == 5 and reply["usage"]["completion_tokens"] <= 5 * 200
        for choice in reply["choices"]:
            calls = [(c["function"]["name"], json.loads(c["function"]["arguments"]))
                     for c in choice["message"].get("tool_calls") or ()]  # fmt: skip
            assert calls and all(schema_errors(args, SCHEMAS[name]) == [] for name, args in calls), choice
            if tool_choice is named:
                assert [name for name, _ in calls] == ["get_weather"], choice
                assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] is None
            else:
                assert choice["finish_reason"] in ("tool_calls", "length"), choice


def test_a_tool_schema_without_a_grammar_is_a_400_naming_tools(demo_server):
    """A valid object schema xgrammar cannot convert (a `$ref` to nothing): a 400 naming `tools` and
    the function, not a 500 or a constraint the client never sent."""
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}}
    bad = {"type": "function", "function": {"name": "bad", "parameters": parameters}}
    body = {
        "model": NAME,
        "messages": [{"role": "user", "content": "Hi"}],
        "tools": [WEATHER, bad],
        "tool_choice": "required",
    }
    reply = httpx.post(f"{demo_server}/v1/chat/completions", json=body, timeout=60)
    error = reply.json()["error"]
    assert reply.status_code == 400 and error["param"] == "tools" and "'bad'" in error["message"], error
