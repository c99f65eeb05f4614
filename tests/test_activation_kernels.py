"""The Triton clamped SwiGLU against its torch reference, under the Triton interpreter on the CPU, and
the MLP that runs it (bf16 at real shapes on the GPU: `tests/test_fused_decode_kernels_cuda.py`)."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import math  # noqa: E402
from types import SimpleNamespace  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.layers.mlp import MLP  # noqa: E402
from hylo.ops import activation  # noqa: E402
from hylo.ops.activation import kernels, reference, refusal  # noqa: E402
from hylo.ops.moe import reference as moe_reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

LIMIT = 10.0
kernels_run = kernels.swiglu_clamp  # the interpreted kernel, under a counting stand-in where tests patch it


def ulps(out: torch.Tensor, ref: torch.Tensor) -> float:
    """Largest difference in units of the output dtype's last place at the reference's magnitude."""
    spacing = torch.finfo(ref.dtype).eps * ref.abs().double().clamp_min(torch.finfo(ref.dtype).tiny)
    return float(((out.double() - ref.double()).abs() / spacing).max())


def fused_gate_up(rows: int, width: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A gate|up product `[rows, 2·width]` whose entries reach three times the limit on both sides."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 2 * width, generator=gen) * 1.5 * LIMIT).to(dtype)


@pytest.mark.parametrize("width", [8, 200, 1500])  # one partial program; several programs per row
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernel_matches_the_reference(width, dtype):
    """Both round SiLU to the dtype, then the product. fp32 SiLUs from two exp implementations differ
    by an ulp of fp32, which can move the rounded SiLU by one ulp of the dtype; that ulp scales the
    product, whose own rounding adds one more: two ulps of the dtype in all (fp32: a few of its own)."""
    gate_up = fused_gate_up(5, width, dtype, seed=width)
    gate, up = gate_up[:, :width], gate_up[:, width:]  # the two halves of one row, as the MLP reads them
    assert refusal(gate, up) is None
    out, ref = kernels.swiglu_clamp(gate, up, LIMIT), reference.swiglu_clamp(gate, up, LIMIT)
    assert out.dtype == ref.dtype and out.shape == ref.shape and out.is_contiguous()
    assert ulps(out, ref) <= (8 if dtype == torch.float32 else 2), dtype
    assert (gate > LIMIT).any() and (up.abs() > LIMIT).any()  # the clamps are exercised


def test_kernel_clamps_both_sides_of_up_and_the_top_of_gate():
    """Hand-picked entries: a gate far below -limit is not clamped (SiLU ≈ 0, not SiLU(-limit))."""
    gate = torch.tensor([[30.0, -30.0, 30.0, 2.0]])
    up = torch.tensor([[30.0, 1.0, -30.0, -30.0]])
    silu = torch.nn.functional.silu
    limit = torch.tensor(LIMIT)
    expected = torch.stack(
        [
            silu(limit) * LIMIT,
            silu(torch.tensor(-30.0)),
            -silu(limit) * LIMIT,
            silu(torch.tensor(2.0)) * -LIMIT,
        ]
    )
    torch.testing.assert_close(kernels.swiglu_clamp(gate, up, LIMIT)[0], expected)


def test_reference_is_the_routed_experts_activation():
    gate_up = fused_gate_up(3, 16, torch.float32, seed=2)
    gate, up = gate_up[:, :16], gate_up[:, 16:]
    assert torch.equal(reference.swiglu_clamp(gate, up, LIMIT), moe_reference.swiglu_clamp(gate, up, LIMIT))


def test_kernel_takes_leading_dimensions_and_no_rows():
    gate_up = fused_gate_up(6, 24, torch.float16, seed=3).view(2, 3, 48)
    gate, up = gate_up[..., :24], gate_up[..., 24:]
    out = kernels.swiglu_clamp(gate, up, LIMIT)
    assert out.shape == (2, 3, 24) and ulps(out, reference.swiglu_clamp(gate, up, LIMIT)) <= 2
    assert kernels.swiglu_clamp(gate[:0], up[:0], LIMIT).shape == (0, 3, 24)


@pytest.mark.parametrize(
    ("make", "reason"),
    [
        (lambda: (torch.randn(4, 8), torch.randn(4, 6)), "one shape"),
        (lambda: (torch.randn(4, 8), torch.randn(4, 8).half()), "one shape, dtype"),
        (lambda: (torch.randn(4, 8).to(torch.int32), torch.randn(4, 8).to(torch.int32)), "unsupported dtype"),
        (lambda: (torch.randn(8, 4).t(), torch.randn(4, 8)), "unit last stride"),
        (lambda: (torch.randn(2, 4, 8)[:, :3], torch.randn(2, 3, 8)), "one stride"),
        (lambda: (torch.randn(4, 16)[:, :8], torch.randn(4, 8)), "share their row stride"),
    ],
)
def test_refusal_names_why(make, reason):
    assert reason in refusal(*make())


def test_mlp_runs_one_gate_up_product_as_hf_runs_two():
    """The MLP's fused gate|up product split in halves is HF's two projections (on the CPU the
    dispatcher runs the reference: the same arithmetic up to the GEMMs' summation order)."""
    torch.manual_seed(0)
    mlp = MLP(32, 48, LIMIT)
    for p in mlp.parameters():
        p.data.normal_(0, 0.5)
    x = torch.randn(5, 32) * 4
    gate_w, up_w = mlp.gate_up_proj.weight.split(48)
    hf = mlp.down_proj(moe_reference.swiglu_clamp(x @ gate_w.t(), x @ up_w.t(), LIMIT))
    torch.testing.assert_close(mlp(x), hf, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_with_no_limit_it_is_plain_swiglu(dtype):
    """`limit` inf (the DFlash draft's MLP): the reference is exactly SiLU(gate) · up, the kernel within the
    two ulps of `test_kernel_matches_the_reference`."""
    gate_up = fused_gate_up(4, 200, dtype, seed=5)
    gate, up = gate_up[:, :200], gate_up[:, 200:]
    plain = torch.nn.functional.silu(gate.contiguous()) * up  # the clamp's copy is contiguous
    assert torch.equal(reference.swiglu_clamp(gate, up, math.inf), plain)
    assert ulps(kernels.swiglu_clamp(gate, up, math.inf), plain) <= (8 if dtype == torch.float32 else 2)


def test_the_draft_mlp_activates_in_one_kernel_launch(monkeypatch):
    """The DFlash draft's MLP dispatched as on the GPU: one swiglu launch with no limit, the output the
    draft's Qwen3 MLP (down of SiLU(gate) · up)."""
    from hylo.models.dflash import DraftMLP

    config = SimpleNamespace(hidden_size=32, intermediate_size=48)
    torch.manual_seed(1)
    mlp = DraftMLP(config)
    for p in mlp.parameters():
        p.data.normal_(0, 0.3)
    x = torch.randn(3, 32)
    gate_w, up_w = mlp.gate_up_proj.weight.split(48)
    expected = mlp.down_proj(torch.nn.functional.silu(x @ gate_w.t()) * (x @ up_w.t()))
    limits = []
    monkeypatch.setattr(activation, "use_kernel", lambda op, t, verify: verify() is None)
    monkeypatch.setattr(
        kernels, "swiglu_clamp", lambda g, u, limit: limits.append(limit) or kernels_run(g, u, limit)
    )
    with torch.inference_mode():  # as the engine drafts: autograd records nothing
        torch.testing.assert_close(mlp(x), expected, rtol=1e-5, atol=1e-5)
    assert limits == [math.inf]


def test_dispatch_sends_cuda_calls_to_the_kernel_unless_autograd_records(monkeypatch):
    """`use_kernel` forced as for CUDA tensors: the kernel runs, except for a call autograd records
    (it has no backward), which takes the reference and still differentiates."""
    calls = []
    monkeypatch.setattr(activation, "use_kernel", lambda op, t, verify: verify() is None)
    monkeypatch.setattr(kernels, "swiglu_clamp", lambda *a: calls.append(a) or reference.swiglu_clamp(*a))
    gate, up = torch.randn(2, 8), torch.randn(2, 8)
    activation.swiglu_clamp(gate, up, LIMIT)
    assert len(calls) == 1
    gate.requires_grad_(True)
    activation.swiglu_clamp(gate, up, LIMIT).sum().backward()
    assert len(calls) == 1 and gate.grad is not None


# The indexer's stores and the norm pair compile through their real launches (`code_size.compiled_launches`
# compiles them with the operand bundles `store_tokens` and `rms_norm_pair` pass, instead of running them):
# bf16, d = 128; q_a's and kv_a's rows, views of one row.
_HOPPER_COMPILE = """
import sys
from pathlib import Path

import hylo
import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
sys.path.insert(0, str(Path(hylo.__file__).parents[2] / "benchmarks" / "kernels"))
from code_size import compiled_launches
from hylo.ops.activation.kernels import _swiglu_clamp_kernel
from hylo.ops.indexer import KeyNorm, TokenKeys, kernels as indexer
from hylo.ops.norm import NormRows, RowStore
from hylo.ops.norm import kernels as norm_kernels

def compile(fn, consts, kinds):
    sig = {n: "constexpr" if n in consts else kinds.get(n, "*bf16") for n in fn.arg_names}
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
    return len(triton.compile(src, target=GPUTarget("cuda", 90, 128)).asm["cubin"]) > 0

def kernels_of(call):
    return [launch["kernel"] for launch in compiled_launches(call) if launch["instructions"] > 0]

key, gates = torch.zeros(2, 4, 128, dtype=torch.bfloat16)
key_norm = KeyNorm(torch.ones(128, dtype=torch.bfloat16), torch.zeros(128, dtype=torch.bfloat16), 1e-6)
cache = TokenKeys(*torch.zeros(2, 64, 128, dtype=torch.bfloat16))
q_a, kv_a = torch.zeros(2, 1536 + 512, dtype=torch.bfloat16).split([1536, 512], dim=1)
weight = torch.ones(1536, dtype=torch.bfloat16)
store = RowStore(torch.zeros(4, 512, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int64))
rows = NormRows(q_a, weight, 1e-6), NormRows(kv_a, weight[:512], 1e-6)
kinds = {"row_stride": "i32", "width": "i32", "limit": "fp32"}
stores = kernels_of(lambda: indexer.store_tokens(key, gates, key_norm, cache, torch.arange(4)))
print(compile(_swiglu_clamp_kernel, {"BLOCK": 1024}, kinds),
      stores == ["_store_tokens_kernel"],
      kernels_of(lambda: norm_kernels.rms_norm_pair(*rows, store)) == ["_rms_norm_pair_kernel"])
"""


def test_the_decode_step_kernels_compile_for_hopper():
    """This module's kernel and the two others fused for the decode step (the indexer's stores, the
    q_a/kv_a norm pair) compile for sm_90 in bf16, as the GPU builds them (no GPU needed)."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["True"] * 3
