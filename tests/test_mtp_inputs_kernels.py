"""The Triton kernel of an MTP verify block's inputs (`ops.mtp_inputs.block_inputs`) against its torch
reference, under the Triton interpreter on the CPU. It only moves values: equal, not close."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402

from hylo.ops.mtp_inputs import VerifiedBlocks, kernels, reference, refusal  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")


def verify_batch(blocks: int, width: int, hidden: int, seed: int, dtype=torch.bfloat16):
    """(the verified blocks, last_hidden, rows) of a uniform verify batch as
    `MTPProposer.observe_and_propose` sees it: features (a strided view of a wider capture), table rows
    in random order, counts from 1 to width (sequence 0 commits all,
    so its anchor lands in the extra column), sequence 1 at position 0 (prefix clamped) when there is one."""
    gen = torch.Generator().manual_seed(seed)
    tokens = blocks * width
    last_hidden = torch.randn(blocks + 5, hidden, generator=gen).to(dtype)
    rows = torch.randperm(blocks + 5, generator=gen)[:blocks]
    features = torch.randn(tokens, hidden + 8, generator=gen).to(dtype)[:, :hidden]
    input_ids = torch.randint(0, 1000, (tokens,), generator=gen)
    starts = torch.randint(0, 40, (blocks,), generator=gen)
    if blocks > 1:
        starts[1] = 0
    positions = (starts[:, None] + torch.arange(width)).flatten()
    pad_index = torch.arange(tokens).view(blocks, width)
    counts = torch.randint(1, width + 1, (blocks,), generator=gen).int()
    counts[0] = width
    anchors = torch.randint(1000, 2000, (blocks,), generator=gen)
    return VerifiedBlocks(features, input_ids, positions, pad_index, counts, anchors), last_hidden, rows


def assert_same(got, want, got_last, want_last):
    for name, a, b in zip(reference.BlockInputs._fields, got, want, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape, name
        assert torch.equal(a, b), name
    assert torch.equal(got_last, want_last), "last_hidden"


@pytest.mark.parametrize(
    ("blocks", "width", "hidden", "chain_steps", "block_h"),
    [(1, 2, 64, 0, 64), (3, 4, 48, 2, 64), (4, 4, 80, 4, 32), (2, 8, 40, 1, 16)],
)
def test_kernel_equals_the_reference(monkeypatch, blocks, width, hidden, chain_steps, block_h):
    """Hidden sizes off a power of two (masked tails) and, with a small BLOCK_H, several steps a row;
    `last` below some chained positions (clamped)."""
    monkeypatch.setattr(kernels, "BLOCK_H", block_h)
    verified, last_hidden, rows = verify_batch(blocks, width, hidden, seed=blocks * width + hidden)
    last = 40
    assert refusal(verified, last_hidden, rows) is None
    ours, theirs = last_hidden.clone(), last_hidden.clone()
    got = kernels.block_inputs(verified, ours, rows, chain_steps, last)
    want = reference.block_inputs(verified, theirs, rows, chain_steps, last)
    assert_same(got, want, ours, theirs)
    assert not torch.equal(ours, last_hidden), "the committed rows' hiddens were not stored"


def test_the_reference_is_what_the_proposer_fed_its_layer():
    """The reference's columns, spelled out for one sequence: old hidden then the features; tokens with
    the anchor after the committed ones; the new last hidden is the last committed token's feature."""
    verified, last_hidden, rows = verify_batch(3, 4, 8, 0)
    features, input_ids, positions, _, counts, anchors = verified
    counts[2] = 2
    old = last_hidden.clone()
    got = reference.block_inputs(verified, last_hidden, rows, 2, 1000)
    b, start = 2, positions[8]
    assert torch.equal(got.hidden[b, 0], old[rows[b]])
    assert torch.equal(got.hidden[b, 1:], features[8:12])
    ids = input_ids.tolist()
    assert got.tokens.view(3, 5)[b].tolist() == [ids[8], ids[9], anchors[b].item(), ids[11], ids[11]]
    assert torch.equal(last_hidden[rows[b]], features[9])
    assert got.first[b].item() == 2 * 5 + 2 and got.prefix[b].item() == start - 1
    assert got.chain[:, b].tolist() == [start + 2, start + 3]
    assert got.prefix[1].item() == 0  # sequence 1 starts at position 0


def test_refusals_name_what_the_kernel_cannot_take():
    verified, last_hidden, rows = verify_batch(3, 4, 16, 1)
    assert "H" in refusal(verified._replace(features=verified.features.t()), last_hidden, rows)
    assert "dtype" in refusal(verified, last_hidden.float(), rows)
    strided = torch.zeros(3, 2, dtype=torch.long)[:, 0]
    assert "contiguous" in refusal(verified._replace(anchors=strided), last_hidden, rows)
    assert "int64" in refusal(verified._replace(input_ids=verified.input_ids.int()), last_hidden, rows)
    empty = verified._replace(features=verified.features[:0], pad_index=verified.pad_index[:0])
    assert "empty" in refusal(empty, last_hidden, rows[:0])
    assert refusal(verified, last_hidden, rows) is None


# The launch is the real one (`code_size.compiled_launches` compiles it with the operands
# `kernels.block_inputs` passes instead of running it): bf16 rows 6144 wide, int32 counts.
_HOPPER_COMPILE = """
import sys
from pathlib import Path

import hylo
import torch
sys.path.insert(0, str(Path(hylo.__file__).parents[2] / "benchmarks" / "kernels"))
from code_size import compiled_launches
from hylo.ops.mtp_inputs import VerifiedBlocks, kernels

blocks, width, hidden, i64 = 2, 4, 6144, torch.int64
verified = VerifiedBlocks(
    torch.zeros(blocks * width, hidden, dtype=torch.bfloat16), torch.zeros(blocks * width, dtype=i64),
    torch.zeros(blocks * width, dtype=i64), torch.zeros(blocks, width, dtype=i64),
    torch.zeros(blocks, dtype=torch.int32), torch.zeros(blocks, dtype=i64),
)
last_hidden, rows = torch.zeros(4, hidden, dtype=torch.bfloat16), torch.zeros(blocks, dtype=i64)
launches = compiled_launches(lambda: kernels.block_inputs(verified, last_hidden, rows, 2, 127))
print([(p["kernel"], p["instructions"] > 0) for p in launches] == [("_block_inputs_kernel", True)])
"""


def test_the_kernel_compiles_for_hopper():
    """As the GPU builds it (no GPU needed): the interpreter does not check Triton's typing rules."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["True"]
