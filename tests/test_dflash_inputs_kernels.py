"""A DFlash step's index arithmetic (`ops.dflash_inputs`): the Triton kernels against the torch reference
under the interpreter, their refusals, and the dispatcher's choice."""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from dflash_batches import committed_batch  # noqa: E402

from hylo.ops import dflash_inputs  # noqa: E402
from hylo.ops.dflash_inputs import kernels, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize("lengths", [[8], [8] * 5, [1, 700, 3, 900]])  # a verify block; several; 2 programs
def test_committed_slots_match_the_reference(lengths, index_dtype):
    committed = committed_batch(lengths, seed=len(lengths), index_dtype=index_dtype)
    assert dflash_inputs.slots_refusal(committed) is None
    got, want = kernels.committed_slots(committed), reference.committed_slots(committed)
    assert got.dtype == want.dtype and torch.equal(got, want)
    assert (want == -1).any() and (want != -1).any()  # some tokens past their count, some within


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
@pytest.mark.parametrize(("sampling", "width"), [([0], 8), ([3, 0, 17, 5], 16), (list(range(20)), 3)])
def test_draft_blocks_match_the_reference(sampling, width, index_dtype):
    committed = committed_batch([4] * 20, seed=width, index_dtype=index_dtype)
    gen = torch.Generator().manual_seed(1)
    state_slots = torch.randperm(64, generator=gen)[:20].to(index_dtype)
    anchors = torch.randint(0, 150_000, (20,), generator=gen)
    picked = torch.tensor(sampling)
    args = (committed, state_slots, picked, anchors)
    assert dflash_inputs.blocks_refusal(*args) is None
    got, want = kernels.draft_blocks(*args, width, 154_879), reference.draft_blocks(*args, width, 154_879)
    for name, g, w in zip(reference.DraftBlocks._fields, got, want, strict=True):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_refusals_name_the_operand():
    committed = committed_batch([4, 4], seed=0)
    wide = committed._replace(pad_index=committed.pad_index.t())
    assert "pad_index must be [S, ·] with a unit last stride" in dflash_inputs.slots_refusal(wide)
    floats = committed._replace(new_slots=committed.new_slots.float())
    assert "new_slots must be int32 or int64" in dflash_inputs.slots_refusal(floats)
    short = committed._replace(positions=committed.positions[:-1])
    assert "one entry per packed token" in dflash_inputs.slots_refusal(short)
    slots, picked = torch.arange(2), torch.arange(2)
    assert "anchors must be int64" in dflash_inputs.blocks_refusal(
        committed, slots, picked, torch.zeros(2).int()
    )
    strided = torch.arange(4)[::2]
    assert "sampling must be a contiguous vector" in dflash_inputs.blocks_refusal(
        committed, slots, strided, torch.zeros(2, dtype=torch.int64)
    )


def test_the_dispatcher_takes_the_kernels_for_calls_they_accept(monkeypatch):
    """`use_kernel` as for CUDA tensors: each entry point runs its kernel once, and the reference for a
    call its refusal names."""
    calls = []
    monkeypatch.setattr(dflash_inputs, "use_kernel", lambda op, t, verify: verify() is None)
    for name in ("committed_slots", "draft_blocks"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    committed = committed_batch([8, 8], seed=3)
    slots = dflash_inputs.committed_slots(committed)
    pair = (committed, torch.arange(2), torch.arange(2), torch.arange(2), 8, 9)
    blocks = dflash_inputs.draft_blocks(*pair)
    assert calls == ["committed_slots", "draft_blocks"]
    assert torch.equal(slots, reference.committed_slots(committed))
    assert all(map(torch.equal, blocks, reference.draft_blocks(*pair)))
    dflash_inputs.committed_slots(committed._replace(counts=committed.counts.float()))
    assert calls == ["committed_slots", "draft_blocks"]  # refused: the reference ran


def test_the_demo_proposers_drafts_are_the_same_through_the_kernels(monkeypatch):
    """The demo's DFlash engine (its fixed-shape graph paths run uncaptured) drafts the same blocks, step by
    step, with `ops.dflash_inputs` dispatched to the kernels (a prompt's observe and each verify step's) as
    with the reference."""
    from hylo.config import EngineConfig
    from hylo.engine.engine import Engine
    from hylo.models.demo import default_model_dir
    from hylo.ops import dispatch
    from hylo.sampling import SamplingParams

    def drafts(use_kernel) -> list[torch.Tensor]:
        monkeypatch.setattr(dflash_inputs, "use_kernel", use_kernel)
        model = default_model_dir()
        config = EngineConfig.from_kwargs(
            model=str(model), device="cpu", dtype="float32", speculative_algorithm="DFLASH",
            speculative_draft_model_path=str(model / "dflash"), speculative_adaptive=False,
        )  # fmt: skip
        engine = Engine(config, decode_graphs=True)
        for i, n in enumerate((40, 23)):
            prompt = torch.randint(2, 8000, (n,), generator=torch.Generator().manual_seed(i)).tolist()
            engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        seen = []
        while engine.has_unfinished():
            engine.step()
            seen.append(engine.proposer.drafts.clone())
        engine.close()
        return seen

    calls = []
    for name in ("committed_slots", "draft_blocks"):
        real = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *a, real=real, name=name: calls.append(name) or real(*a))
    reference_drafts = drafts(dispatch.use_kernel)
    assert calls == []
    kernel_drafts = drafts(lambda op, t, verify: verify() is None)
    # every step observes; each step that drafts (not a prompt's chunk before its last) proposes
    assert calls.count("committed_slots") >= calls.count("draft_blocks") > 2
    assert all(map(torch.equal, kernel_drafts, reference_drafts))
    assert any(d.any() for d in reference_drafts)
