"""The GLM reasoning and tool-call parsers: a whole reply, the same reply streamed in any pieces,
replies the prompt opened in reasoning, unclosed tags, and argument typing by the tool's schema; the
tool-call grammar built from each tool's schema, through xgrammar's matcher."""

from __future__ import annotations

import json

import pytest

from hylo.sampling import SamplingParams
from hylo.server.parsers import (
    CALL_END,
    CALL_START,
    ReplyParser,
    merge_deltas,
    parse_tool_call,
    tool_call_grammar,
    whole_reply,
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "search",
            "parameters": {"type": "object", "properties": {"query": {"type": "string"}, "n": {}}},
        },
    }
]
REPLY = (
    "<think>Need a search.</think>Searching.<tool_call>search\n<arg_key>query</arg_key>\n"
    "<arg_value>42</arg_value>\n<arg_key>n</arg_key>\n<arg_value>[1, 2]</arg_value>\n</tool_call>"
)


def calls(message: dict) -> list[tuple[str, dict]]:
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]


def test_whole_reply_splits_reasoning_content_and_typed_calls():
    message = whole_reply(ReplyParser(True, True, TOOLS), REPLY)
    assert message["reasoning_content"] == "Need a search." and message["content"] == "Searching."
    # "42" stays a string (the schema says so), "[1, 2]" is JSON
    assert calls(message) == [("search", {"query": "42", "n": [1, 2]})]


@pytest.mark.parametrize("piece", [1, 2, 3, 5, 11])
def test_streamed_pieces_give_the_whole_reply(piece):
    parser = ReplyParser(True, True, TOOLS)
    deltas = []
    for i in range(0, len(REPLY), piece):
        deltas += parser.feed(REPLY[i : i + piece])
    deltas += parser.finish()
    merged = merge_deltas(deltas)
    assert merged["reasoning_content"] == "Need a search." and merged["content"] == "Searching."
    assert [c["index"] for c in merged["tool_calls"]] == [0] and parser.called
    assert calls(merged) == [("search", {"query": "42", "n": [1, 2]})]


def test_prompt_opened_reasoning_unclosed_tags_and_parsers_off():
    parser = ReplyParser(True, True, TOOLS, thinking_open=True)
    opened = whole_reply(parser, "plan</think>ok <tool_call>search")
    assert opened == {"content": "ok <tool_call>search", "reasoning_content": "plan"}  # unclosed: text
    assert whole_reply(ReplyParser(True, False), "<think>unfinished") == {
        "content": "",
        "reasoning_content": "unfinished",
    }
    assert whole_reply(ReplyParser(False, False), REPLY) == {"content": REPLY}
    # no reasoning tag at the start: all content, and a `<` that begins no tag is not held forever
    assert whole_reply(ReplyParser(True, True, TOOLS), "a < b") == {"content": "a < b"}
    only_call = whole_reply(ReplyParser(False, True, TOOLS), "<tool_call>search</tool_call>")
    assert only_call["content"] is None and calls(only_call) == [("search", {})]


# a tool with every kind of value the grammar types: the keys come in this order, city and days always
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "hourly": {"type": "boolean"},
                "threshold": {"type": "number"},
                "place": {
                    "type": "object",
                    "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                    "required": ["lat", "lon"],
                },
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city", "days"],
        },
    },
}
GET_TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: no arguments


def call(*arguments: tuple[str, str], name: str = "get_weather", newlines: bool = True) -> str:
    """A call in the GLM-4.5 layout (a newline after the name and each part) or GLM-4.7's (none)."""
    nl = "\n" if newlines else ""
    parts = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in arguments)
    return f"<tool_call>{name}{nl}{parts}</tool_call>"


FULL = call(
    ("city", "New York <3"),
    ("days", "3"),
    ("unit", "celsius"),
    ("hourly", "false"),
    ("threshold", "-1.5e1"),
    ("place", '{"lat": 40.7, "lon": -74}'),
    ("tags", '["a","b"]'),
)
FULL_ARGUMENTS = {
    "city": "New York <3",
    "days": 3,
    "unit": "celsius",
    "hourly": False,
    "threshold": -15.0,
    "place": {"lat": 40.7, "lon": -74},
    "tags": ["a", "b"],
}


@pytest.fixture(scope="module")
def grammar_takes():
    """`takes(grammar, text)`: xgrammar's matcher, compiled for the demo tokenizer the way the engine
    compiles an `ebnf` constraint, accepts all of `text` and is then complete."""
    import xgrammar

    from hylo.models.demo import DEMO_DIR
    from hylo.structured import Grammars
    from hylo.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(DEMO_DIR)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)

    def takes(grammar: str, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(grammars.compile(SamplingParams(ebnf=grammar)))
        return matcher.accept_string(text) and matcher.is_completed()

    return takes


def arguments_of(reply: str) -> dict:
    """The parsed arguments of a reply that is one call of `WEATHER`."""
    body = reply.removeprefix(CALL_START).removesuffix(CALL_END)
    return json.loads(parse_tool_call(body, [WEATHER])["arguments"])


def test_the_tool_call_grammar_takes_typed_closed_calls(grammar_takes):
    """Whole calls typed by the tool's schema pass, in either GLM layout, and parse to the
    arguments written; `required` takes one or more calls back to back."""
    named = tool_call_grammar([WEATHER, GET_TIME], "get_weather")
    required = tool_call_grammar([WEATHER, GET_TIME])
    only_required = call(("city", "Paris"), ("days", "14"), newlines=False)
    for grammar in (named, required):
        assert grammar_takes(grammar, FULL) and grammar_takes(grammar, only_required)
    time_call = call(name="get_time")
    assert grammar_takes(required, FULL + time_call) and grammar_takes(required, time_call)
    assert arguments_of(FULL) == FULL_ARGUMENTS
    assert arguments_of(only_required) == {"city": "Paris", "days": 14}


@pytest.mark.parametrize(
    ("reply", "why"),
    [
        (call(("city", "Paris"), ("city", "Rome"), ("days", "3")), "a repeated key"),
        (call(("city", "Paris"), ("days", "3"), ("days", "4")), "a repeated key"),
        (call(("city", "Paris")), "the required key days missing"),
        (call(("days", "3")), "the required key city missing"),
        (call(("city", "Paris"), ("days", "three")), "text where the schema says integer"),
        (call(("city", "Paris"), ("days", "2.5")), "a number where the schema says integer"),
        (call(("city", "Paris"), ("days", "15")), "an integer above the schema's maximum"),
        (call(("city", "Paris"), ("days", "3"), ("unit", "kelvin")), "a value outside the enum"),
        (call(("city", "Paris"), ("days", "3"), ("hourly", "yes")), "text where boolean"),
        (call(("city", "Paris"), ("days", "3"), ("threshold", "warm")), "text where number"),
        (call(("city", "Paris"), ("days", "3"), ("place", '{"lat": 1}')), "a nested required key missing"),
        (call(("city", "Paris"), ("days", "3"), ("tags", '["a", 2]')), "an array item of the wrong type"),
        (call(("city", "Paris"), ("days", "3"), ("country", "FR")), "a key the schema does not declare"),
        (call(("days", "3"), ("city", "Paris")), "keys out of the schema's order"),
        (call(("city", "Paris"), ("days", "3")).removesuffix(CALL_END), "an unclosed call"),
        (call(("city", "Paris"), ("days", "3"), name="get_wether"), "an unknown function"),
        (call(("zone", "CET"), name="get_time"), "an argument of a function without parameters"),
        ("Sure. " + call(("city", "Paris"), ("days", "3")), "text before the call"),
        ("", "no call"),
    ],
)
def test_the_tool_call_grammar_refuses(grammar_takes, reply, why):
    assert not grammar_takes(tool_call_grammar([WEATHER, GET_TIME]), reply), why


def test_a_named_tool_choice_is_exactly_one_call_of_that_function(grammar_takes):
    named = tool_call_grammar([WEATHER, GET_TIME], "get_time")
    assert grammar_takes(named, call(name="get_time"))
    assert not grammar_takes(named, call(("city", "Paris"), ("days", "3")))
    assert not grammar_takes(named, call(name="get_time") * 2)


def test_tool_call_grammar_errors_name_the_field():
    with pytest.raises(ValueError, match=r"^tool_choice: no tool named 'nope'"):
        tool_call_grammar([WEATHER], "nope")
    with pytest.raises(ValueError, match=r"^tools: no function names"):
        tool_call_grammar([{"type": "function", "function": {}}])
    bad = {"type": "function", "function": {"name": "bad", "parameters": {"type": "frobnicate"}}}
    with pytest.raises(ValueError, match=r"^tools: function 'bad' parameters: .*frobnicate"):
        tool_call_grammar([WEATHER, bad])


@pytest.mark.parametrize(
    ("schema", "raw", "value"),
    [
        ({"type": "string"}, "42", "42"),
        ({"enum": ["1", "2"]}, "1", "1"),  # an enum of strings is written raw, like a string
        ({"const": "true"}, "true", "true"),
        ({"enum": [1, 2]}, "1", 1),
        ({"type": ["string", "null"]}, "12", "12"),  # raw text the schema types as a string
        ({"type": ["string", "null"]}, "null", None),
        ({"anyOf": [{"type": "string"}, {"type": "number"}]}, "12", 12),
        ({"type": "integer"}, "oops", "oops"),  # not JSON: the text as written
        ({}, "[1, 2]", [1, 2]),
    ],
)
def test_argument_values_are_typed_as_the_grammar_writes_them(schema, raw, value):
    tools = [{"name": "f", "parameters": {"type": "object", "properties": {"x": schema}}}]
    parsed = parse_tool_call(f"f<arg_key>x</arg_key><arg_value>{raw}</arg_value>", tools)
    assert json.loads(parsed["arguments"]) == {"x": value}
