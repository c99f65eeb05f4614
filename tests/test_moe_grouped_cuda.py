"""The CUDA grouped FP8 GEMMs of the MoE prefill (`grouped_cuda`, Hopper) against the Triton TMA kernels
on the same operands and against the torch reference: pairs of blocks of one expert and of two, a pair
whose second block is past the real count, padding rows, experts nobody chose. Run on its own process (the
interpreter test modules switch Triton to the interpreter for the whole process)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops import dispatch
from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.fp8.kernels import quantize_groups
from hylo.ops.moe import grouped_cuda, kernels, reference
from hylo.ops.moe.reference import Choices, ExpertWeights
from hylo.ops.moe.routing import align

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9
pytestmark = pytest.mark.skipif(not HOPPER, reason="the CUDA grouped GEMMs are built for Hopper (sm_90a)")

EXPERTS, TOP_K, HIDDEN, INTER, LIMIT = 16, 4, 512, 384, 7.0


@pytest.fixture(scope="module")
def weights():
    gen = torch.Generator(device="cuda").manual_seed(0)
    gate_up = (
        torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen, device="cuda") * HIDDEN**-0.5
    ).bfloat16()
    down = (torch.randn(EXPERTS, HIDDEN, INTER, generator=gen, device="cuda") * INTER**-0.5).bfloat16()
    return (*quantize_fp8_blocks(gate_up.bfloat16()), *quantize_fp8_blocks(down.bfloat16()))


def routed_ids(tokens: int, gen: torch.Generator) -> torch.Tensor:
    """Top-k experts of each token, skewed so that some experts hold many blocks, some one, some none."""
    logits = torch.randn(tokens, EXPERTS, generator=gen, device="cuda")
    logits[:, :3] += 2.0  # three busy experts: several blocks each, pairs of one expert
    logits[:, -2:] = -1e9  # two experts nobody chooses
    return logits.topk(TOP_K, dim=1).indices.int()


@pytest.mark.parametrize("tokens", [1, 37, 300, 1000])
def test_grouped_gemms_match_triton_and_reference(weights, tokens, monkeypatch):
    gq, gs, dq, ds = weights
    gen = torch.Generator(device="cuda").manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").bfloat16()
    ids = routed_ids(tokens, gen)
    pair_weights = torch.rand(tokens, TOP_K, generator=gen, device="cuda").softmax(1)
    # the prefill configuration (64-row blocks, TMA) at every token count: one pair past decode sizes
    config = kernels.default_config(16 * EXPERTS + 1, EXPERTS, True)
    assert config.tma and config.block_m == grouped_cuda.BLOCK_M
    xq, x_scale = quantize_groups(x)
    layout = align(ids, EXPERTS, config.block_m)
    assert grouped_cuda.refusal(xq, gq, gs, layout) is None
    valid = layout.block_rows.repeat_interleave(64) > torch.arange(64, device="cuda").repeat(
        layout.block_rows.numel()
    )

    monkeypatch.setenv(grouped_cuda.SWITCH, "0")  # the stages run the Triton TMA kernels
    h_t, h_scale_t = kernels.gate_up_stage(xq, x_scale, gq, gs, layout, TOP_K, LIMIT, config)
    xg, xg_scale = kernels.gather_rows(xq, x_scale, layout, TOP_K)
    h_c, h_scale_c = grouped_cuda.gate_up(xg, xg_scale, gq, gs, layout, LIMIT)
    # the same products summed in the same order; SiLU's exp may differ in its last bit, which can move an
    # h element to its e4m3 neighbour (one step: 2^-3 of its value at most) and a group's scale by an ulp
    dequant_t = h_t[valid].float() * h_scale_t[valid].repeat_interleave(128, 1)
    dequant_c = h_c[valid].float() * h_scale_c[valid].repeat_interleave(128, 1)
    step = dequant_t.abs().amax(1, keepdim=True) / 8
    assert ((dequant_c - dequant_t).abs() <= step).all()
    assert (h_c[valid].view(torch.uint8) == h_t[valid].view(torch.uint8)).float().mean() > 0.99

    flat = pair_weights.reshape(-1).float().contiguous()
    routed_t = torch.zeros(tokens * TOP_K, HIDDEN, dtype=torch.bfloat16, device="cuda")
    routed_c = torch.zeros_like(routed_t)
    kernels._down_tma(h_t, h_scale_t, dq, ds, layout, flat, routed_t, config)
    monkeypatch.delenv(grouped_cuda.SWITCH)
    grouped_cuda.down(h_t, h_scale_t, dq, ds, layout, flat, routed_c)
    # one h, the same sums: within a bf16 rounding of the output (fp32 FMA contraction may differ)
    assert torch.allclose(routed_c.float(), routed_t.float(), rtol=2**-7, atol=1e-6 * routed_t.abs().max())
    # with the switch on, the TMA configuration's down stage is the CUDA kernel from its K threshold on
    calls = []
    monkeypatch.setattr(grouped_cuda, "down", lambda *a, **k: calls.append(a[0].shape))
    kernels._down_tma(h_t, h_scale_t, dq, ds, layout, flat, routed_t, config)
    assert calls == [] and INTER < kernels.CUDA_DOWN_MIN_K
    monkeypatch.setattr(kernels, "CUDA_DOWN_MIN_K", INTER)
    kernels._down_tma(h_t, h_scale_t, dq, ds, layout, flat, routed_t, config)
    monkeypatch.undo()
    assert calls == [h_t.shape]

    # the whole step with the CUDA gate|up dispatched, against the reference's bf16 activations: x and h
    # rounded to e4m3 (up to 2^-4 of each element) move the output by ~4% (relative L2) on either path, so
    # the CUDA path is held to the Triton path's own error, within the h elements they round apart
    experts, choices = ExpertWeights(gq, dq, (gs, ds)), Choices(ids, pair_weights)
    ref = reference.experts(x, experts, choices, LIMIT).double()
    out = kernels.experts(x, experts, choices, LIMIT, config)
    monkeypatch.setenv(grouped_cuda.SWITCH, "0")
    out_t = kernels.experts(x, experts, choices, LIMIT, config)
    error, error_t = (float((o.double() - ref).norm() / ref.norm()) for o in (out, out_t))
    assert error < 2**-3 and error <= 1.05 * error_t
    assert ("moe.grouped_cuda", grouped_cuda.SWITCH + "=0") in dispatch.refusals()  # Triton ran above


def test_refusal_names_the_operand(weights):
    gq, gs, _, _ = weights
    ids = torch.zeros(4, TOP_K, dtype=torch.int32, device="cuda")
    layout16 = align(ids, EXPERTS, 16)
    xq = torch.zeros(64, HIDDEN, dtype=torch.float8_e4m3fn, device="cuda")
    assert "64" in grouped_cuda.refusal(xq, gq, gs, layout16)
    assert "e4m3" in grouped_cuda.refusal(xq.bfloat16(), gq, gs, align(ids, EXPERTS, 64))
