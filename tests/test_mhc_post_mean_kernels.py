"""mHC's `mhc_post_mean` kernel (the last block's post and the streams' mean in one launch) under the
Triton interpreter on the CPU: the mean of the streams `mhc_post`'s kernel stores, bit for bit (fp32
and fp16; the interpreter's bf16 casts truncate, see test_mhc_kernels), and the reference's within
the post's rounding."""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

import hylo.ops.mhc as mhc_ops  # noqa: E402
from hylo.ops.mhc import kernels, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def post_case(tokens: int, hidden: int, seed: int, dtype: torch.dtype):
    g = torch.Generator().manual_seed(seed)
    streams = torch.randn(tokens, 4, hidden, generator=g).to(dtype)
    out = torch.randn(tokens, hidden, generator=g).to(dtype)
    return out, streams, 2 * torch.rand(tokens, 4, generator=g), torch.rand(tokens, 4, 4, generator=g)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("tokens", "hidden", "block_k"), [(1, 64, 64), (19, 96, 64), (5, 40, 16)])
def test_post_mean_is_the_mean_of_the_posted_streams(dtype, tokens, hidden, block_k):
    """Several token blocks and hidden tiles, hidden sizes the tiles do not divide; fp32 sums of four
    values in stream order, as torch's mean of the stored streams sums them on the CPU."""
    case = post_case(tokens, hidden, seed=tokens + hidden, dtype=dtype)
    got = kernels.mhc_post_mean(*case, block_k=block_k)
    posted = kernels.mhc_post(*case, block_k=block_k)
    assert got.dtype == dtype and got.shape == (tokens, hidden)
    assert torch.equal(got, posted.mean(dim=1))
    # against the reference: the post's streams differ by a rounding of each (the kernel rounds once)
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-3, "atol": 2e-3}
    torch.testing.assert_close(got, reference.mhc_post_mean(*case), **tol)


def test_the_dispatcher_sends_cuda_calls_to_the_kernel(monkeypatch):
    calls = []
    monkeypatch.setattr(mhc_ops, "_use_kernels", lambda op, streams, *_, **__: calls.append(op) or True)
    case = post_case(3, 64, seed=1, dtype=torch.float32)
    assert torch.equal(mhc_ops.mhc_post_mean(*case), kernels.mhc_post_mean(*case))
    assert calls == ["post_mean"]


@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_post_mean_of_chosen_tokens_reads_them_through_the_index(index_dtype):
    """`rows` (the tokens whose logits a step wants: repeated, out of order, fewer than the tokens and
    in more than one row block) gives the full mean's rows, bit for bit, in the index's order; the
    reference's too."""
    case = post_case(21, 40, seed=7, dtype=torch.float32)
    rows = torch.tensor([20, 3, 3, 0, 17, 9, 11, 2, 5, 14, 19, 1, 8, 6, 4, 13, 16, 20], dtype=index_dtype)
    full = kernels.mhc_post_mean(*case, block_k=16)
    got = kernels.mhc_post_mean(*case, rows, block_k=16)
    assert got.shape == (rows.shape[0], 40) and torch.equal(got, full[rows])
    assert torch.equal(reference.mhc_post_mean(*case, rows), reference.mhc_post_mean(*case)[rows])


def test_the_dispatcher_takes_a_one_dimensional_integer_index(monkeypatch):
    """A 1-D int index goes to the kernel with the call; a 2-D or float one is refused (by name)."""
    calls = []
    monkeypatch.setattr(mhc_ops, "_use_kernels", lambda op, streams, norm=None, rows=None: True)
    monkeypatch.setattr(kernels, "mhc_post_mean", lambda *a, **k: calls.append(a))
    case = post_case(3, 64, seed=1, dtype=torch.float32)
    rows = torch.tensor([0, 2])
    mhc_ops.mhc_post_mean(*case, rows)
    assert len(calls) == 1 and calls[0][4] is rows
    for bad in (rows[None], rows.float()):
        assert "rows must be a 1-D int32 or int64 index" in mhc_ops.rows_refusal(bad, case[1])
