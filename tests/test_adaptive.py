"""The adaptive draft-length policy: its rule on given costs, and engines that use it stay lossless."""

from __future__ import annotations

import itertools
import time

import pytest
import torch
from conftest import random_prompt
from hf_reference import tiny_text_config, write_hf_checkpoint
from test_spec import GREEDY, Oracle, Scripted

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.speculative.adaptive import DraftLengthPolicy, StepPlan
from hylo.speculative.verify import VerifyShape

BLOCK = VerifyShape(4)


def run_steps(policy: DraftLengthPolicy, n: int, verify_cost: float, plain_cost: float, committed: float):
    """`n` steps of bucket 1 at those costs; returns each step's plan."""
    plans = []
    for _ in range(n):
        plan = policy.plan(1)
        plans.append(plan)
        policy.record(
            1, plan.verify, verify_cost if plan.verify else plain_cost, committed if plan.verify else None
        )
    return plans


def test_policy_measures_both_modes_then_keeps_the_faster():
    # verify costs 2.5 plain steps: worth it when a block commits 4 tokens, not when it commits 1
    good = DraftLengthPolicy(BLOCK)
    plans = run_steps(good, 40, verify_cost=2.5, plain_cost=1.0, committed=4.0)
    # verify (unmeasured), verify again announcing a plain step, plain (planned before its own cost is
    # known, so it announces one more plain step), plain announcing verify, then verify throughout
    assert plans[:4] == [
        StepPlan(True, True),
        StepPlan(True, False),
        StepPlan(False, False),
        StepPlan(False, True),
    ]
    assert all(p.verify and p.draft for p in plans[4:]) and good.choices == {"verify": 38, "plain": 2}

    bad = DraftLengthPolicy(BLOCK, probe_every=8, max_probe_every=32)
    plans = run_steps(bad, 200, verify_cost=2.5, plain_cost=1.0, committed=1.0)
    verifying = [i for i, p in enumerate(plans) if p.verify]
    # after the first measurements, a verify probe after 8 plain steps, and each failed probe doubles
    # the wait, up to 32 plain steps
    assert verifying[:3] == [0, 1, 11]
    gaps = [b - a - 1 for a, b in itertools.pairwise(verifying[2:])]
    assert gaps[:3] == [16, 32, 32] and set(gaps[2:]) == {32}
    # every verify step was announced a step ahead, so its drafts exist
    assert all(plans[i - 1].draft for i in verifying if i)

    # a draft that turns right again is verified from the next probe on, and the wait starts over
    plans = run_steps(bad, 40, verify_cost=2.5, plain_cost=1.0, committed=4.0)
    first = next(i for i, p in enumerate(plans) if p.verify)
    assert first <= 33 and all(p.verify for p in plans[first + 2 :])
    assert bad._probe_interval[1] == 8


def test_a_lucky_probe_does_not_start_the_back_off_over():
    """A probe whose block happens to pay is verified on while it pays, but the probe interval goes
    on doubling until the running mean pays: a mostly wrong draft keeps its long waits."""
    policy = DraftLengthPolicy(BLOCK, probe_every=8, max_probe_every=64)
    run_steps(policy, 30, verify_cost=2.5, plain_cost=1.0, committed=1.0)  # two probes: interval 32
    assert policy._probe_interval[1] == 32
    verified = []
    for step in range(200):
        plan = policy.plan(1)
        lucky = plan.verify and not verified  # the first probe commits 3 tokens, the rest 1
        if plan.verify:
            verified.append(step)
        policy.record(
            1, plan.verify, 2.5 if plan.verify else 1.0, (3.0 if lucky else 1.0) if plan.verify else None
        )
    # the lucky probe is verified on (two follow-ups, announced before its own result and after
    # it), then the next probe waits out the doubled interval rather than the first one again
    assert verified[1] - verified[0] <= 2 and verified[2] - verified[1] == 1
    assert verified[3] - verified[2] > 32 and policy._probe_interval[1] == 64


def test_policy_costs_are_per_bucket_and_robust_to_one_slow_step():
    policy = DraftLengthPolicy(BLOCK)
    for seconds in (5.0, 1.0, 1.0, 1.0):  # a first step that compiled kernels
        policy.record(8, True, seconds, 2.0)
    assert policy.cost(8, True) == 1.0 and policy.cost(1, True) is None
    with pytest.raises(ValueError, match="block"):
        DraftLengthPolicy(VerifyShape(1))


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """A tiny target of 4 layers with one of each kind (hf_reference 'each-kind'): the policy and the
    losslessness of its choices do not depend on the depth, and each step costs ~2/3 of the 6-layer
    mix's."""
    config = tiny_text_config(4, 8, "each-kind")
    return write_hf_checkpoint(tmp_path_factory.mktemp("target"), config, seed=21)


def generate(engine: Engine, prompts, max_tokens=40) -> list[list[int]]:
    params = GREEDY.model_copy(update={"max_tokens": max_tokens})
    requests = [engine.add_request(str(i), p, params)[0] for i, p in enumerate(prompts)]
    while engine.has_unfinished():
        engine.step()
    return [r.output_ids for r in requests]


def test_adaptive_engines_are_lossless_and_follow_the_acceptance(target):
    """A draft that is always right keeps verifying; one that is always wrong is dropped for plain
    decoding; the tokens equal plain decoding either way. Steps are charged fixed costs (a verify step
    2.5 plain ones), as CPU wall times of the tiny model are noise. (The overlap schedule plans a plain
    step ahead before the one in flight is charged: one more plain step while the costs are learnt.)"""
    config = EngineConfig(
        model=str(target), device="cpu", dtype="float32", page_size=16, context_length=96,
        max_memory_gb=0.25, max_running_requests=4,
    )  # fmt: skip
    prompts = [random_prompt(n, 160, seed=70 + n) for n in (21, 9)]
    expected = generate(Engine(config), prompts)

    def charged(engine: Engine) -> Engine:
        record = engine.policy.record
        engine.policy.record = lambda bucket, verify, seconds, committed: record(
            bucket, verify, 2.5 if verify else 1.0, committed
        )
        return engine

    truth = torch.zeros(config.max_running_requests + 1, 96, dtype=torch.long)
    for slot, (prompt, out) in enumerate(zip(prompts, expected, strict=True)):
        truth[slot, : len(prompt) + len(out)] = torch.tensor([*prompt, *out])
    right = charged(Engine(config, proposer=Oracle(truth, BLOCK.drafts)))
    assert generate(right, prompts) == expected
    assert right.policy.choices["verify"] > 2 * right.policy.choices["plain"]

    always_wrong = Scripted({tuple(p): [0] * 64 for p in prompts}, set(range(64)), BLOCK.drafts)
    wrong = charged(Engine(config, proposer=always_wrong))
    assert generate(wrong, prompts) == expected
    assert wrong.policy.choices["plain"] > 2 * wrong.policy.choices["verify"]


def test_step_costs_count_the_time_between_steps_and_not_the_idle_time(target):
    """The policy is charged the wall time from one step's results to the next's, the caller's work
    between `step` calls included (each call here waits `GAP` first: every decode step is charged
    more than it), while the time an engine spends with nothing to run is charged to no step (a
    request arriving `IDLE` after the last one finished)."""
    GAP, IDLE = 0.05, 1.0
    config = EngineConfig(
        model=str(target), device="cpu", dtype="float32", page_size=16, context_length=96,
        max_memory_gb=0.25, max_running_requests=4,
    )  # fmt: skip
    prompts = [random_prompt(n, 160, seed=80 + n) for n in (11, 7)]
    engine = Engine(config, proposer=Scripted({tuple(p): [0] * 64 for p in prompts}, set(), BLOCK.drafts))
    charged = []
    record = engine.policy.record
    engine.policy.record = lambda bucket, verify, seconds, committed: (
        charged.append(seconds) or record(bucket, verify, seconds, committed)
    )
    for i, prompt in enumerate(prompts):
        if i:
            time.sleep(IDLE)  # nothing to run: the previous request finished
        engine.add_request(str(i), prompt, GREEDY.model_copy(update={"max_tokens": 6}))
        while engine.has_unfinished():
            time.sleep(GAP)
            engine.step()
    assert len(charged) >= 2 * 4  # each request's decode steps after its prefill
    assert all(GAP <= s < IDLE for s in charged), charged
