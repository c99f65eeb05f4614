"""The Triton greedy-acceptance kernel against its torch reference (`accepted_prefix`), under the
Triton interpreter on the CPU. Integer results: equal, not close."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops.acceptance import kernels, reference, refusal  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def blocks(count: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(picks [V, T], drafts [V, T-1] as a verify batch holds them: a strided view of its token ids,
    num_drafts [V]): drafts equal to the picks up to a random point and counts from 0 to T-1, block 0
    all drafts kept."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.randint(0, 5, (count, width), generator=gen)
    ids = torch.randint(0, 5, (count, width), generator=gen)
    agreeing = torch.randint(0, width, (count, 1), generator=gen)
    agreeing[0] = width - 1  # block 0 agrees at every draft and counts all: the full prefix
    agree = torch.arange(width - 1)[None, :] < agreeing
    ids[:, 1:] = torch.where(agree, picks[:, :-1], ids[:, 1:])
    num_drafts = torch.randint(0, width, (count,), generator=gen)
    num_drafts[0] = width - 1
    return picks, ids[:, 1:], num_drafts


@pytest.mark.parametrize(("count", "width"), [(1, 2), (7, 4), (33, 8), (5, 16), (3, 64)])
@pytest.mark.parametrize("counted", [True, False])
def test_kernel_equals_the_reference(count, width, counted):
    picks, drafts, num_drafts = blocks(count, width, seed=count * width)
    num_drafts = num_drafts.int() if counted else None
    assert refusal(picks, drafts, num_drafts) is None
    want = reference.accepted_prefix(picks, drafts, num_drafts)
    got = kernels.accepted_prefix(picks, drafts, num_drafts)
    for name, a, b in zip(("accepted", "committed", "anchors"), got, want, strict=True):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert want[0][0] == width - 1  # a kernel that stopped early fails
    if count > 8:  # empty prefixes too
        assert 0 in want[0].tolist()


def test_refusals_name_what_the_kernel_cannot_take():
    picks, drafts, num_drafts = blocks(4, 4, seed=1)
    assert "int64" in refusal(picks.int(), drafts, None)
    assert "[V, T-1]" in refusal(picks, drafts[:, :2], None)
    assert "64 tokens" in refusal(
        torch.zeros(2, 65, dtype=torch.long), torch.zeros(2, 64, dtype=torch.long), None
    )
    assert "contiguous" in refusal(picks, drafts, torch.zeros(4, 2, dtype=torch.long)[:, 0])
    assert "unit last stride" in refusal(picks, picks.t().contiguous().t()[:, 1:], None)
    assert refusal(picks, drafts, num_drafts) is None


_HOPPER_COMPILE = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from hylo.ops.acceptance.kernels import _accepted_prefix_kernel as fn

consts = {"HAS_NUM_DRAFTS": True, "BLOCK": 8}
kinds = {"picks_stride": "i64", "drafts_stride": "i64", "width": "i32", "num_drafts": "*i32",
         "committed": "*i32"}
sig = {n: "constexpr" if n in consts else kinds.get(n, "*i64") for n in fn.arg_names}
src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(n),): v for n, v in consts.items()})
print(len(triton.compile(src, target=GPUTarget("cuda", 90, 128)).asm["cubin"]) > 0)
"""


def test_the_kernel_compiles_for_hopper():
    """As the GPU builds it (no GPU needed): the interpreter does not check Triton's typing rules."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["True"]
