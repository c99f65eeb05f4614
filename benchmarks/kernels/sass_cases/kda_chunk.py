"""The KDA chunked prefill (`ops/kda/chunk.py`): one sequence and two, 64 heads and a TP8 rank's 8, with
snapshots inside the sequences, a padded batch (device offsets alone), and the first launch in chunk
order."""

from __future__ import annotations

import torch
from code_size import HEAD_DIM

from hylo.ops.kda import chunk
from hylo.ops.kda.reference import ChunkSnapshots, KDAInputs, KDAParams, KDASlots

BF16 = torch.bfloat16
MODULES = (chunk,)


def setup(lengths: list[int], heads: int) -> tuple:
    """Zero operands of a packed prefill of sequences of `lengths` tokens (q, k, v one projection's
    column blocks, as the layer lays them out)."""
    hd, n, seqs = heads * HEAD_DIM, sum(lengths), len(lengths)
    q, k, v = torch.zeros(n, 3 * hd, dtype=BF16).split(hd, dim=-1)
    x = KDAInputs(q, k, v, torch.zeros(n, hd, dtype=BF16), torch.zeros(n, heads, dtype=BF16))
    params = KDAParams(torch.zeros(3 * hd, 4), torch.zeros(hd), torch.zeros(heads), -5.0)
    slots = KDASlots(
        torch.zeros(seqs + 1, 3, 3 * hd, dtype=BF16),
        torch.zeros(seqs + 1, heads, HEAD_DIM, HEAD_DIM),
        torch.arange(seqs, dtype=torch.int32),
    )
    cu = [0]
    for length in lengths:
        cu.append(cu[-1] + length)
    return x, params, slots, torch.tensor(cu, dtype=torch.int32), cu


def with_snapshots(lengths: list[int], heads: int) -> None:
    x, params, slots, cu, cu_cpu = setup(lengths, heads)
    chunks = chunk.chunk_count(cu_cpu, cu_cpu[-1], len(lengths))
    hd = heads * HEAD_DIM
    snapshots = ChunkSnapshots(
        torch.full((chunks,), -1, dtype=torch.int64),
        torch.zeros(4, 3, 3 * hd, dtype=BF16),
        torch.zeros(4, heads, HEAD_DIM, HEAD_DIM),
    )
    chunk.prefill(x, params, slots, cu, cu_cpu, snapshots)


def padded(lengths: list[int], heads: int) -> None:
    x, params, slots, cu, _ = setup(lengths, heads)
    chunk.prefill(x, params, slots, cu, None)


def prep_in_chunk_order(lengths: list[int], heads: int) -> None:
    chunk.prep(*setup(lengths, heads), conv_order="chunk")


CASES = {
    "prefill_h64_one": lambda: chunk.prefill(*setup([13312], 64)),
    "prefill_h8_two_snapshots": lambda: with_snapshots([8192, 5120], 8),
    "prefill_h64_padded_two": lambda: padded([1000, 24], 64),
    "prep_h16_chunk_order": lambda: prep_in_chunk_order([4096], 16),
}
