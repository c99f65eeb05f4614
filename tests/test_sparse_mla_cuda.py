"""The CUDA sparse MLA prefill (`cuda_prefill`, Hopper) against a float64 attention of the same bf16 operands
and against the Triton kernel, at GLM-5.3-Flash's shapes (64 heads, rank 512, lists of 2112 rows of which
up to 2051 real) and at odd ones (several head blocks, short and empty lists, widths that are not a multiple
of the key block). Run on its own process (the interpreter test modules switch Triton to the interpreter
for the whole process)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.sparse_mla import cuda_prefill, kernels, sparse_mla

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the CUDA sparse MLA prefill is built for Hopper (sm_90a)")

RANK, SCALE = 512, 256**-0.5


def problem(tokens: int, heads: int, slots: int, width: int, real: int, seed: int):
    """Queries, a latent cache and per-token row lists: token t has min(t + 1, real) distinct real rows
    first (as the indexer writes them), then -1."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(tokens, heads, RANK, generator=gen, device="cuda").bfloat16()
    latent = torch.randn(slots, RANK, generator=gen, device="cuda").bfloat16()
    rows = torch.full((tokens, width), -1, dtype=torch.int32, device="cuda")
    for t in range(tokens):
        count = min(t + 1, real)
        rows[t, :count] = torch.randperm(slots, generator=gen, device="cuda")[:count].int()
    return q, latent, rows


def check(out: torch.Tensor, q, latent, rows, scale: float) -> None:
    exact, bound = cuda_prefill.error_bound(q, latent, rows, scale)
    error = (out.double() - exact).abs()
    assert torch.isfinite(out).all()
    worst = float((error / bound.clamp(min=1e-30)).max())
    assert (error <= bound).all(), f"worst error {worst:.3g}x its bound"


def test_the_library_passes_its_self_check():
    assert cuda_prefill.device_refusal(torch.device("cuda")) is None


@pytest.mark.parametrize(
    ("tokens", "heads", "width", "real"),
    [(96, 64, 2112, 2051), (80, 128, 200, 150), (70, 64, 64, 64), (100, 64, 130, 1)],
)
def test_prefill_matches_the_exact_attention(tokens, heads, width, real):
    q, latent, rows = problem(tokens, heads, slots=4096, width=width, real=real, seed=tokens)
    out = cuda_prefill.prefill(q, latent, rows, SCALE)
    check(out, q, latent, rows, SCALE)


def test_late_tokens_of_a_long_prompt_with_full_lists():
    """The tokens of a 13K prompt past 2K: every list full (2051 real rows of 2112), the rows scattered
    over the whole cache, a sharper softmax."""
    gen = torch.Generator(device="cuda").manual_seed(7)
    tokens, slots = 128, 13312
    q = torch.randn(tokens, 64, RANK, generator=gen, device="cuda").bfloat16()
    latent = torch.randn(slots, RANK, generator=gen, device="cuda").bfloat16()
    rows = torch.full((tokens, 2112), -1, dtype=torch.int32, device="cuda")
    rows[:, :2051] = torch.rand(tokens, slots, generator=gen, device="cuda").argsort(1)[:, :2051].int()
    out = cuda_prefill.prefill(q, latent, rows, 2 * SCALE)
    check(out, q, latent, rows, 2 * SCALE)


def test_dispatch_takes_the_cuda_kernel_and_agrees_with_triton():
    q, latent, rows = problem(256, 64, slots=8192, width=2112, real=2051, seed=3)
    assert cuda_prefill.refusal(q, latent, rows) is None
    cuda_out = sparse_mla(q, latent, rows, SCALE)
    torch.testing.assert_close(cuda_out, cuda_prefill.prefill(q, latent, rows, SCALE), rtol=0, atol=0)
    triton_out = kernels.sparse_mla_prefill(q, latent, rows, SCALE, cuda=False)
    _, bound = cuda_prefill.error_bound(q, latent, rows, SCALE)
    # both within their roundings of the exact attention, so within the sum of the two bounds of each other
    assert ((cuda_out.double() - triton_out.double()).abs() <= 2 * bound).all()
    check(cuda_out, q, latent, rows, SCALE)


def test_operands_the_kernel_does_not_take_are_refused_with_a_reason():
    q, latent, rows = problem(4, 64, slots=64, width=64, real=8, seed=1)
    assert "int32" in cuda_prefill.operand_refusal(q, latent, rows.long())
    assert "heads" in cuda_prefill.operand_refusal(q[:, :32], latent, rows)
    assert "bf16" in cuda_prefill.operand_refusal(q.half(), latent.half(), rows)
    assert "rank" in cuda_prefill.operand_refusal(q[..., :256], latent[:, :256], rows)
