"""The KDA decode step with `LowRank` gates on the GPU, in bf16 at GLM-5.3-Flash's head shape (d = r = 128):
against the same step fed the products `ops.gemm.linear` computes (cuBLAS or the FP8 GEMV, as the layer
computed them before), and captured in a CUDA graph whose replay equals the eager call bit for bit.

Both sides round the gate products to bf16 from fp32 sums in different orders, so a few gate entries
differ by one bf16 step (2^-8 relative); the step's output then differs by far less than the 5e-3
rms ratio FLA uses for half precision (the interpreter test, tests/test_kda_low_rank.py, checks the
arithmetic itself against the reference to fp32 rounding)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.gemm import linear
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

RATIO_HALF = 5e-3
HEADS, D = 8, 128  # a TP8 rank's heads of GLM-5.3-Flash


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


def case(batch: int, fp8: bool, seed: int = 0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

    hd = HEADS * D
    params = KDAParams(randn(3 * hd, 4, scale=0.5, dtype=torch.float32), randn(hd, dtype=torch.float32),
                       randn(HEADS, scale=0.5, dtype=torch.float32), -5.0)  # fmt: skip
    pools = (randn(batch + 3, 3, 3 * hd), randn(batch + 3, HEADS, D, D, scale=0.3, dtype=torch.float32))
    q, k, v, b = randn(batch, 3 * hd + HEADS).split([hd] * 3 + [HEADS], dim=-1)
    f_a, g_a = randn(batch, 2 * D).split([D, D], dim=-1)

    def factor(a):
        weight = randn(hd, D, scale=D**-0.5, dtype=torch.float32)
        return LowRank(a, *quantize_fp8_blocks(weight)) if fp8 else LowRank(a, weight.bfloat16())

    f, gate = factor(f_a), factor(g_a)
    slots = torch.arange(batch, device="cuda") + 2
    return params, pools, (q, k, v, b), f, gate, slots


def step(params, pools, qkvb, f, gate, slots, norm_weight):
    q, k, v, b = qkvb
    fresh = KDASlots(pools[0].clone(), pools[1].clone(), slots)
    o = decode(KDAInputs(q, k, v, f, b), params, fresh, OutputNorm(gate, norm_weight, 1e-5))
    return o, fresh


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("batch", [1, 8])
def test_low_rank_decode_against_projected_gates_bf16(batch, fp8):
    params, pools, qkvb, f, gate, slots = case(batch, fp8)
    weight = torch.randn(D, device="cuda").bfloat16()
    o, fused = step(params, pools, qkvb, f, gate, slots, weight)
    f_dense = linear(f.a, f.weight, f.scale_inv)
    gate_dense = linear(gate.a, gate.weight, gate.scale_inv).view(batch, HEADS, D)
    o_ref, projected = step(params, pools, qkvb, f_dense, gate_dense, slots, weight)
    assert err(o, o_ref) < RATIO_HALF
    assert err(fused.state_pool, projected.state_pool) < RATIO_HALF
    assert torch.equal(fused.conv_pool, projected.conv_pool)


def test_low_rank_decode_graph_replay_is_the_eager_step():
    params, pools, qkvb, f, gate, slots = case(4, True, seed=3)
    weight = torch.randn(D, device="cuda").bfloat16()
    eager, _ = step(params, pools, qkvb, f, gate, slots, weight)
    live = KDASlots(pools[0].clone(), pools[1].clone(), slots)
    q, k, v, b = qkvb
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture, as the engine does
        decode(KDAInputs(q, k, v, f, b), params, KDASlots(*(p.clone() for p in pools), slots),
               OutputNorm(gate, weight, 1e-5))  # fmt: skip
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(KDAInputs(q, k, v, f, b), params, live, OutputNorm(gate, weight, 1e-5))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
