"""`ops.topk.top_k` on the GPU (the Triton kernel) against its reference run on the GPU (a stable sort):
the same indices and value bits at DFlash2's serving shapes, and a CUDA-graph replay equal to the eager
call."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.topk import kernels, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on a GPU")


@pytest.mark.parametrize(("rows", "vocab"), [(7, 8192), (112, 8192), (7, 154880)])
@pytest.mark.parametrize("ties", [False, True])
def test_top_k_on_the_gpu_is_the_reference(rows, vocab, ties):
    gen = torch.Generator(device="cuda").manual_seed(rows + vocab)
    x = torch.randn(rows, vocab, generator=gen, device="cuda")
    x = ((x * 4).round() / 4 if ties else x).bfloat16()
    got = kernels.top_k(x, 8)
    want = reference.top_k(x, 8)
    assert torch.equal(got.indices, want.indices)
    assert torch.equal(got.values.view(torch.int16), want.values.view(torch.int16))


def test_top_k_graph_replay_is_the_eager_call():
    x = torch.randn(7, 8192, device="cuda").bfloat16()
    eager = kernels.top_k(x, 8)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = kernels.top_k(x, 8)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.indices, eager.indices) and torch.equal(captured.values, eager.values)
