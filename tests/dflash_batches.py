"""Packed batches as a DFlash step's index arithmetic (`ops.dflash_inputs`) reads them, for its CPU and GPU
tests (this module sets no interpreter: the GPU tests import it)."""

from __future__ import annotations

import torch

from hylo.ops.dflash_inputs import CommittedTokens


def committed_batch(lengths: list[int], seed: int, index_dtype=torch.int64) -> CommittedTokens:
    """Sequences of `lengths` packed tokens each: positions from a random start, distinct cache slots, and
    a random count committed of each chunk (0 to all of it)."""
    gen = torch.Generator().manual_seed(seed)
    seqs = len(lengths)
    token_seq = torch.repeat_interleave(torch.arange(seqs), torch.tensor(lengths))
    first = torch.cumsum(torch.tensor([0, *lengths[:-1]]), 0)
    pad_index = first[:, None] + torch.arange(max(lengths))[None, :]  # column 0: each sequence's first token
    starts = torch.randint(0, 5000, (seqs,), generator=gen)
    positions = starts[token_seq] + (torch.arange(len(token_seq)) - first[token_seq])
    new_slots = torch.randperm(100_000, generator=gen)[: len(token_seq)]
    counts = torch.stack([torch.randint(0, n + 1, (), generator=gen) for n in lengths]).int()
    return CommittedTokens(
        token_seq.to(index_dtype), pad_index.to(index_dtype), positions.to(index_dtype),
        new_slots.to(index_dtype), counts,
    )  # fmt: skip
