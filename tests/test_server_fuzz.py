"""The server against its own /openapi.json: schemathesis (its Python API, the engine `st run`
drives), every check, a fixed seed (issue 21, defect 8). Schema-valid requests must succeed,
invalid ones must get a documented 4xx, responses must match their documented schemas, and
nothing may answer a 5xx."""

from __future__ import annotations

import time

import pytest
import schemathesis
from schemathesis.engine import Status, events
from schemathesis.engine import from_schema as engine_for
from test_server import start_server, stop

KEY = "fuzz-key"
# Per operation, in the fuzzing phase. Every operation also gets the coverage phase (~3400 requests: each
# field's boundary and invalid values, every undocumented method), whose cases do not depend on this.
# Each example per operation costs ~1.5 s of CPU over the 35 operations (50 took 180 s of the CI budget).
EXAMPLES = 10
# Generation costs engine time; schema-valid requests are trimmed to this much of it (still valid).
MAX_TOKENS, MAX_N, MAX_PROMPTS = 2, 2, 2


# The server runs conftest's `shallow_model_dir` (the random test model cut to 3 layers, one of each kind):
# the API's contract does not depend on the depth, and each engine step costs ~40% of the 8-layer one (a
# 2-token chat request 43 ms instead of 118 ms here), for the ~300 schema-valid requests that generate.


@pytest.fixture(scope="module")
def fuzz_server(shallow_model_dir):
    # a context long enough for any prompt the seeded run generates: prompt length is the one limit
    # a schema cannot state (it is counted in tokens). 8192 was not: one run's /v1/messages case carried a
    # `system` list of arbitrary objects that rendered to 8220 tokens (the draws differ between runs)
    proc, url = start_server(shallow_model_dir, "--api-key", KEY, "--context-length", "32768")
    yield url
    stop(proc)


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _trim(_ctx, case):
    """Fewer tokens, sequences and prompts for schema-valid requests, which stay valid (an invalid
    one is left alone: trimming could make it valid)."""
    body = case.body
    if case.meta is None or not case.meta.generation.mode.is_positive or not isinstance(body, dict):
        return case
    for key, most in (
        ("max_tokens", MAX_TOKENS),
        ("max_completion_tokens", MAX_TOKENS),
        ("max_output_tokens", MAX_TOKENS),
        ("n", MAX_N),
        ("best_of", MAX_N),
    ):
        if _number(body.get(key)) and body[key] > most:  # 5.0 is a JSON integer too
            body[key] = most
    if "messages" in body and body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_completion_tokens"] = MAX_TOKENS
    if "prompt" in body and body.get("max_tokens") is None:  # completions default to 16
        body["max_tokens"] = MAX_TOKENS
    if "input" in body and body.get("max_output_tokens") is None:  # responses: what the context leaves
        body["max_output_tokens"] = MAX_TOKENS
    if isinstance(body.get("prompt"), list) and body["prompt"] and not isinstance(body["prompt"][0], int):
        body["prompt"] = body["prompt"][:MAX_PROMPTS]
    # whether a constraint compiles is more than the schema can say (a 400 names one that does not,
    # tests/test_structured.py): schema-valid requests get constraints that compile
    for key, compiles in (("regex", "[a-z]+"), ("ebnf", 'root ::= "a"+')):
        if isinstance(body.get(key), str):
            body[key] = compiles
    # best_of is at least n, and n itself with stream (what the field's description says)
    if _number(body.get("best_of")):
        n = body["n"] if _number(body.get("n")) else 1
        body["best_of"] = n if body.get("stream") is True else max(body["best_of"], n)
    json_format = body.get("response_format")
    if isinstance(json_format, dict) and isinstance(json_format.get("json_schema"), dict):
        json_format["json_schema"]["schema"] = {"type": "object"}
    text_format = body["text"].get("format") if isinstance(body.get("text"), dict) else None
    if isinstance(text_format, dict) and isinstance(text_format.get("schema"), dict):  # /v1/responses'
        text_format["schema"] = {"type": "object"}
    return case


def _describe(recorder, case_id: str, check) -> str:
    failure = check.failure_info.failure
    interaction = recorder.interactions.get(case_id)
    sent = answer = ""
    if interaction is not None:
        sent = (interaction.request.body or b"")[:300]
        if interaction.response is not None:
            answer = f"{interaction.response.status_code} {(interaction.response.content or b'')[:300]!r}"
    return (
        f"{recorder.label} [{check.name}] {failure.title}: {failure.message}\n  sent {sent!r}\n  got {answer}"
    )


def test_openapi_schema_is_the_truth(fuzz_server):
    config = schemathesis.config.SchemathesisConfig.from_dict(
        {
            "seed": 21,
            "headers": {"Authorization": f"Bearer {KEY}"},
            # no example database: every run draws the same cases from the seed (a local .hypothesis/
            # directory replayed earlier runs' cases, a clean clone none), and no Pareto front of them
            # is kept (~10 s of the fuzzing phase's CPU)
            "generation": {"max-examples": EXAMPLES, "database": "none"},
            "request-timeout": 60,
        }
    )
    schema = schemathesis.openapi.from_url(f"{fuzz_server}/openapi.json", config=config)
    schema.hook("map_case")(_trim)
    failures, errors, tested = [], [], set()
    start = time.monotonic()
    for event in engine_for(schema).execute():
        if isinstance(event, events.PhaseFinished):
            print(f"  {event.phase.name}: {time.monotonic() - start:.0f} s")
        if isinstance(event, events.ScenarioFinished):
            tested.add(event.label)
            if event.status == Status.FAILURE:
                for case_id, checks in event.recorder.checks.items():
                    failures += [_describe(event.recorder, case_id, c) for c in checks if c.failure_info]
        elif isinstance(event, (events.NonFatalError, events.FatalError)):
            errors.append(repr(getattr(event, "value", None) or event.exception))
    print(f"schemathesis: {len(tested)} operations in {time.monotonic() - start:.0f} s")
    assert not errors, errors
    assert not failures, "\n".join(sorted(set(failures)))
    assert {
        "POST /v1/completions",
        "POST /v1/chat/completions",
        "POST /v1/tokenize",
        "POST /v1/responses",
    } <= tested
