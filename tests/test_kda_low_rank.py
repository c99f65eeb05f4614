"""A KDA decode step whose gate f and output-norm gate come as `LowRank` factors (the layer's f_a, g_a and
its f_b, g_b projections), multiplied inside the step kernel and the output norm, against the reference
(`reference.decode`, which multiplies them out first), under the Triton interpreter.

Errors are rms(out - ref) / rms(ref), as in test_kda_kernels.py: fp32 factors (weights in fp32, or e4m3
with block scales, widened exactly to fp32 on both sides) differ from the reference only in the order of
fp32 sums: ≤ 3e-6. fp16 factors: the product is rounded to fp16 on both sides from sums that differ in
their last fp32 bits, so a few gate entries differ by one fp16 step (2^-11 relative), which moves o by
far less than the 5e-3 bound FLA uses for half precision.
"""

from __future__ import annotations

from pathlib import Path

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops.fp8 import quantize_fp8_blocks  # noqa: E402
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, recurrent, reference  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.usefixtures("strict_launch_arguments"),
]

RATIO = 3e-6
RATIO_HALF = 5e-3


def err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt().clamp_min(1e-12)).item()


class DecodeState:
    """What a KDA decode step of `batch` sequences (slots 5, 0, 3) of a layer of `h` heads of size d runs on
    beside its inputs: the layer's parameters, its conv and state pools and the output norm's weight;
    `randn` draws in `dtype` from the seeded generator."""

    def __init__(self, seed: int, dtype, h: int, d: int, batch: int):
        gen = torch.Generator().manual_seed(seed)
        self.randn = lambda *shape, dtype=dtype: torch.randn(*shape, generator=gen).to(dtype)
        self.h, self.d, self.batch = h, d, batch
        hd = h * d
        self.params = KDAParams(
            self.randn(3 * hd, 4, dtype=torch.float32) * 0.5,
            self.randn(hd, dtype=torch.float32),
            self.randn(h, dtype=torch.float32) * 0.5,
            -5.0,
        )
        self.conv_pool = self.randn(7, 3, 3 * hd)
        self.state_pool = self.randn(7, h, d, d, dtype=torch.float32) * 0.3
        self.norm_weight = self.randn(d)

    def step(self, decode, x: KDAInputs, gate) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(o, conv pool, state pool) after `decode` of inputs `x` with the norm's `gate`, on copies of
        the pools."""
        slots = KDASlots(
            self.conv_pool.clone(), self.state_pool.clone(), torch.tensor([5, 0, 3][: self.batch])
        )
        o = decode(x, self.params, slots, OutputNorm(gate, self.norm_weight, 1e-5))
        return o, slots.conv_pool, slots.state_pool


class Step(DecodeState):
    """A decode step whose gate and norm gate are rank-`rank` factors; `fp8`: the projections e4m3 with
    block scales (N = h·d spans several 128-row blocks when h·d > 128)."""

    def __init__(self, seed: int, dtype, fp8: bool, h: int = 3, d: int = 64, rank: int = 48, batch: int = 3):
        super().__init__(seed, dtype, h, d, batch)
        hd = h * d
        qkvb = self.randn(batch, 3 * hd + h)
        self.q, self.k, self.v, self.b = qkvb.split([hd] * 3 + [h], dim=-1)
        # f_a | g_a of one projection, as the layer's in_proj gives them: views with its row stride
        self.f_a, self.g_a = self.randn(batch, 2 * rank).split([rank, rank], dim=-1)
        self.f = self.factor(self.f_a, fp8, scale=rank**-0.5)
        self.gate = self.factor(self.g_a, fp8, scale=rank**-0.5)

    def factor(self, a: torch.Tensor, fp8: bool, scale: float) -> LowRank:
        weight = self.randn(self.h * self.d, a.shape[1], dtype=torch.float32) * scale
        if fp8:
            return LowRank(a, *quantize_fp8_blocks(weight))
        return LowRank(a, weight.to(a.dtype))

    def run(self, decode, dense: bool):
        """(o, conv pool, state pool) after `decode` of this step, with the factors multiplied out first
        when `dense`."""
        f, gate = (self.f.dense(), self.gate.dense().view(self.batch, self.h, self.d)) if dense else (
            self.f, self.gate)  # fmt: skip
        return self.step(decode, KDAInputs(self.q, self.k, self.v, f, self.b), gate)


@pytest.mark.parametrize(
    ("dtype", "fp8", "h", "d", "batch", "bound"),
    [
        # rank 48: one full and one masked inner step of 32 columns; two value tiles of 16 per head
        (torch.float32, False, 3, 32, 3, RATIO),
        # 192 rows: two scale blocks along N (head 2 in the second); four value tiles per head; one sequence
        # (a row's scales are the same for every sequence, whose rows the other cases index)
        (torch.float32, True, 3, 64, 1, RATIO),
        (torch.float16, False, 2, 32, 3, RATIO_HALF),
    ],
)
def test_low_rank_decode_matches_reference(dtype, fp8, h, d, batch, bound):
    """The interpreter runs the step's batch x heads x value tiles programs one by one: each case keeps the
    fewest that still hold what it checks (several heads and value tiles in every case)."""
    step = Step(11 + h, dtype, fp8, h=h, d=d, batch=batch)
    o_ref, conv_ref, state_ref = step.run(reference.decode, dense=False)
    o, conv, state = step.run(recurrent.decode, dense=False)
    assert err(o, o_ref) < bound
    assert err(state, state_ref) < bound
    assert torch.equal(conv, conv_ref)  # the windows are copies
    # the factors multiplied out before the kernels give the same step
    o_dense, _, _ = step.run(recurrent.decode, dense=True)
    assert err(o, o_dense) < bound


def test_low_rank_decode_uses_each_head_rows():
    """Rows of the projections swapped between heads change only those heads' outputs: each program
    reads its own head's rows of f_b and g_b (a kernel reading head 0's rows for all would pass a test
    whose heads happened to share weights)."""
    step = Step(5, torch.float32, False, d=32, batch=2)
    o, _, _ = step.run(recurrent.decode, dense=False)
    d = step.d
    w = step.gate.weight.clone()
    w[:d], w[d : 2 * d] = step.gate.weight[d : 2 * d], step.gate.weight[:d]
    step.gate = LowRank(step.gate.a, w)
    swapped, _, _ = step.run(recurrent.decode, dense=False)
    assert torch.equal(swapped[:, 2], o[:, 2])
    assert not torch.allclose(swapped[:, :2], o[:, :2])
    o_ref, _, _ = step.run(reference.decode, dense=False)
    assert err(swapped, o_ref) < RATIO


def test_low_rank_decode_is_two_launches(monkeypatch):
    from triton.runtime.interpreter import InterpretedFunction

    names, run = [], InterpretedFunction.run

    def counted(self, *args, **kwargs):
        names.append(self.fn.__name__)
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", counted)
    Step(1, torch.float32, True, d=32, batch=1).run(recurrent.decode, dense=False)
    assert names == ["_recurrent_kernel", "_gated_norm_kernel"]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda f: LowRank(f.a, f.weight[:-1]), r"weight must be a contiguous \[192, 48\]"),
        (lambda f: LowRank(f.a, f.weight.half()), "unscaled weight must be a's dtype"),
        (lambda f: LowRank(f.a, f.weight, torch.ones(1, 1)), "scaled weight must be float8_e4m3fn"),
    ],
)
def test_low_rank_decode_refuses_factors_that_do_not_fit(change, message):
    step = Step(2, torch.float32, False)
    step.f = change(step.f)
    with pytest.raises(ValueError, match=message):
        step.run(recurrent.decode, dense=False)


def test_low_rank_gate_outside_decode_is_refused():
    step = Step(3, torch.float32, False)
    x = KDAInputs(*(t[:, None] for t in (step.q, step.k, step.v)), step.f, step.b[:, None])
    slots = KDASlots(step.conv_pool, step.state_pool, torch.tensor([5, 0, 3]))
    qkv = torch.cat([step.q, step.k, step.v], dim=-1)[:, None]  # stands in for the conv output
    with pytest.raises(ValueError, match="decode launch only"):
        recurrent.recurrent(qkv, x, step.params, slots)


_LOW_RANK_COMPILE = f"""
import sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[1] / "benchmarks" / "kernels")!r})
import torch
from code_size import compiled_launches
from hylo.ops.kda import KDAInputs, KDAParams, KDASlots, LowRank, OutputNorm, recurrent

h, d, hidden, bf16 = 8, 128, 4096, torch.bfloat16


def factor():
    weight = torch.zeros(h * d, d, dtype=torch.float8_e4m3fn)
    return LowRank(torch.zeros(1, d, dtype=bf16), weight, torch.ones(h, 1))


q, k, v = torch.zeros(1, 3 * h * d, dtype=bf16).split(h * d, dim=-1)
params = KDAParams(torch.zeros(3 * h * d, 4), torch.zeros(h * d), torch.zeros(h), -5.0)
pools = torch.zeros(2, 3, 3 * h * d, dtype=bf16), torch.zeros(2, h, d, d)
slots = KDASlots(*pools, torch.zeros(1, dtype=torch.int32))
norm = OutputNorm(factor(), torch.ones(d, dtype=bf16), 1e-5)
# b dense, then b from the layer input and b_proj's bf16 rows (an FP8 checkpoint's) at the real hidden size
rows_b = LowRank(torch.zeros(1, hidden, dtype=bf16), torch.zeros(h, hidden, dtype=bf16))
for b in (torch.zeros(1, h, dtype=bf16), rows_b):
    x = KDAInputs(q, k, v, factor(), b)
    launches = compiled_launches(lambda: recurrent.decode(x, params, slots, norm, block_v=16, num_warps=4))
    print(" ".join(launch["kernel"] for launch in launches if launch["instructions"] > 0))
"""


def test_low_rank_decode_launches_compile_for_hopper():
    """Both launches with FP8 factors at the real head size, the step's also with b's factors at the real
    hidden size, compile for sm_90 (no GPU needed)."""
    assert (
        run_compiled_for_hopper(_LOW_RANK_COMPILE).splitlines()
        == ["_recurrent_kernel _gated_norm_kernel"] * 2
    )


def test_many_head_rows_multiply_the_factors_out_first(monkeypatch):
    """Beyond `LOW_RANK_MAX_HEAD_ROWS` (sequence, head) pairs the step takes the projections' products
    (`ops.gemm.linear`, here the CPU's torch) and the kernels read them dense: the same step."""
    monkeypatch.setattr(recurrent, "LOW_RANK_MAX_HEAD_ROWS", 3)  # 2 sequences x 2 heads = 4 > 3
    step = Step(8, torch.float32, True, h=2, d=32, batch=2)
    o_ref, conv_ref, state_ref = step.run(reference.decode, dense=False)
    o, conv, state = step.run(recurrent.decode, dense=False)
    assert err(o, o_ref) < RATIO and err(state, state_ref) < RATIO and torch.equal(conv, conv_ref)
    from triton.runtime.interpreter import InterpretedFunction

    seen, run = [], InterpretedFunction.run

    def recorded(self, *args, **kwargs):
        seen.append((self.fn.__name__, kwargs.get("F_RANK", kwargs.get("G_RANK"))))
        return run(self, *args, **kwargs)

    monkeypatch.setattr(InterpretedFunction, "run", recorded)
    step.run(recurrent.decode, dense=False)
    assert seen == [("_recurrent_kernel", 0), ("_gated_norm_kernel", 0)]  # both read dense gates
