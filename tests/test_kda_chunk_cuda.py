"""The chunked KDA prefill on the GPU in bf16 at GLM-5.3-Flash's head size (d = 128; 8 heads as a TP8
rank), against the fp32 reference: a varlen batch into random slots with sequences of one token, of fewer
tokens than the conv window, and of many chunks.

Every stored intermediate (w, u, q̄, k̄, A) and δ is rounded to bf16, so the output's error is a few bf16
steps: the bound is FLA's 5e-3 (its `chunk_kda` measures 4.5e-3 against the same reference at these
shapes, benchmarks/RESULTS.md). The bf16 products the launches take for bf16 activations (Gram, merge,
w/u) may add at most a quarter to the error of the tf32 products (measured: 4.4e-3 against 3.9e-3)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

HEADS, D, WIDTH, LOWER_BOUND = 8, 128, 4, -5.0
BOUND = 5e-3
TF32 = dict(gram_precision="tf32", merge_precision="tf32", output_precision="tf32")


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def test_bf16_prefill_matches_reference():
    from hylo.ops.kda import chunk  # here: a CPU run's interpreter tests must import the kernels first

    gen = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape, scale=1.0, dtype=torch.float32):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    hd = HEADS * D
    params = KDAParams(
        randn(3 * hd, WIDTH, scale=0.3), randn(hd, scale=0.5), randn(HEADS, scale=0.5), LOWER_BOUND
    )
    conv_pool = randn(8, WIDTH - 1, 3 * hd, dtype=torch.bfloat16)
    state_pool = randn(8, HEADS, D, D, scale=0.05)
    lens = [1500, 1, 3, 2600]
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    x = KDAInputs(
        *(randn(cu[-1], hd, dtype=torch.bfloat16) for _ in range(4)),
        randn(cu[-1], HEADS, dtype=torch.bfloat16),
    )
    slots = torch.tensor([5, 0, 7, 2], device="cuda")
    conv_ref, state_ref = conv_pool.clone(), state_pool.clone()
    o_ref = reference.prefill(x, params, KDASlots(conv_ref, state_ref, slots), None, cu)
    cu_dev = torch.tensor(cu, dtype=torch.int32, device="cuda")
    errors = {}
    for name, tuning in (("bf16", {}), ("tf32", TF32)):
        conv, state = conv_pool.clone(), state_pool.clone()
        o = chunk.prefill(x, params, KDASlots(conv, state, slots), cu_dev, cu, **tuning)
        assert torch.equal(conv, conv_ref)
        untouched = [1, 3, 4, 6]
        assert torch.equal(state[untouched], state_pool[untouched])
        errors[name] = err(o, o_ref), err(state[slots], state_ref[slots])
    assert max(errors["bf16"]) < BOUND, errors
    assert errors["bf16"][0] < 1.25 * errors["tf32"][0], errors
