"""The batch-metadata kernel on the GPU at an engine's sizes (a request table of 128 rows of 8192
positions; decode, verify and padded prefill widths), against the reference, and replayed from a CUDA
graph with new inputs (the decode, verify and prefill graphs rebuild their metadata inside the replay)."""

from __future__ import annotations

import pytest
import torch

from hylo.ops import batch_metadata
from hylo.ops.batch_metadata import output_sizes, reference

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

PAGE, KPOOL, ROWS, COLUMNS = 64, 4, 128, 8192  # the last row is the filler row: 127 for sequences


def request_table() -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    pages = torch.randperm(ROWS * COLUMNS // PAGE, generator=gen).view(ROWS, COLUMNS // PAGE)
    return (pages[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1).int().cuda()


def inputs(sequences: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, COLUMNS - width, (sequences,), generator=gen)
    rows = torch.randperm(ROWS - 1, generator=gen)[:sequences]
    lengths = torch.randint(1, width + 1, (sequences,), generator=gen)
    return prefix.cuda(), rows.cuda(), lengths.cuda()


@pytest.mark.parametrize(
    ("sequences", "width", "padded"),
    [(1, 1, False), (64, 1, False), (64, 16, False), (1, 1024, True), (4, 300, True)],
)
def test_kernel_equals_the_reference(sequences, width, padded):
    table = request_table()
    prefix, rows, lengths = inputs(sequences, width, seed=width)
    lengths = lengths if padded else None
    got = batch_metadata.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1, lengths)
    want = reference.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1, lengths)
    for name, value in want.items():
        assert torch.equal(got[name], value.long()), name


def test_graph_replays_rebuild_the_metadata_from_new_inputs():
    table = request_table()
    sequences, width = 8, 8
    prefix, rows, _ = inputs(sequences, width, seed=1)
    out = {
        name: torch.empty(size, dtype=torch.long, device="cuda")
        for name, size in output_sizes(sequences, width, table, KPOOL).items()
    }
    batch_metadata.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1, out=out)  # compiles
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        batch_metadata.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1, out=out)
    for seed in (2, 3):
        new_prefix, new_rows, _ = inputs(sequences, width, seed=seed)
        prefix.copy_(new_prefix)
        rows.copy_(new_rows)
        graph.replay()
        want = reference.uniform_metadata(prefix, rows, width, table, KPOOL, ROWS - 1)
        for name, value in want.items():
            assert torch.equal(out[name], value.long()), (seed, name)
