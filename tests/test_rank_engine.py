"""A rank engine (`hylo.distributed.rank_engine`: one rank of a TP/EP engine alone, its collectives a
stand-in) holds exactly the tensors that rank of a real gloo engine holds and issues the same device
collectives, in kind, shape and count, in a prefill, a decode and a verify step."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from follower_pool import FollowerPool

from hylo.config import EngineConfig
from hylo.distributed.launch import start
from hylo.distributed.rank_engine import rank_engine
from hylo.engine.engine import Engine
from hylo.models.demo import DEMO_DIR, DEMO_DRAFTS
from hylo.parallel.layout import CollectiveCall
from hylo.sampling import SamplingParams

PROMPTS = [list(range(10, 30)), [5, 6, 7]]
STEPS = 3  # prefill (with the first drafts), then decode or verify steps of the same two rows
PLAIN = dict()
DFLASH = dict(
    speculative_algorithm="DFLASH",
    speculative_draft_model_path=str(DEMO_DRAFTS["dflash"]),
    speculative_adaptive=False,  # every step after the prefill verifies
)


def _config(tp: int, spec: dict) -> EngineConfig:
    return EngineConfig.from_kwargs(
        model=str(DEMO_DIR),
        device="cpu",
        load_format="dummy",
        tp_size=tp,
        max_running_requests=4,
        max_memory_gb=0.05,
        **spec,
    )


@pytest.fixture(scope="module")
def pooled_ranks():
    """The real engines' other ranks run in three processes, each started once (tests/follower_pool.py),
    as spawned workers would: the TP2 case's rank 1 serves the TP4 case's rank 1 too, one start-up
    (~4.5 s of CPU importing torch and hylo) fewer. The real worker processes are
    test_tensor_parallel_server's."""
    with FollowerPool(3) as pool, pytest.MonkeyPatch.context() as monkeypatch:
        pool.patch(monkeypatch)
        yield


def _step_calls(engine: Engine, calls: list[CollectiveCall]) -> list[list[CollectiveCall]]:
    """The collectives each of the first `STEPS` steps issues, with `PROMPTS` running."""
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt, params)
    steps = []
    for _ in range(STEPS):
        start = len(calls)
        engine.step()
        steps.append(calls[start:])
    return steps


class _Recorded(list):
    """Every collective of one process group this process runs, as the stand-in records them: the
    all-reduce's tensor and the all-gather's input. The group is set once the engine has made it
    (the control group's host messages are not device collectives)."""

    group: dist.ProcessGroup | None = None


def _recorded(monkeypatch) -> _Recorded:
    calls = _Recorded()
    all_reduce, all_gather = dist.all_reduce, dist.all_gather

    def recorded_all_reduce(tensor, *args, group=None, **kwargs):
        if group is not None and group is calls.group:
            calls.append(CollectiveCall("all_reduce", tuple(tensor.shape), tensor.dtype))
        return all_reduce(tensor, *args, group=group, **kwargs)

    def recorded_all_gather(outputs, tensor, *args, group=None, **kwargs):
        if group is not None and group is calls.group:
            calls.append(CollectiveCall("all_gather", tuple(tensor.shape), tensor.dtype))
        return all_gather(outputs, tensor, *args, group=group, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", recorded_all_reduce)
    monkeypatch.setattr(dist, "all_gather", recorded_all_gather)
    return calls


def _tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return dict(sorted([*model.named_parameters(), *model.named_buffers()]))


# Each tensor-parallel size and each kind of step once, not every pair: the ranks' tensors and layouts
# depend on the size alone (the draft's own weights are not split), the steps' collectives on the kind
# of step, the size changing only their shapes (the drafts go through the target's vocabulary-split
# head, as sampling does), which each case compares. A real engine's other ranks are processes of their
# own (`pooled_ranks`).
@pytest.mark.usefixtures("pooled_ranks")
@pytest.mark.parametrize(("tp", "spec"), [(2, PLAIN), (4, DFLASH)], ids=["decode-tp2", "verify-tp4"])
def test_a_rank_engine_is_a_real_engines_rank(tp, spec, monkeypatch):
    calls = _recorded(monkeypatch)
    config = _config(tp, spec)
    real = Engine(config, ranks=start(config))
    calls.group = real.model.parallel.group
    try:
        real_steps = _step_calls(real, calls)
        real_tensors = _tensors(real.model)
        layouts = [r["weights_shard"] for r in real.memory_report["ranks"]]
        real_bytes = [r["weights_bytes"] for r in real.memory_report["ranks"]]
        model_config = real.model.config  # `close` gives back the model and proposer
        block = real.proposer.verify_shape.block if spec else 1
    finally:
        real.close()
    assert len(set(layouts)) > 1  # the ranks hold different vocabulary rows and experts
    for rank in range(tp):
        engine = rank_engine(_config(tp, spec), rank)
        try:
            report = engine.memory_report
            assert (report["weights_shard"], report["weights_bytes"]) == (layouts[rank], real_bytes[rank])
            if rank == 0:  # in this process: the values too (the same seeded draws into the same shards)
                tensors = _tensors(engine.model)
                assert tensors.keys() == real_tensors.keys()
                for name, tensor in tensors.items():
                    assert torch.equal(tensor, real_tensors[name]), name
                steps = _step_calls(engine, engine.model.parallel.stand_in.calls)
                assert [len(s) for s in steps] == [len(s) for s in real_steps]
                assert steps == real_steps
        finally:
            engine.close()
    # the steps compared are what they say: one all-reduce of the step's tokens per block and an
    # all-gather of the sampled rows' logits (a verify step's rows: each request's whole block)
    hidden = model_config.hidden_size
    step = real_steps[1]
    kinds = [c.kind for c in step]
    rows = len(PROMPTS) * block
    assert CollectiveCall("all_reduce", (rows, hidden), torch.float32) in step
    assert kinds.count("all_reduce") >= 1 + 2 * model_config.num_hidden_layers
    assert "all_gather" in kinds
