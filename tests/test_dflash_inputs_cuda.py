"""A DFlash step's index arithmetic (`ops.dflash_inputs`) on the GPU: the kernels equal the torch reference
at a verify step's sizes and at a long prompt's observe, launched as programmatic dependents where the GPU
has them, and the same from a CUDA graph replay."""

from __future__ import annotations

import pytest
import torch
from dflash_batches import committed_batch

from hylo.ops.dflash_inputs import CommittedTokens, kernels, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")


def on_gpu(committed: CommittedTokens) -> CommittedTokens:
    return CommittedTokens(*(t.cuda() for t in committed))


@pytest.mark.parametrize("lengths", [[8] * 8, [8] * 64, [13312, 5, 700]])
def test_committed_slots_equal_the_reference(lengths):
    committed = on_gpu(committed_batch(lengths, seed=len(lengths)))
    assert torch.equal(kernels.committed_slots(committed), reference.committed_slots(committed))


@pytest.mark.parametrize(("blocks", "width"), [(1, 8), (8, 8), (64, 16)])
def test_draft_blocks_equal_the_reference_and_replay_from_a_graph(blocks, width):
    committed = on_gpu(committed_batch([width] * blocks, seed=blocks))
    rows = torch.randperm(4 * blocks, device="cuda")[:blocks]
    anchors = torch.randint(0, 150_000, (blocks,), device="cuda")
    picked = torch.arange(blocks, device="cuda").flip(0)
    args = (committed, rows, picked, anchors, width, 154_879)
    want = reference.draft_blocks(*args)
    assert all(map(torch.equal, kernels.draft_blocks(*args), want))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.draft_blocks(*args)
    graph.replay()
    torch.cuda.synchronize()
    assert all(map(torch.equal, captured, want))
