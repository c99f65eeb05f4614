"""Steps without mixing (`disable_mixed_steps`): a step with prefill work runs only prefill chunks, the
decoding requests go on in the next, which the decode or verify graphs replay; the tokens are the
mixing engine's. Requests arrive while others decode (8 prompts of different output lengths, 4
running at most)."""

from __future__ import annotations

import pytest
from test_engine import GREEDY, checkpoint, make_llm, prompts, reference  # noqa: F401 (fixtures)
from test_mtp import checkpoints  # noqa: F401 (a fixture: a target with an MTP layer)

from hylo.engine.route import Path

# fixed-shape paths as on a GPU (uncaptured on the CPU), their buckets no wider than these prompts need
SMALL = dict(
    max_running_requests=4, decode_graphs=True, context_length=128, cuda_graph_max_prefill_tokens=128
)
MTP = {"speculative_algorithm": "MTP", "speculative_num_steps": 3, "speculative_adaptive": False}


def steps_of(llm) -> tuple[list[tuple[int, int]], list[Path]]:
    """Record each step as (prefill chunks, decode or verify rows) and the route it took."""
    engine, kinds, routes = llm.engine, [], []
    route = engine.runner.route

    def routed(chunks, *args, **kwargs):
        decoding = sum(ch.request.remaining == 1 for ch in chunks)
        kinds.append((len(chunks) - decoding, decoding))
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
    llm = make_llm(checkpoint, **SMALL, disable_mixed_steps=not mixed)
    kinds, routes = steps_of(llm)
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


def test_unmixed_steps_under_mtp_give_plain_decodings_tokens(
    checkpoints,  # noqa: F811
    prompts,  # noqa: F811
):
    target = str(checkpoints[1])
    kwargs = SMALL
    expected = generate(make_llm(target, **kwargs), prompts[:8])
    llm = make_llm(target, **kwargs, **MTP, disable_mixed_steps=True)
    kinds, routes = steps_of(llm)
    assert generate(llm, prompts[:8]) == expected
    assert not any(prefill and decoding for prefill, decoding in kinds)
    assert Path.VERIFY_GRAPH in routes
