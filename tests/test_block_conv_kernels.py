"""The Triton grouped block conv (DFlash2) against its torch reference, under the Triton interpreter on
the CPU, and the dispatch rule (training's gradients stay on the reference)."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops import block_conv  # noqa: E402
from hylo.ops.block_conv import kernels, reference, refusal  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def conv_case(blocks: int, rows: int, hidden: int, taps: int, group: int, dtype: torch.dtype, seed: int):
    """(x [R, B, H], base_kernel [taps, H], deltas [R, B, taps, G] as the draft slices them: a view of
    the projection's output for both sides)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(blocks, rows, hidden, generator=gen)
    base = torch.randn(taps, hidden, generator=gen)
    both_sides = torch.randn(blocks, rows, 2, taps, hidden // group, generator=gen)
    return x.to(dtype), base.to(dtype), both_sides.to(dtype)[..., 1, :, :]


# fp32: the taps' products summed in another order (~1 ulp of the sum); fp16: a product or the sum's
# rounding may then land one step of the dtype apart
TOL = {torch.float32: {"rtol": 1e-6, "atol": 1e-6}, torch.float16: {"rtol": 1e-3, "atol": 1e-3}}


@pytest.mark.parametrize(
    ("blocks", "rows", "hidden", "taps", "group"),
    [(2, 8, 64, 4, 16), (3, 2, 48, 4, 16), (1, 5, 32, 3, 8), (4, 1, 16, 2, 16)],  # B < taps; H not 2^n
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_equals_the_reference(blocks, rows, hidden, taps, group, dtype):
    x, base, deltas = conv_case(blocks, rows, hidden, taps, group, dtype, seed=blocks * rows + taps)
    assert refusal(x, base, deltas, group) is None
    expected = reference.grouped_block_conv(x, base, deltas, group)
    got = kernels.grouped_block_conv(x, base, deltas, group)
    assert got.shape == x.shape and got.dtype == dtype
    torch.testing.assert_close(got, expected, **TOL[dtype])


def test_a_block_never_reads_another():
    """Row i of a block sees rows i − taps + 1 .. i of its own block only."""
    x, base, deltas = conv_case(2, 4, 16, 4, 16, torch.float32, seed=3)
    changed = x.clone()
    changed[0] += 100.0  # block 0 entirely
    got = kernels.grouped_block_conv(changed, base, deltas, 16)
    assert torch.equal(got[1], kernels.grouped_block_conv(x, base, deltas, 16)[1])


def test_recorded_gradients_stay_on_the_reference(monkeypatch):
    """A call that records a gradient (training) runs the differentiable reference even where the
    kernel would take it."""
    x, base, deltas = conv_case(1, 4, 16, 4, 16, torch.float32, seed=4)
    base.requires_grad_(True)
    monkeypatch.setattr(block_conv, "use_kernel", lambda *a: True)
    out = block_conv.grouped_block_conv(x, base, deltas, 16)
    out.sum().backward()
    assert base.grad is not None


def test_refusals_name_what_the_kernel_cannot_take():
    x, base, deltas = conv_case(2, 4, 32, 4, 16, torch.float32, seed=5)
    assert "share one of" in refusal(x, base.double(), deltas, 16)
    assert "divide" in refusal(x, base, deltas, 5)
    assert "deltas must be" in refusal(x, base, deltas[:, :2], 16)
    assert "unit last stride" in refusal(x.transpose(1, 2).contiguous().transpose(1, 2), base, deltas, 16)
    assert refusal(x, base, deltas, 16) is None


# The launch is the real one (`code_size.compiled_launches` compiles it with the operand bundles
# `kernels.grouped_block_conv` passes instead of running it), the deltas a view as `conv_case` makes them.
_HOPPER_COMPILE = """
import sys
from pathlib import Path

import hylo
import torch
sys.path.insert(0, str(Path(hylo.__file__).parents[2] / "benchmarks" / "kernels"))
from code_size import compiled_launches
from hylo.ops.block_conv import kernels

bf16 = torch.bfloat16
x, base = torch.zeros(2, 8, 256, dtype=bf16), torch.zeros(4, 256, dtype=bf16)
deltas = torch.zeros(2, 8, 2, 4, 16, dtype=bf16)[..., 1, :, :]
launches = compiled_launches(lambda: kernels.grouped_block_conv(x, base, deltas, 16))
print([(p["kernel"], p["instructions"] > 0) for p in launches] == [("_grouped_block_conv_kernel", True)])
"""


def test_the_kernel_compiles_for_hopper():
    """bf16 as the GPU builds it (no GPU needed): the interpreter does not check Triton's typing rules."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["True"]
