"""The KDA decode step with β's logits as `LowRank(x, W_b)` on the GPU, in bf16 at GLM-5.3-Flash's shapes
(hidden 4096, d = 128; 8 heads as a TP8 rank, 64 as one GPU): against the same step fed `x @ W_bᵀ` as
`ops.gemm.linear` computes it (the GEMM the FP8 layer ran before), and captured in a CUDA graph whose
replay equals the eager call bit for bit.

Both sides round the logits to bf16 from fp32 sums in different orders, so a few differ by one bf16 step;
the bound is tests/test_kda_dense_beta.py's for bf16 (2^-6, derived there), which also checks the
arithmetic itself against the reference under the interpreter."""

from __future__ import annotations

import pytest
import torch

from hylo.ops.fp8 import quantize_fp8_blocks
from hylo.ops.gemm import linear
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, decode

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="the Triton kernels run on a GPU")

RATIO_BF16 = 2**-6
HIDDEN, D = 4096, 128


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()).item()


class Step:
    """A decode step of `batch` sequences of `heads` heads: FP8 low-rank f and norm gate, as the FP8 layer
    gives them, and b as the layer input and b_proj's bf16 rows."""

    def __init__(self, batch: int, heads: int, seed: int = 0):
        gen = torch.Generator(device="cuda").manual_seed(seed)

        def randn(*shape, scale=1.0, dtype=torch.bfloat16):
            return (torch.randn(*shape, generator=gen, device="cuda") * scale).to(dtype)

        hd = heads * D
        self.params = KDAParams(randn(3 * hd, 4, scale=0.5, dtype=torch.float32),
                                randn(hd, dtype=torch.float32), randn(heads, scale=0.5, dtype=torch.float32),
                                -5.0)  # fmt: skip
        self.pools = (
            randn(batch + 3, 3, 3 * hd),
            randn(batch + 3, heads, D, D, scale=0.3, dtype=torch.float32),
        )
        self.slots = torch.arange(batch, device="cuda") + 2
        self.q, self.k, self.v = randn(batch, 3 * hd).split([hd] * 3, dim=-1)
        f_a, g_a = randn(batch, 2 * D).split([D, D], dim=-1)
        self.f, self.gate = (
            LowRank(a, *quantize_fp8_blocks(randn(hd, D, scale=D**-0.5, dtype=torch.float32)))
            for a in (f_a, g_a)
        )
        self.b = LowRank(randn(batch, HIDDEN), randn(heads, HIDDEN, scale=HIDDEN**-0.5))
        self.norm_weight = randn(D)

    def inputs(self, b) -> KDAInputs:
        return KDAInputs(self.q, self.k, self.v, self.f, b)

    def run(self, b) -> tuple[torch.Tensor, KDASlots]:
        fresh = KDASlots(self.pools[0].clone(), self.pools[1].clone(), self.slots)
        o = decode(self.inputs(b), self.params, fresh, OutputNorm(self.gate, self.norm_weight, 1e-5))
        return o, fresh


# 8 x 64 (sequence, head) pairs are past LOW_RANK_MAX_HEAD_ROWS: b multiplied out by the same GEMM first
@pytest.mark.parametrize(("batch", "heads"), [(1, 8), (8, 8), (1, 64), (8, 64)])
def test_dense_beta_decode_against_the_projected_logits(batch, heads):
    step = Step(batch, heads)
    o, fused = step.run(step.b)
    o_ref, projected = step.run(linear(step.b.a, step.b.weight))
    assert err(o, o_ref) < RATIO_BF16
    assert err(fused.state_pool, projected.state_pool) < RATIO_BF16
    assert torch.equal(fused.conv_pool, projected.conv_pool)


def test_dense_beta_decode_graph_replay_is_the_eager_step():
    step = Step(4, 8, seed=3)
    eager, _ = step.run(step.b)
    live = KDASlots(step.pools[0].clone(), step.pools[1].clone(), step.slots)
    norm = OutputNorm(step.gate, step.norm_weight, 1e-5)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture, as the engine does
        warm = KDASlots(step.pools[0].clone(), step.pools[1].clone(), step.slots)
        decode(step.inputs(step.b), step.params, warm, norm)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = decode(step.inputs(step.b), step.params, live, norm)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
