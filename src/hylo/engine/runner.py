"""One step on the device: scheduled chunks -> batch tensors -> model -> sampled tokens."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.engine.cuda_graph import DecodeGraphs
from hylo.engine.scheduler import ScheduledChunk
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.sampling import SampleRow, sample
from hylo.spec.proposer import Committed, Proposer
from hylo.spec.verify import verify


@dataclass
class ChunkResult:
    """Tokens the target picked after a chunk (one, or a verify step's accepted drafts + one) and
    how many of the chunk's tokens are now committed to the caches."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    committed: int
    accepted: int = 0


class ModelRunner:
    """Plain decode steps go through `graphs` when it accepts them (CUDA-graph replays of fixed-shape
    batches), everything else runs eagerly. `graphs` and a proposer exclude each other: a proposer
    observes every forward's captured features, which the graphs do not produce."""

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        seed: int,
        proposer: Proposer | None = None,
        graphs: DecodeGraphs | None = None,
    ):
        if graphs is not None and proposer is not None:
            raise ValueError("graphs: decode graphs cannot serve an engine with a speculative proposer")
        self.model = model
        self.caches = caches
        self.proposer = proposer
        self.graphs = graphs
        device = model.embed_tokens.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def step(self, chunks: Sequence[ScheduledChunk]) -> list[ChunkResult]:
        """Run the chunks; one result per chunk. The device-to-host reads are of the sampled tokens
        (and of logprobs, when asked)."""
        self._draft(chunks)
        c = self.caches
        seqs = [
            SequenceChunk(
                [ch.request.tokens(ch.request.num_computed, ch.request.num_computed + 1)[0], *ch.drafts]
                if ch.verify
                else ch.request.tokens(ch.request.num_computed, ch.request.num_computed + ch.num_tokens),
                ch.request.num_computed, ch.request.slot, ch.request.slot, ch.samples, ch.verify,
            )
            for ch in chunks
        ]  # fmt: skip
        if self.graphs is not None and self.graphs.accepts(seqs):
            batch, logits = self.graphs.run(seqs)
        else:
            batch = ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool)
            capture = self.proposer.capture_layers if self.proposer is not None else ()
            logits = self.model(batch, capture)

        results: list[ChunkResult | None] = [None] * len(chunks)
        plain = [i for i, ch in enumerate(chunks) if ch.samples and not ch.verify]
        verifying = [i for i, ch in enumerate(chunks) if ch.verify]
        rows_of = _logit_rows(chunks)
        if plain:
            rows = [
                SampleRow(r.params, r.prompt_ids, r.output_ids, r.generator, r.banned_ids())
                for r in (chunks[i].request for i in plain)
            ]
            picked = sample(logits[[rows_of[i][0] for i in plain]], rows, self.generator)
            for i, token, lp in zip(plain, picked.token_ids, picked.logprobs, strict=True):
                results[i] = ChunkResult([token], None if lp is None else [lp], chunks[i].num_tokens)
        if verifying:
            verdicts = verify(
                logits[[r for i in verifying for r in rows_of[i]]],
                [chunks[i].request for i in verifying], [chunks[i].drafts for i in verifying], self.generator,
            )  # fmt: skip
            self.model.commit(batch, [v.accepted + 1 for v in verdicts])
            for i, v in zip(verifying, verdicts, strict=True):
                results[i] = ChunkResult(v.tokens, v.logprobs, v.accepted + 1, v.accepted)
        for i, ch in enumerate(chunks):
            if results[i] is None:
                results[i] = ChunkResult([], None, ch.num_tokens)
        if self.proposer is not None:
            offsets = list(itertools.accumulate(batch.extend_lens, initial=0))[:-1]
            committed = [
                Committed(ch.request, ch.request.num_computed, r.committed, off)
                for ch, r, off in zip(chunks, results, offsets, strict=True)
            ]
            self.proposer.observe(batch, batch.features, committed)
        return results

    def _draft(self, chunks: Sequence[ScheduledChunk]) -> None:
        """Ask the proposer for each verify chunk's drafts; a chunk with none becomes a plain decode."""
        verifying = [ch for ch in chunks if ch.verify]
        if not verifying:
            return
        assert self.proposer is not None
        drafts = self.proposer.propose(
            [ch.request for ch in verifying], [ch.num_tokens - 1 for ch in verifying]
        )
        for ch, d in zip(verifying, drafts, strict=True):
            ch.drafts = list(d[: ch.num_tokens - 1])
            ch.num_tokens = 1 + len(ch.drafts)
            ch.verify = bool(ch.drafts)


def _logit_rows(chunks: Sequence[ScheduledChunk]) -> list[list[int]]:
    """Rows of the forward's logits that belong to each chunk (see `ForwardBatch.logits_index`)."""
    rows, n = [], 0
    for ch in chunks:
        count = ch.num_tokens if ch.verify else int(ch.samples)
        rows.append(list(range(n, n + count)))
        n += count
    return rows
