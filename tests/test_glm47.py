"""GLM parsers by their recipe names (issue 43, item 4): `glm47` (vLLM's name) beside `glm45`
(SGLang's), GLM-4.7's call format (the name directly followed by `<arg_key>`, whitespace between a
key and its value), and the thinking switches (`reasoning_effort`, `chat_template_kwargs`
`enable_thinking` / `thinking`) reaching the chat template."""

from __future__ import annotations

import json

import pytest
from test_server_robustness import WEATHER

from hylo.cli import _build_parser
from hylo.server.parsers import PARSERS, ReplyParser, merge_deltas, whole_reply
from hylo.server.protocol import ChatCompletionRequest

TOOLS = [WEATHER]


def test_both_recipe_names_are_accepted_by_the_cli():
    assert {"glm45", "glm47"} <= set(PARSERS)
    args = _build_parser().parse_args(["serve", "--tool-call-parser", "glm47", "--reasoning-parser", "glm47"])
    assert args.tool_call_parser == args.reasoning_parser == "glm47"


@pytest.mark.parametrize(
    "call",
    [
        # GLM-4.7: no newline after the name, whitespace (here a newline and spaces) between key and value
        "<tool_call>get_weather<arg_key>city</arg_key>\n  <arg_value>Paris</arg_value>"
        "<arg_key>days</arg_key> <arg_value>3</arg_value></tool_call>",
        # GLM-4.5's layout, one line each
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n"
        "<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>",
    ],
)
def test_glm47_calls_parse_as_glm45_calls_do(call):
    reply = f"<think>Weather, then.</think>{call}"
    message = whole_reply(ReplyParser(True, True, TOOLS), reply)
    assert message["reasoning_content"] == "Weather, then." and message["content"] is None
    (tool_call,) = message["tool_calls"]
    assert tool_call["function"]["name"] == "get_weather"
    assert json.loads(tool_call["function"]["arguments"]) == {"city": "Paris", "days": 3}
    parser = ReplyParser(True, True, TOOLS)  # streamed in 3-character pieces: the same call
    deltas = [d for i in range(0, len(reply), 3) for d in parser.feed(reply[i : i + 3])] + parser.finish()
    merged = merge_deltas(deltas)
    assert merged["reasoning_content"] == "Weather, then." and not merged.get("content")
    (whole,) = merged["tool_calls"]
    assert json.loads(whole["function"]["arguments"]) == {"city": "Paris", "days": 3}


def _kwargs(**body) -> dict:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body).chat_template_kwargs


def test_thinking_switches_reach_the_template_as_both_names():
    off = {"enable_thinking": False, "thinking": False}
    assert _kwargs(chat_template_kwargs={"enable_thinking": False}) == off
    assert _kwargs(chat_template_kwargs={"thinking": False}) == off
    assert _kwargs(reasoning_effort="none") == off | {"reasoning_effort": "none"}
    # a switch the request sets wins over reasoning_effort; enable_thinking over thinking
    assert (
        _kwargs(reasoning_effort="none", chat_template_kwargs={"thinking": True})["enable_thinking"] is True
    )
    both = _kwargs(chat_template_kwargs={"enable_thinking": True, "thinking": False})
    assert both["enable_thinking"] is both["thinking"] is True
    assert _kwargs(reasoning_effort="high") == {"reasoning_effort": "high"}
    assert _kwargs() == {}
    with pytest.raises(ValueError, match="reasoning_effort"):
        _kwargs(reasoning_effort="extreme")


def test_reasoning_effort_none_turns_thinking_off_in_the_rendered_prompt(tmp_path):
    """A GLM-style template (`<think></think>` after the assistant tag when thinking is off) rendered
    through /v1/chat/completions/render: reasoning_effort none and either switch close the reasoning."""
    from fastapi.testclient import TestClient

    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.models.demo import write_random_model
    from hylo.server.api import build_app
    from hylo.server.async_engine import AsyncEngine

    write_random_model(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
        "{% if enable_thinking is defined and not enable_thinking %}<think></think>"
        "{% else %}<think>{% endif %}"
    )
    config_path.write_text(json.dumps(config))
    engine = AsyncEngine(
        Engine(EngineConfig(model=str(tmp_path), device="cpu", page_size=16, max_memory_gb=0.25))
    )
    engine.start()
    try:
        client = TestClient(build_app(engine, "demo", reasoning_parser="glm47"))

        def rendered(**body) -> str:
            got = client.post(
                "/v1/chat/completions/render", json={"messages": [{"role": "user", "content": "hi"}], **body}
            )
            assert got.status_code == 200, got.text
            text = client.post("/detokenize", json={"tokens": got.json()["token_ids"]}).json()["prompt"]
            return text

        assert rendered().endswith("<think>")
        assert rendered(reasoning_effort="high").endswith("<think>")
        for body in (
            {"reasoning_effort": "none"},
            {"chat_template_kwargs": {"enable_thinking": False}},
            {"chat_template_kwargs": {"thinking": False}},
        ):
            assert rendered(**body).endswith("<think></think>"), body
    finally:
        engine.shutdown()
