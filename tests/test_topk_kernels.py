"""The Triton `top_k` against its torch reference (a stable descending sort), under the interpreter: the same
indices and the same value bits, ties to the lower index, across chunks of the row."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops import topk  # noqa: E402
from hylo.ops.topk import kernels, reference  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def rows(kind: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(len(kind) + shape[-1])
    x = torch.randn(*shape, generator=g)
    if kind == "ties":  # few distinct values: most of the top k are ties, broken by index
        x = (x * 2).round() / 2
    elif kind == "ascending":  # each chunk's entries beat the last's: every chunk moves k keys in
        x = torch.sort(x, dim=-1).values
    elif kind == "special":  # -inf outside a token map, signed zeros, the largest finite values
        x[..., ::3] = float("-inf")
        x[..., 1::7] = 0.0
        x[..., 2::7] = -0.0
        x[..., 5] = torch.finfo(dtype).max
    return x.to(dtype)


@pytest.mark.parametrize(
    ("kind", "shape", "k", "dtype"),
    [
        ("random", (7, 300), 8, torch.bfloat16),  # DFlash2's drafted rows, one chunk
        ("ties", (3, 257), 5, torch.float32),  # k not a power of two
        ("ascending", (2, 9000), 8, torch.float32),  # three chunks of 4096, the last partial
        ("ties", (2, 3, 5000), 16, torch.bfloat16),  # leading dims, two chunks
        ("special", (4, 100), 40, torch.float16),  # more zeros than slots: their order by index
        ("random", (5, 64), 1, torch.float32),
    ],
)
def test_top_k_is_the_reference(kind, shape, k, dtype):
    x = rows(kind, shape, dtype)
    values, indices = kernels.top_k(x, k)
    ref_values, ref_indices = reference.top_k(x, k)
    assert torch.equal(indices, ref_indices)
    assert torch.equal(values.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       ref_values.view(torch.int16 if dtype != torch.float32 else torch.int32))  # fmt: skip
    # and a valid torch.topk answer: the same multiset of values
    torch.testing.assert_close(values.float(), x.float().topk(k).values, rtol=0, atol=0)


def test_dispatch_sends_cpu_to_the_reference_and_refuses_what_the_kernel_cannot_take():
    x = torch.randn(3, 50)
    assert all(map(torch.equal, topk.top_k(x, 4), reference.top_k(x, 4)))
    assert topk.refusal(x, topk.MAX_K + 1) is not None
    assert topk.refusal(x.int(), 4) is not None
    assert topk.refusal(x[:, ::2], 4) is not None
    assert topk.refusal(x, 4) is None
    assert topk.refusal(x.requires_grad_(), 4) is not None  # training keeps the differentiable reference
    with torch.no_grad():
        assert topk.refusal(x, 4) is None
    x = x.detach()
    with pytest.raises(ValueError, match="k = 51 must be within"):
        topk.top_k(x, 51)


_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hylo.ops.topk import kernels

fn = kernels._top_k_kernel
consts = dict(K=8, K_PAD=8, CHUNK=4096)
sig = {"x_ptr": "*bf16", "values_ptr": "*bf16", "indices_ptr": "*i64", "n": "i32", "stride_x": "i32"}
sig |= {n: "constexpr" for n in consts}
src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
print(len(triton.compile(src, target=GPUTarget("cuda", 90, 128), options={"num_warps": 4}).asm["cubin"]) > 0)
"""


def test_top_k_compiles_for_hopper():
    assert run_compiled_for_hopper(_COMPILE).split() == ["True"]
