"""Steps without mixing (`mixed_steps` off; auto: off with speculative decoding): a step with prefill
work runs only prefill chunks, the decoding requests go on in the next, which the decode or verify
graphs replay; the tokens are the mixing engine's; while few prompts have prefill work, a step
prefills one of them in the prefill graphs. Requests arrive while others decode (8 prompts of
different output lengths, 4 running at most)."""

from __future__ import annotations

import pytest
from mtp_checkpoint import write_mtp_target
from test_engine import GREEDY, checkpoint, make_llm, prompts, reference  # noqa: F401 (fixtures)

from hylo.engine.route import Path
from hylo.engine.scheduler import ONE_PROMPT_STEPS_UP_TO

# fixed-shape paths as on a GPU (uncaptured on the CPU), their buckets no wider than these prompts need;
# no prefix cache: its snapshots at these 16-token pages' boundaries, off the KDA chunks' (64 tokens),
# would send prompts to eager steps (at the default 64-token pages the prefill graphs take them)
SMALL = dict(
    max_running_requests=4,
    decode_graphs=True,
    context_length=128,
    cuda_graph_max_prefill_tokens=128,
    disable_radix_cache=True,
)
MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 3, "speculative_adaptive": False}


@pytest.fixture(scope="module")
def mtp_target(tmp_path_factory):
    """A target with an MTP layer over the tiny mix test_engine's `checkpoint` has (one layer of each
    kind, 3 Sinkhorn iterations): which steps mix and which graphs replay does not depend on the depth."""
    return write_mtp_target(tmp_path_factory.mktemp("mtp"), "each-kind", hc_sinkhorn_iters=3)


def steps_of(llm, prompts_with_work: list[int] | None = None) -> tuple[list[tuple[int, int]], list[Path]]:
    """Record each step as (prefill chunks, decode or verify rows) and the route it took, and in
    `prompts_with_work` the prompts that had prefill work when it was scheduled."""
    engine, kinds, routes = llm.engine, [], []
    route = engine.runner.route

    def routed(chunks, *args, **kwargs):
        decoding = sum(ch.request.remaining == 1 for ch in chunks)
        kinds.append((len(chunks) - decoding, decoding))
        if prompts_with_work is not None:  # (no prompt goes on unscheduled in an unmixed step)
            prompts_with_work.append(len(chunks) - decoding + len(engine.scheduler.waiting))
        picked = route(chunks, *args, **kwargs)
        routes.append(picked.path)
        return picked

    engine.runner.route = routed
    return kinds, routes


def lengths(count: int) -> list[int]:
    """Output lengths that differ, so that requests end, and others start, while some decode."""
    return [4 + 2 * (i % 5) for i in range(count)]


def generate(llm, token_ids) -> list[list[int]]:
    params = [GREEDY.model_copy(update={"max_tokens": n}) for n in lengths(len(token_ids))]
    outs = llm.generate(prompt_token_ids=token_ids, sampling_params=params, use_tqdm=False)
    return [o.token_ids for o in outs]


@pytest.mark.parametrize("mixed", [True, False])
def test_unmixed_steps_give_the_same_tokens_and_replay_the_decode_graphs(
    checkpoint,  # noqa: F811
    prompts,  # noqa: F811
    reference,  # noqa: F811
    mixed,
):
    llm = make_llm(checkpoint, **SMALL, mixed_steps="on" if mixed else "off")
    with_work = []
    kinds, routes = steps_of(llm, with_work)
    assert generate(llm, prompts) == [
        out[:n] for out, n in zip(reference, lengths(len(prompts)), strict=True)
    ]
    mixed_steps = sum(prefill > 0 and decoding > 0 for prefill, decoding in kinds)
    decoding_only = [path for (prefill, _), path in zip(kinds, routes, strict=True) if prefill == 0]
    if mixed:
        assert mixed_steps > 5  # the arrivals do mix with the decoding requests by default
    else:
        assert mixed_steps == 0
        assert Path.EAGER not in decoding_only  # every decode step replays the decode graphs
        # while at most ONE_PROMPT_STEPS_UP_TO prompts have prefill work, a step prefills one of them
        # in the prefill graphs; the burst of 16 arrivals shares eager steps
        few = [
            (prefill, path)
            for (prefill, decoding), path, n in zip(kinds, routes, with_work, strict=True)
            if prefill and n <= ONE_PROMPT_STEPS_UP_TO
        ]
        assert len(few) >= ONE_PROMPT_STEPS_UP_TO and all(step == (1, Path.PREFILL_GRAPH) for step in few)
        assert kinds[0] == (4, 0) and routes[0] is Path.EAGER


def test_unmixed_steps_under_mtp_give_plain_decodings_tokens(
    mtp_target,
    prompts,  # noqa: F811
):
    target = str(mtp_target)
    kwargs = SMALL
    expected = generate(make_llm(target, **kwargs), prompts[:8])
    llm = make_llm(target, **kwargs, **MTP)  # mixed_steps auto: off with speculation
    kinds, routes = steps_of(llm)
    assert generate(llm, prompts[:8]) == expected
    assert not any(prefill and decoding for prefill, decoding in kinds)
    # arrivals replay the prefill graphs, which draft nothing: their first block is the anchor alone
    assert Path.VERIFY_GRAPH in routes and Path.PREFILL_GRAPH in routes


def test_mixed_steps_auto_is_on_without_speculation_and_off_with_it(mtp_target):
    target = str(mtp_target)
    assert make_llm(target, **SMALL).engine.scheduler.mixed_steps
    assert not make_llm(target, **SMALL, **MTP).engine.scheduler.mixed_steps
    assert make_llm(target, **SMALL, **MTP, mixed_steps="on").engine.scheduler.mixed_steps
    assert not make_llm(target, **SMALL, mixed_steps="off").engine.scheduler.mixed_steps
    with pytest.raises(ValueError, match="mixed_steps must be auto, on or off"):
        make_llm(target, **SMALL, mixed_steps="sometimes")
