"""One step on the device: scheduled chunks -> batch tensors -> model -> sampled tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hylo.engine.scheduler import ScheduledChunk
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.sampling import SampleResult, SampleRow, sample


class ModelRunner:
    def __init__(self, model: Glm5NextForCausalLM, caches: CacheManager, seed: int):
        self.model = model
        self.caches = caches
        device = model.embed_tokens.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def step(self, chunks: Sequence[ScheduledChunk]) -> SampleResult:
        """Run the chunks and sample for those that complete their request's input. The only
        device-to-host read is of the sampled tokens (and logprobs)."""
        c = self.caches
        seqs = [
            SequenceChunk(
                ch.request.tokens(ch.request.num_computed, ch.request.num_computed + ch.num_tokens),
                ch.request.num_computed,
                ch.request.slot,
                ch.request.slot,
                ch.samples,
            )
            for ch in chunks
        ]
        batch = ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool)
        logits = self.model(batch)
        rows = [
            SampleRow(r.params, r.prompt_ids, r.output_ids, r.generator, r.banned_ids())
            for r in (ch.request for ch in chunks if ch.samples)
        ]
        if not rows:
            return SampleResult([], [])
        return sample(logits, rows, self.generator)
