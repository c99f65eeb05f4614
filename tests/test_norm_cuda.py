"""The Triton RMSNorm on the GPU at GLM-5.3-Flash's widths, in bf16, against the torch reference: the
fp32 statistics summed in another order may move the normalised row by one bf16 ulp, and the weight's
product by one more."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.norm import NormRows, cat_refusal, kernels, reference, refusal, rms_norm, rms_norm_cat

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernel runs on a GPU")


@pytest.mark.parametrize("width", [128, 512, 1536, 4096])
@pytest.mark.parametrize("rows", [1, 8, 13312])
def test_bf16_kernel_matches_the_reference(width, rows):
    gen = torch.Generator(device="cuda").manual_seed(width + rows)
    x = (torch.randn(rows, width, generator=gen, device="cuda") * 4).bfloat16()
    weight = (1 + 0.1 * torch.randn(width, generator=gen, device="cuda")).bfloat16()
    assert refusal(x, weight) is None
    out, ref = kernels.rms_norm(x, weight, 1e-6), reference.rms_norm(x, weight, 1e-6)
    spacing = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert out.dtype == ref.dtype and float(((out.float() - ref.float()).abs() / spacing).max()) <= 2
    with torch.inference_mode():
        assert torch.equal(rms_norm(x, weight, 1e-6), out)  # the dispatcher takes the kernel


@pytest.mark.parametrize("rows", [1, 4, 64])
def test_bf16_cat_kernel_matches_the_reference(rows):
    """An MTP layer's enorm and hnorm side by side at hidden 4096: each half within the same two ulps."""
    gen = torch.Generator(device="cuda").manual_seed(rows)
    first, second = (
        NormRows((torch.randn(rows, 4096, generator=gen, device="cuda") * 4).bfloat16(),
                 (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).bfloat16(), 1e-5)
        for _ in range(2)
    )  # fmt: skip
    assert cat_refusal(first, second) is None
    out, ref = kernels.rms_norm_cat(first, second), reference.rms_norm_cat(first, second)
    spacing = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert out.shape == ref.shape and float(((out.float() - ref.float()).abs() / spacing).max()) <= 2
    with torch.inference_mode():
        assert torch.equal(rms_norm_cat(first, second), out)  # the dispatcher takes the kernel


@pytest.mark.parametrize("rows", [8, 64])
def test_bf16_add_kernel_matches_the_reference(rows):
    """A DFlash draft layer's residual add and the next norm (hidden 4096): the sum equal, the normed row
    within the two ulps of `rms_norm`."""
    from hylo.ops.norm import add_refusal

    gen = torch.Generator(device="cuda").manual_seed(rows)
    x, delta = ((torch.randn(rows, 4096, generator=gen, device="cuda") * 4).bfloat16() for _ in range(2))
    weight = (1 + 0.1 * torch.randn(4096, generator=gen, device="cuda")).bfloat16()
    assert add_refusal(x, delta, weight) is None
    (total, out), (ref_total, ref) = (
        kernels.add_rms_norm(x, delta, weight, 1e-6),
        reference.add_rms_norm(x, delta, weight, 1e-6),
    )
    spacing = torch.finfo(torch.bfloat16).eps * ref.float().abs().clamp_min(1e-30)
    assert torch.equal(total, ref_total) and float(((out.float() - ref.float()).abs() / spacing).max()) <= 2
