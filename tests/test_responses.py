"""`/v1/responses` driven by the official `openai` client against `hylo serve` with the 3-layer cut of
the random test model (conftest `shallow_model_dir`: the API does not depend on the model's text)
(`--tool-call-parser glm45 --reasoning-parser glm45`, a store of STORE_SIZE responses): create (text
input, message input with instructions, a json_schema format), stream (OpenAI's event order, the
text equal to its deltas), a forced function call answered by a `function_call_output` after
`previous_response_id`, the store's GET / DELETE / 404 and eviction, and the 400s of unsupported
features. Then, without a server: the output items and events of reasoning and calls, the store's
age limit, and the chat request a Responses request runs as."""

from __future__ import annotations

import json

import httpx
import openai
import pytest
from test_server import NAME, start_server, stop
from test_tool_calls import SCHEMAS, TIME, schema_errors

from hylo.server.responses_output import OutputItems
from hylo.server.responses_protocol import ResponsesRequest
from hylo.server.responses_store import ResponseStore, StoredResponse

STORE_SIZE = 4
TIME_TOOL = {"type": "function", **TIME["function"]}  # a short call: one enum argument
TURNS = [
    {"role": "user", "content": "Hello"},
    {"role": "assistant", "content": [{"type": "output_text", "text": "Hi! How can I help?"}]},
    {"role": "user", "content": [{"type": "input_text", "text": "Tell me a story."}]},
]


@pytest.fixture(scope="module")
def server(shallow_model_dir):
    flags = ("--tool-call-parser", "glm45", "--reasoning-parser", "glm45")
    proc, url = start_server(shallow_model_dir, *flags, "--responses-store-size", str(STORE_SIZE))
    yield url
    stop(proc)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


def _text(response) -> str:
    return "".join(p.text for item in response.output if item.type == "message" for p in item.content)


def test_create_from_text_is_stored_as_returned(client):
    reply = client.responses.create(model=NAME, input="Hello", max_output_tokens=6)
    assert reply.object == "response" and reply.model == NAME and reply.id.startswith("resp_")
    assert reply.status in ("completed", "incomplete") and reply.store is True
    if reply.status == "incomplete":
        assert reply.incomplete_details.reason == "max_output_tokens"
    usage = reply.usage
    assert usage.input_tokens > 0 and 0 < usage.output_tokens <= 6
    assert usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert reply.output_text == _text(reply) != ""
    assert client.responses.retrieve(reply.id).model_dump() == reply.model_dump()


def test_message_input_and_instructions_reach_the_prompt(client):
    bare = client.responses.create(model=NAME, input=TURNS, max_output_tokens=1)
    instructed = client.responses.create(
        model=NAME,
        input=[{"role": "developer", "content": "Be brief."}, *TURNS],
        instructions="You are a storyteller.",
        max_output_tokens=1,
        temperature=0,
        extra_body={"seed": 3, "top_k": 1},
    )
    assert instructed.instructions == "You are a storyteller." and instructed.temperature == 0
    # two system turns more (the instructions, the developer message), each a role tag and its text
    assert instructed.usage.input_tokens > bare.usage.input_tokens + 2


def test_a_json_schema_format_gives_json_of_the_schema(client):
    schema = {
        "type": "object",
        "properties": {"ok": {"type": "boolean"}},
        "required": ["ok"],
        "additionalProperties": False,
    }
    reply = client.responses.create(
        model=NAME,
        input="Answer in JSON.",
        max_output_tokens=40,
        text={"format": {"type": "json_schema", "name": "answer", "schema": schema}},
    )
    assert reply.status == "completed", reply
    assert isinstance(json.loads(reply.output_text)["ok"], bool)
    assert reply.text.format.type == "json_schema"


def test_stream_events_come_in_openais_order(client):
    with client.responses.stream(
        model=NAME, input=TURNS, instructions="Be brief.", max_output_tokens=8
    ) as stream:
        events = list(stream)
    kinds = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ], kinds
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert kinds[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert kinds[4 + len(deltas) :] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if events[-1].response.status == "completed" else "response.incomplete",
    ], kinds
    final = events[-1].response
    text = "".join(e.delta for e in deltas)
    assert text == _text(final) == events[-4].text and final.usage.output_tokens <= 8
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"


def test_a_forced_call_is_answered_after_previous_response_id(client):
    with client.responses.stream(
        model=NAME,
        input="What time is it in Paris?",
        tools=[TIME_TOOL],
        tool_choice={"type": "function", "name": "get_time"},
        max_output_tokens=96,  # the greedy reply, its call included, is 77 tokens
        temperature=0,
    ) as stream:
        kinds = [e.type for e in stream]
        called = stream.get_final_response()
    assert kinds[2:6] == [
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ], kinds
    (call,) = [item for item in called.output if item.type == "function_call"]
    assert call.name == "get_time" and call.call_id
    assert schema_errors(json.loads(call.arguments), SCHEMAS["get_time"]) == []
    answered = client.responses.create(
        model=NAME,
        previous_response_id=called.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "It is 10:42 CET"}],
        tools=[TIME_TOOL],
        max_output_tokens=2,
    )
    assert answered.previous_response_id == called.id
    # the question and the call came before the answer: the prompt holds all three
    assert answered.usage.input_tokens > called.usage.input_tokens + len("It is 10:42 CET") // 4


def test_store_get_delete_and_404s(client, server):
    kept = client.responses.create(model=NAME, input="Hi", max_output_tokens=1)
    unkept = client.responses.create(model=NAME, input="Hi", max_output_tokens=1, store=False)
    assert client.responses.retrieve(kept.id).id == kept.id
    head = httpx.head(f"{server}/v1/responses/{kept.id}")
    assert head.status_code == 200 and head.content == b""
    deleted = httpx.delete(f"{server}/v1/responses/{kept.id}")
    assert deleted.json() == {"id": kept.id, "object": "response.deleted", "deleted": True}
    for gone in (kept.id, unkept.id):
        with pytest.raises(openai.NotFoundError) as missing:
            client.responses.retrieve(gone)
        error = missing.value.body
        assert (
            error["type"] == "not_found_error"
            and error["param"] == "response_id"
            and gone in error["message"]
        )
    assert httpx.delete(f"{server}/v1/responses/{kept.id}").status_code == 404
    with pytest.raises(openai.NotFoundError) as unknown:
        client.responses.create(model=NAME, input="Hi", previous_response_id=unkept.id)
    assert unknown.value.body["param"] == "previous_response_id"


def test_the_oldest_is_evicted_beyond_the_store_size(client):
    ids = [
        client.responses.create(model=NAME, input="Hi", max_output_tokens=1).id for _ in range(STORE_SIZE + 1)
    ]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


@pytest.mark.parametrize(
    ("extra", "param", "named"),
    [
        ({"tools": [{"type": "web_search"}]}, "tools.0", "'web_search'"),
        ({"background": True}, "background", "background mode"),
        ({"include": ["reasoning.encrypted_content"]}, "include", "include"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            "input_image",
        ),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input", "item_reference"),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format", "schema"),
    ],
)
def test_unsupported_or_invalid_input_is_a_400_naming_it(server, extra, param, named):
    reply = httpx.post(f"{server}/v1/responses", json={"model": NAME, "input": "Hi"} | extra, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and named in error["message"], error


def test_the_schema_describes_the_routes(server):
    schema = httpx.get(f"{server}/openapi.json").json()
    paths = schema["paths"]
    assert {"post"} <= set(paths["/v1/responses"]) and {"get", "delete"} <= set(
        paths["/v1/responses/{response_id}"]
    )
    stored = paths["/v1/responses/{response_id}"]
    assert "404" in stored["get"]["responses"] and "404" in stored["delete"]["responses"]
    deleted = stored["delete"]["responses"]["200"]["content"]["application/json"]["schema"]
    assert deleted == {"$ref": "#/components/schemas/ResponseDeleted"}
    # one route serves the methods of a stored response: a 405 names them all
    assert set(httpx.put(f"{server}/v1/responses/x").headers["allow"].split(", ")) == {
        "GET",
        "HEAD",
        "DELETE",
    }
    assert "text/event-stream" in paths["/v1/responses"]["post"]["responses"]["200"]["content"]
    request = schema["components"]["schemas"]["ResponsesRequest"]
    assert request["properties"]["background"]["description"].startswith("background mode is not supported")


# ---- without a server


def _pieces_events(pieces, one_call=False, status="completed"):
    output = OutputItems(one_call)
    events = [e for piece in pieces for e in output.add(piece)] + output.close(status)
    return output.items, [e["type"] for e in events], events


def test_reasoning_text_and_calls_become_items_in_order():
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    pieces = [{"reasoning_content": "Let me"}, {"reasoning_content": " think."}, {"content": "Calling."},
              {"tool_calls": [call]}, {"content": "Done"}]  # fmt: skip
    items, kinds, events = _pieces_events(pieces, status="incomplete")
    assert [(i["type"], i["status"]) for i in items] == [
        ("reasoning", "completed"),
        ("message", "completed"),
        ("function_call", "completed"),
        ("message", "incomplete"),  # cut short by max_output_tokens
    ]
    assert (
        items[0]["content"] == [{"type": "reasoning_text", "text": "Let me think."}]
        and items[0]["summary"] == []
    )
    assert items[2] | {"id": None} == {"id": None, "type": "function_call", "status": "completed",
                                       "call_id": "call_1", "name": "f", "arguments": '{"a": 1}'}  # fmt: skip
    assert kinds[:8] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
    ]
    assert events[4]["text"] == "Let me think." and events[6]["item"]["status"] == "completed"
    added = [e for e in events if e["type"] == "response.output_item.added"]
    assert [e["item"]["status"] for e in added] == ["in_progress"] * 4 and added[2]["item"]["arguments"] == ""
    assert [e["output_index"] for e in added] == [0, 1, 2, 3]


def test_one_call_keeps_the_first_call_only():
    calls = [
        {"id": f"call_{i}", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        for i in range(3)
    ]
    items, _, _ = _pieces_events([{"tool_calls": calls[:2]}, {"tool_calls": calls[2:]}], one_call=True)
    assert [i["call_id"] for i in items] == ["call_0"]


def test_the_store_forgets_what_is_older_than_its_age():
    now = [0.0]
    store = ResponseStore(max_entries=10, max_age_s=60, clock=lambda: now[0])
    for name in ("a", "b"):
        store.put(name, StoredResponse({"id": name}, ()))
        now[0] += 40
    assert store.get("a") is None and store.get("b") is not None and len(store) == 1
    now[0] += 20
    assert store.get("b") is None and len(store) == 0
    with pytest.raises(ValueError, match="at least one entry"):
        ResponseStore(max_entries=0)


def test_a_request_runs_as_the_chat_request_of_the_same_meaning():
    body = ResponsesRequest.model_validate(
        {
            "input": [
                {"role": "developer", "content": "Be brief."},
                {"type": "reasoning", "summary": []},
                {"role": "assistant", "content": "Calling."},
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {"type": "function_call", "call_id": "c2", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_text", "text": "ok"}],
                },
            ],
            "instructions": "System.",
            "reasoning": {"effort": "none"},
            "text": {"format": {"type": "json_object"}},
            "max_output_tokens": 5,
            "tool_choice": {"type": "function", "name": "f"},
        }
    )
    chat = body.chat_request()
    calls = [
        {"id": c, "type": "function", "function": {"name": "f", "arguments": "{}"}} for c in ("c1", "c2")
    ]
    assert chat["messages"] == [
        {"role": "system", "content": "System."},
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Calling.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "c1", "content": "ok"},
    ]
    assert chat["reasoning_effort"] == "none" and chat["max_completion_tokens"] == 5
    assert chat["response_format"] == {"type": "json_object"}
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "f"}}
