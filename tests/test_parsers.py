"""The GLM reasoning and tool-call parsers: a whole reply, the same reply streamed in any pieces,
replies the prompt opened in reasoning, unclosed tags, and argument typing by the tool's schema."""

from __future__ import annotations

import json

import pytest

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
