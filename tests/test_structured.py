"""Structured outputs: JSON schema, regex and EBNF constraints (xgrammar) on the demo model, offline, with
speculative decoding on, and through the OpenAI server."""

from __future__ import annotations

import json
import re

import httpx
import pytest
import torch
from dflash_reference import write_dflash_checkpoint
from test_server import KEY, server  # noqa: F401 (a fixture)
from test_spec import Oracle

from hylo import LLM, SamplingParams
from hylo.structured import allowed_tokens, bitmask_words

# every string and number bounded: any path through the grammar ends within a few dozen tokens
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        # (xgrammar 0.2.9 lets a maxLength string hold raw control characters; a pattern does not)
        "tag": {"type": "string", "pattern": "^[a-z]{1,6}$"},
    },
    "required": ["answer", "count", "tag"],
    "additionalProperties": False,
}
REGEX = r"[0-9]{3}-(ab|cd)"
EBNF = 'root ::= "x" ("y" | "z")+ "!"'


@pytest.fixture(scope="module")
def model_dir(shallow_model_dir):
    """This module's engines and server (conftest `offline`, test_server's `server`) run the 3-layer cut
    of the random test model (conftest `shallow_model_dir`: the same tokenizer, every layer kind): what a
    grammar allows does not depend on the depth, and each step costs ~40% of the 8-layer model's."""
    return shallow_model_dir


def assert_matches_schema(text: str) -> None:
    """`text` is compact JSON (no whitespace outside strings, as the README says) matching SCHEMA."""
    value = json.loads(text)
    assert text == json.dumps(value, separators=(",", ":"), ensure_ascii=False), text
    assert set(value) == {"answer", "count", "tag"}, value
    assert value["answer"] in ("yes", "no", "maybe") and 0 <= value["count"] <= 99, value
    assert re.fullmatch("[a-z]{1,6}", value["tag"]), value


def test_allowed_tokens_unpacks_the_bitmask():
    vocab = 70
    allowed = torch.rand(3, vocab) < 0.5
    words = torch.zeros(3, bitmask_words(vocab), dtype=torch.int64)
    for t in range(vocab):
        words[:, t // 32] |= allowed[:, t].long() << (t % 32)
    bitmasks = torch.where(words >= 2**31, words - 2**32, words).int()  # two's complement int32 words
    assert torch.equal(allowed_tokens(bitmasks, vocab), allowed)


def test_constrained_outputs_match_their_constraint_and_others_are_unchanged(offline):
    """A batch of JSON-schema (sampled, n = 3), regex (greedy) and EBNF rows beside an unconstrained
    greedy row: every constrained output matches and ends with `stop`; the unconstrained row decodes
    exactly what it decodes alone."""
    free = SamplingParams(temperature=0, max_tokens=12)
    alone = offline.generate(["the weather"], free, use_tqdm=False)[0].token_ids
    params = [
        SamplingParams(temperature=0.9, seed=4, n=3, max_tokens=120, json_schema=json.dumps(SCHEMA)),
        SamplingParams(temperature=0, max_tokens=20, regex=REGEX),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, ebnf=EBNF),
        free,
    ]
    outs = offline.generate(["hello there", "a number", "x", "the weather"], params, use_tqdm=False)
    for choice in outs[0].outputs:
        assert choice.finish_reason == "stop", choice
        assert_matches_schema(choice.text)
    assert len({c.text for c in outs[0].outputs}) > 1  # each sequence its own matcher and draws
    assert re.fullmatch(REGEX, outs[1].text) and outs[1].finish_reason == "stop", outs[1].text
    assert re.fullmatch(r"x[yz]+!", outs[2].text) and outs[2].finish_reason == "stop", outs[2].text
    assert outs[3].token_ids == alone


def test_a_constrained_output_ends_with_its_grammar_under_ignore_eos(offline):
    params = SamplingParams(temperature=0, max_tokens=20, regex=REGEX, ignore_eos=True)
    out = offline.generate(["a number"], params, use_tqdm=False)[0]
    assert out.finish_reason == "stop" and re.fullmatch(REGEX, out.text.rstrip()), out.text


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("json_schema", "{not json", "must be JSON"),
        ("json_schema", json.dumps({"type": "frobnicate"}), "Unsupported type"),
        ("regex", "[a-", "Regex"),
        ("ebnf", "root ::= ", "EBNF"),
    ],
)
def test_a_bad_constraint_is_an_error_naming_its_field(offline, field, value, message):
    with pytest.raises(ValueError, match=rf"{field}[\s\S]*{message}"):
        offline.generate(["x"], SamplingParams(max_tokens=4, **{field: value}), use_tqdm=False)
    assert not offline.engine.has_unfinished()


def test_one_constraint_per_request():
    with pytest.raises(ValueError, match="at most one"):
        SamplingParams(regex="a", ebnf='root ::= "a"')


def test_constrained_requests_verify_drafts_the_grammar_masks(model_dir, tmp_path, offline):
    """With DFlash on, constrained requests verify too (each block position masked after the drafts
    before it): greedy outputs are those without speculation, sampled ones still match, the
    unconstrained request beside them is lossless."""
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config", config)
    draft = write_dflash_checkpoint(
        tmp_path / "draft", text["hidden_size"], text["vocab_size"], [0, 1, 2], seed=1, block_size=4
    )
    spec = LLM(
        str(model_dir), device="cpu", page_size=16, max_memory_gb=0.25, speculative_algorithm="DFLASH",
        speculative_draft_model_path=str(draft), speculative_num_draft_tokens=4, speculative_adaptive=False,
    )  # fmt: skip
    prompts = ["the weather", "a number", "hello there", "x"]
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=20, regex=REGEX),
        SamplingParams(temperature=0, max_tokens=120, json_schema=json.dumps(SCHEMA)),
        SamplingParams(temperature=1.0, seed=2, max_tokens=20, ebnf=EBNF),
    ]
    outs = spec.generate(prompts, params, use_tqdm=False)
    plain = offline.generate(prompts[:3], params[:3], use_tqdm=False)
    assert [o.token_ids for o in outs[:3]] == [o.token_ids for o in plain]
    assert re.fullmatch(REGEX, outs[1].text) and re.fullmatch(r"x[yz]+!", outs[3].text)
    assert_matches_schema(outs[2].text)
    assert all(o.metrics.spec_verify_steps > 0 for o in outs)


def test_right_drafts_of_a_constrained_request_are_accepted(model_dir, offline):
    """Drafts that follow the grammar's greedy output are accepted (one corrupted draft is not: the
    mask refuses it), and the output is the one decoded without speculation."""
    params = SamplingParams(temperature=0, max_tokens=120, json_schema=json.dumps(SCHEMA))
    expected = offline.generate(["hello there"], params, use_tqdm=False)[0]
    sequence = [*expected.prompt_token_ids, *expected.token_ids, 0, 0, 0, 0]
    truth = torch.tensor(sequence)[None]  # one request: table row 0
    truth[0, len(expected.prompt_token_ids) + 6] = 0  # a token the JSON grammar refuses there
    oracle = LLM(
        str(model_dir), proposer=Oracle(truth, 3), device="cpu", page_size=16, max_memory_gb=0.25,
        speculative_adaptive=False,
    )  # fmt: skip
    out = oracle.generate(["hello there"], params, use_tqdm=False)[0]
    assert out.token_ids == expected.token_ids
    steps, accepted = out.metrics.spec_verify_steps, out.metrics.spec_accepted_tokens
    assert accepted > 2 * steps and accepted < 3 * steps, (steps, accepted)


def post(url: str, path: str, body: dict) -> httpx.Response:
    return httpx.post(url + path, json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


def test_server_response_format_and_extensions(server):  # noqa: F811 (the imported fixture)
    chat = {"messages": [{"role": "user", "content": "Answer in JSON"}], "max_tokens": 150, "seed": 3}
    schema = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA, "strict": True}}
    reply = post(server, "/v1/chat/completions", chat | {"response_format": schema})
    assert reply.status_code == 200, reply.text
    choice = reply.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert_matches_schema(choice["message"]["content"])
    reply = post(
        server, "/v1/completions", {"prompt": "n:", "max_tokens": 20, "regex": REGEX, "temperature": 0}
    )
    assert reply.status_code == 200 and re.fullmatch(REGEX, reply.json()["choices"][0]["text"]), reply.text


@pytest.mark.parametrize(
    ("body", "param"),
    [
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 7}}}},
            "response_format",
        ),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"regex": "(unclosed"}, "regex"),
        ({"ebnf": "root ::= ", "regex": "a"}, None),
    ],
)
def test_server_rejects_bad_constraints_naming_the_field(server, body, param):  # noqa: F811
    reply = post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]} | body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param or (param is None and "at most one" in error["message"]), error
    assert post(server, "/v1/completions", {"prompt": "ok", "max_tokens": 2}).status_code == 200


@pytest.mark.parametrize(
    "extra",
    [
        {"min_tokens": 15},  # the grammar can only end while min_tokens bans the end
        {"repetition_penalty": 1e300, "logit_bias": {5: 100.0}},  # every allowed token made impossible
    ],
    ids=["min-tokens", "huge-penalty"],
)
def test_the_constraint_wins_over_what_would_leave_it_nothing(offline, extra):
    """On this module's 3-layer model the huge penalty leaves the only allowed token ("b") a finite logit
    near float32's lowest, which the temperature (0.7) once divided to -inf (every logit -inf: token 0
    against the grammar); sampling now shifts each row's largest logit to 0 first."""
    params = SamplingParams(temperature=0.7, seed=5, max_tokens=30, ebnf='root ::= "ab"', **extra)
    out = offline.generate(["ab ab ab"], params, use_tqdm=False)[0]
    assert out.text == "ab" and out.finish_reason == "stop", out
