"""The GLM reasoning and tool-call parsers: a whole reply, the same reply streamed in any pieces,
replies the prompt opened in reasoning, unclosed tags, and argument typing by the tool's schema."""

from __future__ import annotations

import json

import pytest

from hylo.sampling import SamplingParams
from hylo.server.parsers import ReplyParser, merge_deltas, whole_reply

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


def test_the_tool_call_grammar_takes_calls_only(tmp_path):
    """`tool_call_grammar` (what tool_choice required / named constrain a reply with), compiled for the
    demo tokenizer: whole calls in the parser's format pass, text around them or another function
    does not."""
    import xgrammar

    from hylo.models.demo import write_random_model
    from hylo.server.parsers import parse_tool_call, tool_call_grammar
    from hylo.structured import Grammars
    from hylo.tokenizer import Tokenizer

    write_random_model(tmp_path)
    tokenizer = Tokenizer.from_dir(tmp_path)
    grammars = Grammars(tokenizer, tokenizer.vocab_size, tokenizer.eos_token_ids)
    weather = {
        "type": "function",
        "function": {"name": "get_weather", "parameters": {"properties": {"city": {}}}},
    }
    tools = [weather, {"type": "function", "function": {"name": "get_time"}}]
    call = "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"
    other = "<tool_call>get_time\n<arg_key>zone</arg_key>\n<arg_value>CET</arg_value>\n</tool_call>"
    assert parse_tool_call(call[len("<tool_call>") : -len("</tool_call>")], tools)["name"] == "get_weather"

    def takes(grammar: str, text: str) -> bool:
        matcher = xgrammar.GrammarMatcher(grammars.compile(SamplingParams(ebnf=grammar)))
        return matcher.accept_string(text) and matcher.is_completed()

    required, named = tool_call_grammar(tools), tool_call_grammar(tools, "get_weather")
    assert takes(required, call) and takes(required, f"{call}\n{other}") and takes(named, call)
    assert not takes(named, other) and not takes(required, "Sure. " + call)
    assert not takes(required, call.replace("city", "country"))  # keys from the tool's schema
