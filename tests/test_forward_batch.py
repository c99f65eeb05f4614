"""`ForwardBatch.build` on the host: the pooled-key slots of the pools a batch completes."""

from __future__ import annotations

import random

import torch

from hylo.forward_batch import ForwardBatch, SequenceChunk


def test_completed_pools_are_every_pool_whose_last_token_is_in_the_batch():
    """Chunks of random lengths after random prefixes (pools of 1, 4 and 16 tokens, some chunks completing
    none): the batch lists the slot of each pool completed by its chunk, in chunk order, and nothing else."""
    rng = random.Random(0)
    table = torch.randperm(8 * 256).view(8, 256).int()  # every position its own token slot
    for _ in range(100):
        kpool = rng.choice([1, 4, 16])
        chunks = [
            SequenceChunk([1] * rng.randint(1, 40), rng.randint(0, 200), rng.randrange(8), 0)
            for _ in range(rng.randint(1, 5))
        ]
        batch = ForwardBatch.build(chunks, table, None, None, kpool)
        expected = [
            int(table[c.table_row, p * kpool]) // kpool
            for c in chunks
            for p in range(c.prefix_len // kpool, (c.prefix_len + len(c.token_ids)) // kpool)
        ]
        assert batch.completed_pools.tolist() == expected
