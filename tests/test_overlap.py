"""The overlap schedule: step N+1 is scheduled and launched before step N's tokens are read, and the
outputs are those of the engine that reads every step first (`--disable-overlap-schedule`)."""

from __future__ import annotations

import itertools
import re

import pytest
import torch

from hylo import LLM, SamplingParams
from hylo.engine.engine import Engine
from hylo.engine.request import IN_FLIGHT, Status
from hylo.engine.route import RunAhead
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS
from hylo.sampling import SampleRow, target_distribution
from hylo.speculative.adaptive import StepPlan

PROMPTS = [
    "Hello, how are you?",
    "Tell me about the sea.",
    "What is two plus two?",
    "Write a short poem about rain.",
    "Name three colours.",
    "Why is the sky blue?",
]


@pytest.fixture(scope="module")
def engines(shallow_model_dir):
    """The 3-layer cut of the random test model (conftest `shallow_model_dir`: a tokenizer, so stop
    strings and grammars; a layer of each kind) with the overlap schedule and without: which steps run
    ahead and what they read depend on no trained weight (the speculative tests below take the demo
    model, whose trained drafts are accepted)."""
    return schedules(str(shallow_model_dir))


@pytest.fixture(scope="module")
def demo_engines():
    """The demo model with the overlap schedule and without: trained weights, whose constrained replies
    run long enough to keep steps in flight (a random model's grammars end in a few tokens)."""
    return schedules(None)


def schedules(model: str | None) -> dict[bool, Engine]:
    """Engines of `model` (None: the demo) with the overlap schedule (True) and without (False)."""
    # a 0.25 GB cache (the default plan's pools took ~1 s an engine to allocate): room for every script here
    return {
        overlap: LLM(model, disable_overlap_schedule=not overlap, max_memory_gb=0.25).engine
        for overlap in (True, False)
    }


def run(engine, script: dict[int, list[tuple]], on_outputs=None) -> tuple[dict, int]:
    """Drive `engine` call by call, adding and aborting requests before the calls `script` names and
    handing each call's outputs to `on_outputs`; (what every request produced, how many calls left a
    step in flight)."""
    tokenizer = engine.tokenizer
    created, ahead, call = [], 0, 0
    start = (engine.caches.num_available_pages, engine.caches.slots.num_free)
    while script or engine.has_unfinished():
        for action in script.pop(call, []):
            if action[0] == "add":
                _, rid, prompt, params = action
                created += engine.add_request(rid, tokenizer.encode(prompt), params)
            else:
                engine.abort(action[1])
        outputs = engine.step()
        if on_outputs is not None:
            on_outputs(outputs)
        ahead += engine.in_flight is not None
        call += 1
    assert (engine.caches.num_available_pages, engine.caches.slots.num_free) == start
    return {
        r.request_id: (r.output_ids, r.text, r.finish_reason, r.logprobs, r.prompt_logprobs) for r in created
    }, ahead


def run_counting_accepted(engine, script: dict[int, list[tuple]]) -> tuple[dict, int, dict[str, list[int]]]:
    """`run`, and the drafts each verify step of each request accepted, in order."""
    accepted: dict[str, list[int]] = {}

    def count_accepted(outputs):
        for out in outputs:
            if out.accepted_drafts is not None:
                accepted.setdefault(out.request.request_id, []).append(out.accepted_drafts)

    return (*run(engine, script, count_accepted), accepted)


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for rid in a:
        (ids, text, reason, logprobs, prompt_logprobs), other = a[rid], b[rid]
        assert (ids, text, reason) == other[:3], rid
        for mine, theirs in ((logprobs, other[3]), (prompt_logprobs, other[4])):
            assert len(mine) == len(theirs)
            for entry, ref in zip(mine, theirs, strict=True):
                assert entry.keys() == ref.keys(), rid
                assert all(abs(entry[t] - ref[t]) < 1e-4 for t in entry), rid


SEEDED = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=25, n=2)
PENALISED = SamplingParams(
    temperature=0.9, seed=3, max_tokens=20, frequency_penalty=0.8, presence_penalty=0.5, ignore_eos=True
)


def greedy(n: int, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=n, **kwargs)


def test_outputs_match_the_schedule_that_reads_every_step(engines):
    """Greedy, seeded sampling (top-p, n=2), min_tokens, logprobs, stop ids and strings, requests
    arriving and aborted mid-run, penalised requests (their penalties count the token in flight) and
    a constrained one give what the engine without the overlap schedule gives; steady decoding keeps
    a step in flight."""
    probe, _ = run(engines[False], {0: [("add", "p", PROMPTS[0], greedy(30, ignore_eos=True))]})
    ids, text = probe["p"][0], probe["p"][1]
    stop_id, stop_text = ids[9], text[len(text) // 2 : len(text) // 2 + 3]
    assert stop_id not in ids[:9] and stop_text

    def script() -> dict[int, list[tuple]]:
        return {
            0: [
                ("add", "greedy", PROMPTS[0], greedy(40, ignore_eos=True)),
                ("add", "stop-id", PROMPTS[0], greedy(40, stop_token_ids=[stop_id], ignore_eos=True)),
                ("add", "stop-str", PROMPTS[0], greedy(40, stop=[stop_text], ignore_eos=True)),
                ("add", "seeded", PROMPTS[1], SEEDED),
                ("add", "min", PROMPTS[2], greedy(12, min_tokens=6, logprobs=2)),
            ],
            4: [("add", "late", PROMPTS[3], SamplingParams(temperature=0.7, seed=11, max_tokens=15))],
            7: [("abort", "greedy")],
            9: [("add", "scored", PROMPTS[4], greedy(5, prompt_logprobs=1, logprobs=0))],
            12: [
                ("add", "penalised", PROMPTS[5], greedy(20, repetition_penalty=1.3, ignore_eos=True)),
                ("add", "frequency", PROMPTS[1], PENALISED),
            ],
            16: [("add", "constrained", PROMPTS[2], greedy(12, regex="[a-z ]{4,30}"))],
        }  # fmt: skip

    overlapped, ahead = run(engines[True], script())
    reference, never = run(engines[False], script())
    same(overlapped, reference)
    assert reference["stop-id"][2] == "stop" and reference["stop-id"][0][-1] == stop_id
    assert reference["stop-str"][2] == "stop" and stop_text not in reference["stop-str"][1]
    assert reference["greedy"][2] == "abort" and 0 < len(reference["greedy"][0]) < 40
    assert never == 0 and ahead > 0


def test_the_step_after_runs_on_in_flight_tokens(engines):
    """After a call in steady decoding the next step is on the device already: its requests count
    its position as computed and its token as in flight, which their chunks feed from the device."""
    engine = engines[True]
    (request,) = engine.add_request("r", engine.tokenizer.encode(PROMPTS[1]), greedy(8, ignore_eos=True))
    outputs = engine.step()  # the prefill: read at once
    assert engine.in_flight is None and len(outputs[0].new_token_ids) == 1
    engine.step()  # the first decode step, then the second behind it
    assert [ch.request for ch in engine.in_flight.chunks] == [request]
    assert request.in_flight == 1 and request.remaining == 1
    assert request.num_computed == request.total_len  # the last token read is fed by the step ahead
    assert request.tokens(request.total_len - 1, request.total_len + 1)[-1] == IN_FLIGHT
    while engine.has_unfinished():
        engine.step()
    assert request.status is Status.FINISHED and len(request.output_ids) == 8 and request.in_flight == 0


def test_no_step_ahead_while_a_waiting_request_could_start(engines):
    """A waiting request that a free slot could admit makes the engine read first (the step after
    would admit it), and the engine says so; with every slot taken the step after runs ahead without
    it."""
    engine = engines[True]
    for i in range(2):
        engine.add_request(f"a{i}", engine.tokenizer.encode(PROMPTS[i]), greedy(6, ignore_eos=True))
    engine.step()
    engine.step()
    launched, plan = [ch.request for ch in engine.in_flight.chunks], StepPlan(True, True)
    engine.add_request("w", engine.tokenizer.encode(PROMPTS[2]), greedy(3))
    refusal = engine.scheduler.schedule_ahead(launched, plan)
    assert isinstance(refusal, RunAhead) and not refusal.ok and "waiting request" in refusal.reason
    taken = engine.caches.slots.alloc(engine.caches.slots.num_free)
    try:
        ahead = engine.scheduler.schedule_ahead(launched, plan)
        assert [ch.request for ch in ahead] == launched
    finally:
        engine.caches.slots.free(taken)
    engine.step()  # the step in flight is read before the next one is scheduled
    assert engine.in_flight is None and not engine.last_run_ahead.ok
    assert "waiting request" in engine.last_run_ahead.reason
    engine.abort("w")
    while engine.has_unfinished():
        engine.step()


def test_penalties_count_the_token_in_flight():
    """A row whose last output token is still on the device (`SampleRow.unread`) is penalised as if
    the host had it, seen before or not."""
    logits = torch.randn(1, 50, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(
        temperature=0, repetition_penalty=1.5, frequency_penalty=0.7, presence_penalty=0.3
    )
    for last in (4, 9):  # 4 is in the output already, 9 nowhere
        read = SampleRow(params, [1, 2], [3, 4, last], None, [])
        unread = SampleRow(params, [1, 2], [3, 4], None, [], torch.tensor([last]))
        assert torch.equal(target_distribution(logits, [read])[0], target_distribution(logits, [unread])[0])


def test_constrained_rows_pick_after_their_grammar_took_the_token_before(demo_engines):
    """A step of constrained rows runs its forward ahead and picks once the step before has been read
    and its tokens fed to the grammars (`ModelRunner.sample_launched`): the outputs are the reading
    engine's and match their constraints."""
    schema = '{"type": "object", "properties": {"a": {"type": "string"}}}'

    def script() -> dict[int, list[tuple]]:
        return {
            0: [
                ("add", "regex", PROMPTS[2], greedy(12, regex="[a-z ]{4,30}")),
                (
                    "add",
                    "json",
                    PROMPTS[1],
                    SamplingParams(max_tokens=20, json_schema=schema, temperature=0.8, seed=4),
                ),
            ]
        }

    deferred = []
    runner = demo_engines[True].runner
    sample_launched = runner.sample_launched
    runner.sample_launched = lambda launched: deferred.append(1) or sample_launched(launched)
    try:
        overlapped, ahead = run(demo_engines[True], script())
    finally:
        del runner.sample_launched
    reference, _ = run(demo_engines[False], script())
    same(overlapped, reference)
    assert ahead > 5 and len(deferred) >= ahead
    assert re.fullmatch("[a-z ]{4,30}", reference["regex"][1]) and reference["json"][1].startswith("{")


# a verify step follows a plain step that drafted for it; the plain steps that draft nothing overlap
SCRIPTED_PLANS = [
    StepPlan(False, False), StepPlan(False, False), StepPlan(False, False), StepPlan(False, True),
    StepPlan(True, True), StepPlan(True, False),
]  # fmt: skip


def flags_of(algorithm: str) -> dict:
    """The engine flags that speculate with `algorithm` (dflash, dflash2, mtp) on the demo model."""
    if algorithm == "mtp":
        return dict(speculative_algorithm="MTP", speculative_num_steps=3)
    return dict(speculative_algorithm="DFLASH", speculative_draft_model_path=str(DEMO_DRAFTS[algorithm]))


def run_scripted_plans(algorithm: str, overlap: bool, graphs: bool) -> tuple[dict, int, dict[str, list[int]]]:
    """`run_counting_accepted` of a demo engine speculating with `algorithm` whose decode steps follow
    `SCRIPTED_PLANS`, on a script of three requests."""
    llm = LLM(
        str(DEMO_DIR), device="cpu", dtype="float32", disable_overlap_schedule=not overlap,
        decode_graphs=graphs, cuda_graph_max_bs=4, max_memory_gb=0.25, mixed_steps="on",
        **flags_of(algorithm),
    )  # fmt: skip
    # (mixed steps: "late"'s prefill joins a step of the others, whose steps then follow the scripted
    # plans alike in both engines; unmixed, its prefill-only step falls a step later with the overlap
    # schedule and shifts the others' blocks in the plans' cycle)
    engine, plans = llm.engine, itertools.cycle(SCRIPTED_PLANS)
    engine.policy.plan = lambda bucket: next(plans)
    script = {
        0: [
            ("add", "greedy", PROMPTS[0], greedy(40, ignore_eos=True)),
            ("add", "seeded", PROMPTS[1], SamplingParams(temperature=0.8, seed=5, max_tokens=30)),
        ],
        5: [("add", "late", PROMPTS[3], greedy(25, ignore_eos=True))],
    }
    return run_counting_accepted(engine, script)


@pytest.fixture(scope="module", params=["dflash2", "mtp"])
def reading_scripted_plans(request) -> tuple[str, tuple[dict, int, dict[str, list[int]]]]:
    """(the algorithm, `run_scripted_plans` of the eager engine that reads every step): the reference of
    both the eager and the fixed-shape overlapped runs (the fixed-shape path computes what the eager
    one does: test_spec's verify-graph tests; one reading run for both)."""
    return request.param, run_scripted_plans(request.param, overlap=False, graphs=False)


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "fixed-shape"])
def test_speculative_plain_steps_overlap_and_the_drafts_see_every_token(reading_scripted_plans, graphs):
    """A speculative engine launches its plain steps that draft nothing ahead of the read before them
    (the adaptive policy's plain mode), their observes run on the device (an eager step's after its
    picks, a fixed-shape one's deferred to the ring), and the next drafting step's proposer has seen
    every token: tokens and accepted drafts equal the engine that reads every step (the demo's trained
    drafts accept many tokens, so a draft context missing a token would show)."""
    algorithm, (reference, never, accepted_ref) = reading_scripted_plans
    overlapped, ahead, accepted = run_scripted_plans(algorithm, overlap=True, graphs=graphs)
    same(overlapped, reference)
    # "late" arrives while the verify step ahead may be on the device already (its rows sample or pick
    # their argmax from what they know before the read): it then starts a step later than when every
    # step is read, and its blocks fall elsewhere in the plans' cycle; its tokens are the same
    late, late_ref = accepted.pop("late"), accepted_ref["late"]  # (the fixture's dict is shared)
    others_ref = {rid: counts for rid, counts in accepted_ref.items() if rid != "late"}
    assert accepted == others_ref and sum(map(sum, accepted.values())) > 10 and late and late_ref
    assert never == 0 and ahead > 5


CONTEXT = 40  # "long" below runs into it


@pytest.fixture(scope="module")
def verify_stop_id(demo_engines) -> int:
    """The 13th token of the demo's greedy reply to PROMPTS[2]: the verify test's "stop-id" request
    (greedy on that prompt) meets it inside a block."""
    probe, _ = run(demo_engines[False], {0: [("add", "p", PROMPTS[2], greedy(13, ignore_eos=True))]})
    return probe["p"][0][12]


@pytest.mark.parametrize("algorithm", ["dflash", "dflash2", "mtp"])
def test_verify_steps_overlap_and_give_the_tokens_of_reading_every_step(verify_stop_id, algorithm):
    """Verify steps after verify steps are launched before the one ahead is read (the fixed-shape
    verify path, as the GPU replays it): each block starts where the commit in flight leaves it, on
    the device. Requests that stop at a stop id or their token limit inside a block, an abort, a late
    arrival asking for logprobs (the step ahead waits for it to start), seeded sampled requests (their
    acceptance runs between the graphs' replays: launched ahead while their blocks stay clear of
    their token limit, read first near it) and a request that runs into the context length (near it no
    block fits after a commit in flight: those steps read first) give the tokens, logprobs and
    accepted drafts of the engine that reads every step; the demo's trained drafts accept many
    tokens, so a block starting at a wrong position or from a wrong anchor would show."""
    stop_id, results = verify_stop_id, {}
    for overlap in (True, False):
        llm = LLM(
            str(DEMO_DIR), device="cpu", dtype="float32", disable_overlap_schedule=not overlap,
            decode_graphs=True, cuda_graph_max_bs=4, max_memory_gb=0.1, speculative_adaptive=False,
            context_length=CONTEXT, page_size=16, **flags_of(algorithm),
        )  # fmt: skip
        engine, launched = llm.engine, []

        def launching(chunks, *rest, launch=engine.runner.launch, launched=launched):
            if all(ch.verify and ch.request.verifying for ch in chunks):
                params = [ch.request.params for ch in chunks]
                launched.append((any(not p.greedy for p in params), any(p.logprobs for p in params)))
            return launch(chunks, *rest)

        engine.runner.launch = launching
        script = {
            0: [
                ("add", "long", PROMPTS[0], greedy(45, ignore_eos=True)),
                ("add", "stop-id", PROMPTS[2], greedy(40, stop_token_ids=[stop_id], ignore_eos=True)),
                ("add", "short", PROMPTS[5], greedy(11, ignore_eos=True)),
                ("add", "seeded", PROMPTS[4], SamplingParams(temperature=0.8, seed=9, max_tokens=22)),
            ],
            3: [("add", "late", PROMPTS[3], greedy(25, ignore_eos=True, logprobs=2))],
            6: [("abort", "short")],
            12: [("add", "sampled", PROMPTS[1], SamplingParams(temperature=0.8, seed=5, max_tokens=12))],
        }
        outputs = run_counting_accepted(engine, script)
        kinds = [sum(column) for column in zip(*launched, strict=True)] if launched else [0, 0]
        results[overlap] = (*outputs, len(launched), *kinds)
    (
        (overlapped, ahead, accepted, after_commit, sampled, logprobs),
        (reference, never, accepted_ref, *none),
    ) = (
        results[True],
        results[False],
    )
    same(overlapped, reference)
    assert reference["stop-id"][2] == "stop" and reference["stop-id"][0][-1] == stop_id
    # "long" runs into the context: near it a block cannot start a block after the commit in flight
    assert len(llm.tokenizer.encode(PROMPTS[0])) + len(reference["long"][0]) == CONTEXT
    assert accepted == accepted_ref and sum(map(sum, accepted.values())) > 10
    assert never == 0 and none == [0, 0, 0] and ahead > 3 and after_commit > 3 and sampled and logprobs
