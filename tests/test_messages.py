"""`/v1/messages` driven by the official `anthropic` client against `hylo serve`
(`--tool-call-parser glm45 --reasoning-parser glm45`): create and stream (system, multi-turn), stop
sequences, a forced tool call whose input validates against its `input_schema`, a `tool_result`
turn, and errors in Anthropic's shape. The server is keyed: the client sends its key in `x-api-key`.

The server runs conftest's `shallow_model_dir` (the random test model cut to 3 layers): how a Messages
request maps onto the chat route and its reply onto blocks and events does not depend on the model's
text, and its decode steps cost ~40% of the demo model's. That the demo model's forced calls parse and
validate is test_tool_calls' (issue 47's acceptance)."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import pytest
from test_server import NAME, start_server, stop
from test_tool_calls import SCHEMAS, WEATHER, schema_errors

KEY = "messages-key"
WEATHER_TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],
    "input_schema": WEATHER["function"]["parameters"],
}
TURNS = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": [{"type": "text", "text": "Hi! How can I help?"}]},
    {"role": "user", "content": [{"type": "text", "text": "Tell me a story."}]},
]


@pytest.fixture(scope="module")
def client(shallow_model_dir):
    flags = ("--tool-call-parser", "glm45", "--reasoning-parser", "glm45", "--api-key", KEY)
    proc, url = start_server(shallow_model_dir, *flags)
    yield anthropic.Anthropic(base_url=url, api_key=KEY, max_retries=0, timeout=120)
    stop(proc)


def test_create_with_system_and_turns(client):
    reply = client.messages.create(
        model=NAME, max_tokens=8, system=[{"type": "text", "text": "Be brief."}], messages=TURNS
    )
    assert reply.type == "message" and reply.role == "assistant" and reply.model == NAME
    assert reply.stop_reason in ("end_turn", "max_tokens") and reply.stop_sequence is None
    assert 0 < reply.usage.output_tokens <= 8 and reply.usage.input_tokens > 10
    assert all(block.type in ("text", "thinking") for block in reply.content)


def test_stream_events_come_in_anthropics_order(client):
    with client.messages.stream(model=NAME, max_tokens=12, system="Be brief.", messages=TURNS) as stream:
        events = list(stream)
        final = stream.get_final_message()
    kinds = [event.type for event in events]
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"], kinds
    opened = kinds.count("content_block_start")
    assert opened == kinds.count("content_block_stop") == len(final.content)
    assert final.stop_reason in ("end_turn", "max_tokens") and 0 < final.usage.output_tokens <= 12
    deltas = [
        e.delta.text for e in events if e.type == "content_block_delta" and e.delta.type == "text_delta"
    ]
    assert "".join(deltas) == "".join(b.text for b in final.content if b.type == "text")


def test_a_stop_sequence_ends_the_reply_and_is_named(client):
    # the byte-level tokenizer's 128 merges are pieces of English words, which fill the random model's
    # replies (drawn from the server's seeded sampler: the same each run): one of these comes soon
    stops = ["e", "a", "o", " ", "t"]
    reply = client.messages.create(model=NAME, max_tokens=40, messages=TURNS, stop_sequences=stops)
    assert reply.stop_reason == "stop_sequence" and reply.stop_sequence in stops, reply
    text = "".join(b.text for b in reply.content if b.type == "text")
    assert not any(s in text for s in stops), text  # cut at the first, which is not returned


def _forced_call(client) -> anthropic.types.Message:
    return client.messages.create(
        model=NAME,
        max_tokens=200,
        messages=[{"role": "user", "content": "What will the weather be in Paris for the next 3 days?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    )


def _streamed_forced_call(client) -> tuple[list[str], anthropic.types.Message]:
    """The kinds of a streamed forced call's content deltas, and its final message."""
    with client.messages.stream(
        model=NAME,
        max_tokens=200,
        messages=[{"role": "user", "content": "Weather in Rome tomorrow?"}],
        tools=[WEATHER_TOOL],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        return deltas, stream.get_final_message()


@pytest.fixture(scope="module")
def forced_calls(client):
    """A forced call whole and one streamed, sent together: the engine decodes both in one batch (each
    call is ~130 tokens, and a step of two sequences costs about as much as a step of one)."""
    with ThreadPoolExecutor(2) as pool:
        whole, streamed = pool.submit(_forced_call, client), pool.submit(_streamed_forced_call, client)
        return whole.result(), streamed.result()


def test_a_forced_tool_call_matches_its_input_schema(forced_calls):
    reply, _ = forced_calls
    calls = [b for b in reply.content if b.type == "tool_use"]
    assert reply.stop_reason == "tool_use" and len(calls) == 1, reply
    assert calls[0].name == "get_weather" and schema_errors(calls[0].input, SCHEMAS["get_weather"]) == []


def test_a_streamed_tool_call_arrives_as_input_json(forced_calls):
    _, (deltas, final) = forced_calls
    assert "input_json_delta" in deltas and final.stop_reason == "tool_use"
    (call,) = [b for b in final.content if b.type == "tool_use"]
    assert schema_errors(call.input, SCHEMAS["get_weather"]) == []


def test_a_tool_result_turn_is_answered(client):
    reply = client.messages.create(
        model=NAME,
        max_tokens=4,
        tools=[WEATHER_TOOL],
        messages=[
            {"role": "user", "content": "Weather in Paris for 2 days?"},
            {
                "role": "assistant",
                "content": [
                    {
                        "type": "tool_use",
                        "id": "toolu_1",
                        "name": "get_weather",
                        "input": {"city": "Paris", "days": 2},
                    }
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "Sunny"}],
            },
        ],
    )
    assert reply.stop_reason in ("end_turn", "max_tokens", "tool_use") and reply.usage.output_tokens <= 4


def test_errors_are_in_anthropics_shape(client):
    url = str(client.base_url).rstrip("/")
    body = {"model": NAME, "messages": [{"role": "user", "content": "Hi"}]}
    reply = httpx.post(f"{url}/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()
    assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error", error
    assert error["error"]["message"].startswith("max_tokens"), error
    with pytest.raises(anthropic.AuthenticationError) as unkeyed:
        client.with_options(api_key="wrong").messages.create(model=NAME, max_tokens=4, messages=TURNS)
    assert unkeyed.value.body["error"]["type"] == "authentication_error"
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="other", max_tokens=4, messages=TURNS)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as unknown_tool:
        client.messages.create(
            model=NAME,
            max_tokens=4,
            messages=TURNS,
            tools=[WEATHER_TOOL],
            tool_choice={"type": "tool", "name": "nope"},
        )
    assert "nope" in unknown_tool.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError) as misplaced:
        client.messages.create(
            model=NAME,
            max_tokens=4,
            messages=[
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ],
        )
    assert "user turns cannot hold tool_use blocks" in misplaced.value.body["error"]["message"]
