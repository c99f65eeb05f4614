"""The fused small kernels of a decode step on the GPU, in bf16 at GLM-5.3-Flash's shapes, against the
torch references (bounds as in their interpreter tests: `test_activation_kernels`, `test_norm_kernels`,
`test_sparse_kernels`), and captured in a CUDA graph whose replay equals the eager call bit for bit;
the model's first streams and last post-mean (the launches around the layers)."""

from __future__ import annotations

import pytest
import torch

from hylo.layers.vocab import VocabEmbedding
from hylo.ops import activation, indexer, mhc, norm
from hylo.ops.activation import kernels as activation_kernels
from hylo.ops.activation import reference as activation_reference
from hylo.ops.indexer import reference as indexer_reference
from hylo.ops.norm import reference as norm_reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    spacing = torch.finfo(ref.dtype).eps * ref.float().abs().clamp_min(1e-30)
    return float(((out.float() - ref.float()).abs() / spacing).max())


def randn(*shape: int, seed: int, scale: float = 1.0) -> torch.Tensor:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return (torch.randn(*shape, generator=gen, device="cuda") * scale).bfloat16()


def replayed(call):
    """`call()`'s result from a CUDA graph replay (after a warm-up on a side stream, as the engine does)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        call()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    graph.replay()
    torch.cuda.synchronize()
    return out


# shared expert (2048 whole, 256 at TP8), dense MLP (12288 whole, 1536 at TP8)
@pytest.mark.parametrize("width", [256, 1536, 2048, 12288])
@pytest.mark.parametrize("rows", [1, 8, 4096])
def test_swiglu_clamp_bf16(width, rows):
    gate_up = randn(rows, 2 * width, seed=width + rows, scale=8.0)
    gate, up = gate_up[:, :width], gate_up[:, width:]
    out = activation.swiglu_clamp(gate, up, 10.0)
    assert ulps(out, activation_reference.swiglu_clamp(gate, up, 10.0)) <= 2
    assert torch.equal(out, activation_kernels.swiglu_clamp(gate, up, 10.0))  # the dispatcher took it
    assert torch.equal(replayed(lambda: activation.swiglu_clamp(gate, up, 10.0)), out)


@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_q_a_and_kv_a_norms_with_the_latent_store_bf16(tokens):
    """A DSA layer's in_proj product (q_a 1536 | kv_a 512 | indexer 128 + 32 + 128) and a latent cache."""
    product = randn(tokens, 1536 + 512 + 288, seed=tokens, scale=4.0)
    weights = [1 + 0.1 * randn(n, seed=n).float() for n in (1536, 512)]
    first = norm.NormRows(product[:, :1536], weights[0].bfloat16(), 1e-5)
    second = norm.NormRows(product[:, 1536:2048], weights[1].bfloat16(), 1e-5)
    slots = torch.randperm(2 * tokens, device="cuda")[:tokens]
    latent = randn(2 * tokens, 512, seed=7)
    expect = norm.RowStore(latent.clone(), slots)
    ref = norm_reference.rms_norm_pair(first, second, expect)
    got = norm.RowStore(latent.clone(), slots)
    assert norm.pair_refusal(first, second, got) is None
    out = norm.rms_norm_pair(first, second, got)
    assert ulps(out, ref) <= 2 and ulps(got.out, expect.out) <= 2
    replay = norm.RowStore(latent.clone(), slots)
    assert torch.equal(replayed(lambda: norm.rms_norm_pair(first, second, replay)), out)
    assert torch.equal(replay.out, got.out)


@pytest.mark.parametrize("tokens", [1, 8, 4096])
def test_indexer_store_tokens_bf16(tokens):
    """The key LayerNorm (d = 128) and the k-pool gate scores from the in_proj product's indexer columns
    (wk 128 | weights_proj 32 | compress gate 128) into the token caches."""
    product = randn(tokens, 2048 + 128 + 32 + 128, seed=tokens + 1, scale=3.0)
    key, gate_scores = product[:, 2048:2176], product[:, 2208:]
    k_norm = indexer.KeyNorm(1 + 0.1 * randn(128, seed=3), 0.1 * randn(128, seed=4), 1e-6)
    slots = torch.randperm(2 * tokens, device="cuda")[:tokens]
    caches = randn(2, 2 * tokens, 128, seed=5)
    expect = indexer.TokenKeys(caches[0].clone(), caches[1].clone())
    indexer_reference.store_tokens(key, gate_scores, k_norm, expect, slots)
    got = indexer.TokenKeys(caches[0].clone(), caches[1].clone())
    assert indexer.store_refusal(key, gate_scores, k_norm, got, slots) is None
    indexer.store_tokens(key, gate_scores, k_norm, got, slots)
    assert ulps(got.keys, expect.keys) <= 1 and torch.equal(got.gates, expect.gates)
    replay = indexer.TokenKeys(caches[0].clone(), caches[1].clone())
    replayed(lambda: indexer.store_tokens(key, gate_scores, k_norm, replay, slots))
    assert torch.equal(replay.keys, got.keys) and torch.equal(replay.gates, got.gates)


@pytest.mark.parametrize(("tokens", "rows"), [(8, [7, 0, 3]), (4096, [4095]), (16, list(range(16)))])
def test_post_mean_of_the_logits_tokens_bf16(tokens, rows):
    """The last block's post-mean of only the tokens whose logits a step wants (hidden 4096, bf16): the
    full mean's rows bit for bit, through the dispatcher (the index read inside the launch), replayed."""
    out, streams = randn(tokens, 4096, seed=tokens), randn(tokens, 4, 4096, seed=tokens + 1)
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    post = 2 * torch.rand(tokens, 4, generator=gen, device="cuda")
    comb = torch.rand(tokens, 4, 4, generator=gen, device="cuda")
    index = torch.tensor(rows, device="cuda")
    full = mhc.mhc_post_mean(out, streams, post, comb)
    got = mhc.mhc_post_mean(out, streams, post, comb, index)
    assert torch.equal(got, full[index])
    assert torch.equal(replayed(lambda: mhc.mhc_post_mean(out, streams, post, comb, index)), got)


def test_first_streams_are_the_embedding_repeated():
    """`VocabEmbedding.streams` on the GPU: one contiguous `[T, 4, hidden]` tensor, each copy the
    embedding of its token."""
    embedding = VocabEmbedding(1000, 4096).cuda().bfloat16()
    embedding.weight.data.copy_(randn(1000, 4096, seed=9))  # the layer leaves it uninitialised
    ids = torch.tensor([5, 999, 5, 0], device="cuda")
    streams = embedding.streams(ids, 4)
    assert streams.is_contiguous() and streams.shape == (4, 4, 4096)
    assert torch.equal(streams, embedding(ids)[:, None].expand(-1, 4, -1))
