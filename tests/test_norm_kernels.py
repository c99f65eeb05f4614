"""The Triton RMSNorm against its torch reference, under the Triton interpreter on the CPU (real shapes
and bf16 on the GPU: `tests/test_norm_cuda.py`)."""

from __future__ import annotations

from interpreter import use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.layers.norm import RMSNorm  # noqa: E402
from hylo.ops import norm  # noqa: E402
from hylo.ops.norm import NormRows, RowStore, cat_refusal, kernels, pair_refusal, reference, refusal  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the output dtype's last place at the reference's magnitude."""
    spacing = torch.finfo(ref.dtype).eps * ref.abs().double().clamp_min(torch.finfo(ref.dtype).tiny)
    return float(((out.double() - ref.double()).abs() / spacing).max())


DTYPES = [(torch.float32, torch.float32), (torch.float16, torch.float16), (torch.float16, torch.float32)]


@pytest.mark.parametrize("width", [16, 48, 128])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_kernel_matches_the_reference(width, dtype, weight_dtype):
    """fp32 statistics summed in another order move rsqrt by an ulp of fp32: the row rounded to
    fp16 then moves by at most one of its ulps, times the weight's rounding (two ulps in all)."""
    gen = torch.Generator().manual_seed(width)
    x = (torch.randn(5, 3, width, generator=gen) * 3).to(dtype)
    weight = torch.randn(width, generator=gen).to(weight_dtype)
    out, ref = kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert ulps(out, ref) <= (2 if dtype == torch.float16 else 8), (dtype, weight_dtype)


def test_kernel_reads_rows_of_a_wider_tensor_in_place():
    """A fused projection's output split by column views: rows strided by the full width."""
    gen = torch.Generator().manual_seed(1)
    fused = torch.randn(7, 96, generator=gen)
    view = fused[:, 32:80]
    weight = torch.randn(48, generator=gen)
    assert refusal(view, weight) is None
    torch.testing.assert_close(kernels.rms_norm(view, weight, 1e-5), reference.rms_norm(view, weight, 1e-5))
    assert kernels.rms_norm(fused[:0, :48], weight, 1e-5).shape == (0, 48)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 8).t(), torch.ones(4)), "unit last stride"),
        (lambda: (torch.randn(2, 4, 8)[:, :3], torch.ones(8)), "one row stride"),
        (lambda: (torch.randn(4, 8), torch.ones(4)), "as wide as"),
        (lambda: (torch.randn(4, 8).to(torch.int32), torch.ones(8)), "unsupported dtypes"),
        (lambda: (torch.randn(1, 32768), torch.ones(32768)), "rows up to 16384 wide"),
    ],
)
def test_refusal_names_why(make, reason):
    assert reason in refusal(*make())


def test_layer_keeps_the_reference_on_the_cpu_and_under_autograd():
    """The module dispatches: CPU tensors (and a call autograd records) take the reference."""
    norm = RMSNorm(32, 1e-6)
    norm.weight.data.normal_()
    x = torch.randn(3, 32, requires_grad=True)
    y = norm(x)
    y.sum().backward()
    assert torch.equal(y, reference.rms_norm(x, norm.weight, 1e-6)) and x.grad is not None


def pair_case(dtype, weight_dtype, seed, tokens=5, widths=(48, 16), slots=12):
    """Two row sets as column views of one fused product (as a DSA layer's q_a and kv_a), a cache of
    `slots` rows in the second norm's dtype holding other rows, and distinct slots to write."""
    gen = torch.Generator().manual_seed(seed)
    product = (torch.randn(tokens, sum(widths) + 8, generator=gen) * 3).to(dtype)
    x1, x2 = product[:, : widths[0]], product[:, widths[0] : widths[0] + widths[1]]
    first, second = (
        NormRows(x, torch.randn(x.shape[1], generator=gen).to(weight_dtype), 1e-5) for x in (x1, x2)
    )
    cache = torch.randn(slots, widths[1], generator=gen).to(torch.result_type(second.weight, x2))
    return first, second, RowStore(cache, torch.randperm(slots, generator=gen)[:tokens])


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_pair_kernel_matches_the_reference(dtype, weight_dtype):
    """Each row set as `rms_norm` (the same two ulps); the stored rows land in their slots only."""
    first, second, store = pair_case(dtype, weight_dtype, seed=3)
    assert pair_refusal(first, second, store) is None
    expect = RowStore(store.out.clone(), store.index)
    ref = reference.rms_norm_pair(first, second, expect)
    got = RowStore(store.out.clone(), store.index.int())
    out = kernels.rms_norm_pair(first, second, got)
    bound = 2 if dtype == torch.float16 else 8
    assert out.dtype == ref.dtype and out.shape == ref.shape and ulps(out, ref) <= bound
    written = torch.zeros(len(store.out), dtype=torch.bool)
    written[store.index] = True
    assert torch.equal(got.out[~written], store.out[~written])
    assert ulps(got.out[written], expect.out[written]) <= bound
    assert not torch.equal(expect.out[written], store.out[written])  # the case really writes rows


def test_pair_reference_is_two_norms_and_a_store():
    first, second, store = pair_case(torch.float32, torch.float32, seed=4)
    expect = store.out.clone()
    expect[store.index] = reference.rms_norm(second.x, second.weight, second.eps)
    out = reference.rms_norm_pair(first, second, store)
    assert torch.equal(out, reference.rms_norm(first.x, first.weight, first.eps)) and torch.equal(
        store.out, expect
    )


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda f, s, st: (NormRows(f.x[None], f.weight, 1e-5), s, st), "first rows must be [T, w]"),
        (lambda f, s, st: (f, NormRows(s.x, s.weight[:8], 1e-5), st), "second rows: weight must be"),
        (lambda f, s, st: (f, NormRows(s.x[:3], s.weight, 1e-5), st), "one row per token"),
        (lambda f, s, st: (f, s, RowStore(st.out, st.index.float())), "int32 or int64"),
        (lambda f, s, st: (f, s, RowStore(st.out[:, :8], st.index)), "[S, 16]"),
        (lambda f, s, st: (f, s, RowStore(st.out.half(), st.index)), "does not cast"),
    ],
)
def test_pair_refusal_names_why(change, reason):
    assert reason in pair_refusal(*change(*pair_case(torch.float32, torch.float32, seed=5)))


@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_cat_kernel_matches_the_reference(dtype, weight_dtype):
    """An MTP layer's enorm and hnorm side by side: each half as `rms_norm` (the same two ulps), the
    first rows strided views of a wider tensor, the halves of different widths (masked row tiles)."""
    first, second, _ = pair_case(dtype, weight_dtype, seed=6, widths=(48, 40))
    assert cat_refusal(first, second) is None
    out, ref = kernels.rms_norm_cat(first, second), reference.rms_norm_cat(first, second)
    assert out.dtype == ref.dtype and out.shape == ref.shape == (5, 88)
    assert ulps(out, ref) <= (2 if dtype == torch.float16 else 8)
    assert torch.equal(ref[:, 48:], reference.rms_norm(second.x, second.weight, second.eps))


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (lambda f, s: (NormRows(f.x[None], f.weight, 1e-5), s), "first rows must be [T, w]"),
        (lambda f, s: (f, NormRows(s.x[:3], s.weight, 1e-5)), "one row per token"),
        (lambda f, s: (f, NormRows(s.x, s.weight.double(), 1e-5)), "second rows: unsupported dtypes"),
        (lambda f, s: (f, NormRows(s.x.half(), s.weight.half(), 1e-5)), "one dtype"),
    ],
)
def test_cat_refusal_names_why(change, reason):
    first, second, _ = pair_case(torch.float32, torch.float32, seed=7)
    assert reason in cat_refusal(*change(first, second))


@pytest.mark.parametrize("width", [16, 100])
@pytest.mark.parametrize(("dtype", "weight_dtype"), DTYPES)
def test_add_kernel_matches_the_reference(width, dtype, weight_dtype):
    """The sum rounded once as torch's add rounds it (equal), then normalised as `rms_norm` normalises a
    row (its two ulps)."""
    gen = torch.Generator().manual_seed(width + 1)
    x, delta = ((torch.randn(2, 3, width, generator=gen) * 3).to(dtype) for _ in range(2))
    weight = torch.randn(width, generator=gen).to(weight_dtype)
    assert norm.add_refusal(x, delta, weight) is None
    (total, out), (ref_total, ref) = (
        kernels.add_rms_norm(x, delta, weight, 1e-6),
        reference.add_rms_norm(x, delta, weight, 1e-6),
    )
    assert torch.equal(total, ref_total) and total.dtype == dtype
    assert out.dtype == ref.dtype and ulps(out, ref) <= (2 if dtype == torch.float16 else 8)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda x: x.half(), "must match x"),
        (lambda x: x[:, :2], "must match x"),
        (lambda x: x.t().contiguous().t(), "must be contiguous"),
    ],
)
def test_add_refusal_names_why(make, reason):
    x = torch.randn(4, 16)
    assert reason in norm.add_refusal(x, make(torch.randn(4, 16)), torch.ones(16))


def test_add_dispatch_takes_the_kernel_unless_autograd_records(monkeypatch):
    calls = []
    monkeypatch.setattr(norm, "use_kernel", lambda op, t, verify: verify() is None)
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: calls.append(a) or reference.add_rms_norm(*a))
    x, delta, weight = torch.randn(3, 16), torch.randn(3, 16), torch.ones(16)
    norm.add_rms_norm(x, delta, weight, 1e-6)
    assert len(calls) == 1
    weight.requires_grad_(True)
    _, out = norm.add_rms_norm(x, delta, weight, 1e-6)
    out.sum().backward()
    assert len(calls) == 1 and weight.grad is not None
