"""The Triton batch-metadata kernel against its torch reference (`uniform_metadata`), under the Triton
interpreter on the CPU, and the fixed-shape paths that call it. Integer results: equal, not close."""

from __future__ import annotations

from interpreter import run_compiled_for_hopper, use_interpreter

use_interpreter()  # before the kernels are decorated

import pytest  # noqa: E402
import torch  # noqa: E402
from conftest import random_prompt  # noqa: E402
from test_mtp import VOCAB, checkpoints  # noqa: E402, F401 (a fixture: a target with an MTP layer)

from hylo import LLM, SamplingParams  # noqa: E402
from hylo.ops import batch_metadata  # noqa: E402
from hylo.ops.batch_metadata import kernels, output_sizes, reference, refusal  # noqa: E402

pytestmark = pytest.mark.usefixtures("strict_launch_arguments")

PAGE, KPOOL, ROWS, COLUMNS = 16, 4, 6, 96  # a table of 6 rows of 96 positions; the last row is the filler


def request_table() -> torch.Tensor:
    """Rows of shuffled pages (so a slot names its row and position), int32 as the engine keeps it."""
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(ROWS * COLUMNS // PAGE, generator=gen).view(ROWS, COLUMNS // PAGE)
    return (pages[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1).int()


def run_kernel(prefix, rows, width, table, filler, lengths):
    assert refusal(prefix, rows, width, table, KPOOL, lengths, None) is None
    sizes = output_sizes(prefix.shape[0], width, table, KPOOL)
    out = {name: torch.full(size, -7, dtype=torch.long) for name, size in sizes.items()}
    return kernels.uniform_metadata(prefix, rows, width, table, KPOOL, filler, lengths, out)


CASES = {
    # (prefix lengths, table rows, width, padded lengths or None)
    "decode": ([0, 5, 37, 90], [0, 1, 2, 3], 1, None),
    "verify blocks crossing pools": ([3, 8, 61], [4, 0, 2], 8, None),
    "a prefill chunk wider than a loop step": ([1], [3], 80, None),
    "padded prefill": ([9], [1], 70, [33]),
    "padded, one token": ([5], [2], 16, [1]),
    "padded, several sequences": ([2, 40], [0, 4], 12, [12, 5]),
}


# padding needs a filler row (the reference raises without one)
PAIRS = [(case, filler) for case in CASES for filler in (None, ROWS - 1) if filler or CASES[case][3] is None]


@pytest.mark.parametrize(("case", "filler"), PAIRS)
def test_kernel_equals_the_reference(case, filler):
    prefix, rows, width, lengths = CASES[case]
    table = request_table()
    prefix, rows = torch.tensor(prefix), torch.tensor(rows)
    lengths = None if lengths is None else torch.tensor(lengths)
    want = reference.uniform_metadata(prefix, rows, width, table, KPOOL, filler, lengths)
    got = run_kernel(prefix, rows, width, table, filler, lengths)
    assert tuple(got) == tuple(want) == batch_metadata.FIELDS
    for name, value in want.items():
        assert torch.equal(got[name], value.long()), name
    assert (got["pool_table"] >= 0).any() and (got["pool_table"] == -1).any()  # both sides of the mask


@pytest.mark.parametrize("after_commit", [False, True], ids=["decode", "after a commit in flight"])
def test_the_in_flight_first_tokens_and_commits_resolve_in_the_same_launch(after_commit):
    """`InFlight`: each sequence's first token is its upload or, marked, its row's last sampled token,
    written to a strided column (a step's first input ids); after a commit in flight a sequence starts
    `last_committed[row]` later. The kernel equals the reference, both the metadata and the tokens."""
    table, marker = request_table(), -1
    prefix, rows, width = torch.tensor([3, 8, 40]), torch.tensor([4, 0, 2]), 3
    first = torch.tensor([marker, 17, marker])
    last_sampled = torch.arange(ROWS, dtype=torch.long) * 10 + 5  # row r sampled 10 r + 5
    last_committed = torch.tensor([2, 0, 4, 0, 3, 0], dtype=torch.int32)
    after = torch.tensor([1, 0, 1]) if after_commit else None
    results = []
    for run in (reference_path, run_kernel_in_flight):
        ids = torch.full((3, width), -7, dtype=torch.long)
        flight = batch_metadata.InFlight(
            first, marker, last_sampled, ids[:, 0], after, last_committed if after_commit else None
        )
        results.append((run(prefix, rows, width, table, flight), ids))
    (want, want_ids), (got, got_ids) = results
    assert want_ids[:, 0].tolist() == [45, 17, 25] and torch.equal(got_ids, want_ids)
    assert (got_ids[:, 1:] == -7).all()  # only the first column is written
    for name, value in want.items():
        assert torch.equal(got[name], value.long()), name
    starts = [3 + 3, 8, 40 + 4] if after_commit else [3, 8, 40]
    assert got["positions"].view(3, width)[:, 0].tolist() == starts


def reference_path(prefix, rows, width, table, flight):
    return reference.uniform_metadata(
        reference.resolve_in_flight(prefix, rows, flight), rows, width, table, KPOOL, ROWS - 1
    )


def run_kernel_in_flight(prefix, rows, width, table, flight):
    assert refusal(prefix, rows, width, table, KPOOL, None, None, flight) is None
    sizes = output_sizes(prefix.shape[0], width, table, KPOOL)
    out = {name: torch.full(size, -7, dtype=torch.long) for name, size in sizes.items()}
    return kernels.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1, None, out, flight)


def test_the_padded_tokens_write_the_filler_slot_and_repeat_the_last_position():
    """A check of the reference itself on the case the kernel's branches differ most."""
    table = request_table()
    got = run_kernel(torch.tensor([9]), torch.tensor([1]), 8, table, ROWS - 1, torch.tensor([3]))
    assert got["positions"].tolist() == [9, 10, 11] + [11] * 5
    assert got["new_slots"].tolist() == table[1, 9:12].tolist() + [int(table[ROWS - 1, 0])] * 5


def test_dispatch_writes_into_out_on_both_paths(monkeypatch):
    """With `out`, the results land in the given tensors (a captured batch's), from the kernel and,
    refused, from the reference; a refused `out` (wrong dtype) sends the call to the reference."""
    table = request_table()
    prefix, rows = torch.tensor([3, 8]), torch.tensor([4, 0])
    want = reference.uniform_metadata(prefix, rows, 4, table, KPOOL, ROWS - 1)
    calls = []
    monkeypatch.setattr(
        batch_metadata, "use_kernel", lambda op, t, verify: calls.append(verify()) or not calls[-1]
    )
    for dtype in (torch.long, torch.int32):  # int32 outputs: refused, the reference's copies fill them
        sizes = output_sizes(2, 4, table, KPOOL)
        out = {name: torch.zeros(size, dtype=dtype) for name, size in sizes.items()}
        assert batch_metadata.uniform_metadata(prefix, rows, 4, table, KPOOL, ROWS - 1, out=out) is out
        for name, value in want.items():
            assert torch.equal(out[name].long(), value.long()), (dtype, name)
    assert calls[0] is None and "int64" in calls[1]


def test_refusals_name_what_the_kernel_cannot_take():
    table = request_table()
    prefix, rows = torch.tensor([3, 8]), torch.tensor([4, 0])
    assert "int32" in refusal(prefix, rows, 4, table.long(), KPOOL, None, None)
    assert "rows" in refusal(prefix, rows[:1], 4, table, KPOOL, None, None)
    assert "contiguous" in refusal(torch.tensor([[3, 0], [8, 0]])[:, 0], rows, 4, table, KPOOL, None, None)
    assert refusal(prefix, rows, 4, table, KPOOL, None, None) is None


# The launch is the real one (`code_size.compiled_launches` compiles it with the operand bundles
# `kernels.uniform_metadata` passes instead of running it), with lengths, a filler row and a first token
# resolved after an in-flight commit.
_HOPPER_COMPILE = """
import sys
from pathlib import Path

import hylo
import torch
sys.path.insert(0, str(Path(hylo.__file__).parents[2] / "benchmarks" / "kernels"))
from code_size import compiled_launches
from hylo.ops.batch_metadata import InFlight, kernels, output_sizes

i32, i64 = torch.int32, torch.int64
prefix, rows, first, after = torch.zeros(4, 2, dtype=i64)
table = torch.zeros(4, 64, dtype=i32)
out = {name: torch.zeros(size, dtype=i64) for name, size in output_sizes(2, 4, table, 16).items()}
ids = torch.zeros(2, 4, dtype=i64)[:, 0]
f = InFlight(first, -1, torch.zeros(4, dtype=i64), ids, after, torch.zeros(4, dtype=i32))
launches = compiled_launches(lambda: kernels.uniform_metadata(prefix, rows, 4, table, 16, 3, prefix, out, f))
print([(p["kernel"], p["instructions"] > 0) for p in launches] == [("_uniform_metadata_kernel", True)])
"""


def test_the_kernel_compiles_for_hopper():
    """As the GPU builds it (no GPU needed): the interpreter does not check Triton's typing rules."""
    assert run_compiled_for_hopper(_HOPPER_COMPILE).split() == ["True"]


@pytest.mark.parametrize("algorithm", [None, "MTP"])
def test_engine_steps_with_the_kernel_give_the_references_tokens(checkpoints, monkeypatch, algorithm):  # noqa: F811
    """The fixed-shape paths (decode graphs, prefill graphs, MTP verify graphs and drafting, run
    uncaptured on the CPU) with the kernel building every batch's metadata: the tokens and drafts of
    the reference's engine. A step's metadata routes every cache read and write, so any wrong entry
    shows as other tokens."""
    spec = {} if algorithm is None else {"speculative_algorithm": "MTP", "speculative_num_steps": 3}
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (3, 21, 40)]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)

    def tokens(kernel: bool) -> list[list[int]]:
        built = []
        if kernel:
            run = kernels.uniform_metadata
            monkeypatch.setattr(batch_metadata, "use_kernel", lambda op, t, verify: verify() is None)
            monkeypatch.setattr(kernels, "uniform_metadata", lambda *a: built.append(a) or run(*a))
        llm = LLM(
            str(checkpoints[1]), device="cpu", dtype="float32", page_size=16, max_memory_gb=0.25,
            context_length=128, decode_graphs=True, speculative_adaptive=False, **spec,
        )  # fmt: skip
        out = [
            o.token_ids
            for o in llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        ]
        monkeypatch.undo()
        assert not kernel or len(built) > len(prompts) * 2  # every step's batches went through the kernel
        return out

    assert tokens(kernel=True) == tokens(kernel=False)
