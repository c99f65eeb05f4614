"""The Triton RMSNorm on the GPU at GLM-5.3-Flash's widths, in bf16, against the torch reference: the
fp32 statistics summed in another order may move the normalised row by one bf16 ulp, and the weight's
product by one more."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.norm import kernels, reference, refusal, rms_norm

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
