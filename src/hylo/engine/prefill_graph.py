"""Short prefill chunks as CUDA-graph replays: one graph per token bucket, a chunk padded to its bucket.

A prefill step of one sequence (a new prompt, a prefix-cache hit's remaining tokens, a chunk of a long
prompt) of n new tokens runs in the smallest bucket W >= n. The step uploads one small tensor from
pinned memory (the sequence's prefix length, request-table row, n and its tokens); the replay builds
the batch's metadata from it and the request table on the device (`uniform_metadata` with
`lengths`): the W - n padding tokens take the last token's position, write the scratch page and
complete no pool, so that no sequence ever reads them; KDA advances the state by the n real tokens
alone (device offsets: the batch's layout is `forward_batch.Padded`); the logits are the last real
token's. A device proposer that takes padded batches (`Proposer.observes_padded`) observes the chunk
inside the replay; its drafts for the next step come after sampling, eagerly.

Short prompts are where an eager prefill is host-bound: a few hundred kernel launches for a few
milliseconds of GPU work (RESULTS.md, S11-2). A chunk the graphs do not take runs eagerly: several
sequences in one step, a verify block or a decode step beside it, prompt logprobs, a prefix-cache
snapshot inside the chunk off the KDA chunks' boundaries (`CHUNK_TOKENS`: the kernels take those
on them; one at the chunk's end is copied after the replay), more tokens than the largest bucket.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from hylo.engine.graph_bank import GraphBank
from hylo.forward_batch import ForwardBatch, Padded, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.ops import kda as kda_ops
from hylo.ops.batch_metadata import uniform_metadata
from hylo.ops.kda import CHUNK_TOKENS
from hylo.speculative.proposer import Proposer, StepCommit

# The smallest token bucket: below it a bucket's graph costs the same as its padding.
MIN_PREFILL_BUCKET = 16


def prefill_buckets(max_tokens: int) -> list[int]:
    """Powers of two from `MIN_PREFILL_BUCKET` below `max_tokens`, then `max_tokens` itself."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    buckets, w = [], MIN_PREFILL_BUCKET
    while w < max_tokens:
        buckets.append(w)
        w *= 2
    return [*buckets, max_tokens]


def prefill_graph_refusal(model: Glm5NextForCausalLM, proposer: Proposer | None) -> str | None:
    """Why prefill chunks of `model` (with `proposer`) cannot replay a graph, None when they can."""
    if proposer is not None and (proposer.needs_host or not proposer.observes_padded):
        return f"the proposer ({type(proposer).__name__}) does not observe padded batches on the device"
    device = model.embed_tokens.weight.device
    for layer in model.layers:
        if layer.is_linear:
            why = kda_ops.device_offsets_refusal(device, layer.self_attn.lower_bound)
            if why is not None:
                return f"layer {layer.self_attn.layer_idx}: {why}"
    return None


class PrefillLayout:
    """The layout of a prefill step (a `graph_bank.BatchLayout`): one sequence of n new tokens padded
    to the bucket's W. A step uploads `[3 + W + ceil(W / CHUNK_TOKENS)]`: (prefix length, table row,
    n), the W token ids (past n: whatever an earlier step left, padding nobody reads), and the
    snapshot id after each KDA chunk (-1: none). The static batch (`Padded`) views its token ids,
    new-token count and snapshot ids in the uploaded inputs; at capture it holds one token at the start
    of the scratch row.

    Invariant: a static batch points at the scratch slot and at the slot of the last step it ran,
    nothing else; its host lists (`extend_lens`, `prefix_lens`, ...) are placeholders."""

    def __init__(self, caches: CacheManager):
        if caches.scratch_slot is None:
            raise ValueError(
                "caches: fixed-shape prefill batches need a scratch slot (MemoryPlan scratch=True)"
            )
        self.caches = caches

    def filler_inputs(self, width: int) -> torch.Tensor:
        inputs = torch.full((3 + width + -(-width // CHUNK_TOKENS),), -1, dtype=torch.long)
        inputs[: 3 + width] = 0
        inputs[1:3] = torch.tensor([self.caches.scratch_slot, 1])
        return inputs

    def static_batch(self, width: int, inputs: torch.Tensor) -> ForwardBatch:
        c = self.caches
        device = inputs.device
        prefix, row, n = inputs[:3, None]
        meta = uniform_metadata(prefix, row, width, c.table.table, c.kpool, c.scratch_slot, n)
        packed = torch.arange(width, device=device)
        return ForwardBatch(
            input_ids=inputs[3 : 3 + width],
            token_seq=torch.zeros(width, dtype=torch.long, device=device),
            req_to_token=c.table.table,
            pad_index=packed[None].clone(),
            pad_valid=torch.ones(1, width, dtype=torch.bool, device=device),
            logits_index=torch.zeros(1, dtype=torch.long, device=device),
            extend_lens=[width],
            prefix_lens=[0],
            verify_seqs=[],
            seq_rows=[c.scratch_slot],
            seq_slots=[c.scratch_slot],
            tokens=c.tokens,
            states=c.states,
            layout=Padded(
                lengths=inputs[2:3], chunk_snapshots=inputs[3 + width :], filler_row=c.scratch_slot
            ),
            snapshot_pool=c.snapshots,
            **meta,
        )

    def write_inputs(self, width: int, seqs: Sequence[SequenceChunk], host: torch.Tensor) -> None:
        (s,) = seqs
        n = len(s.token_ids)
        host[:3] = torch.tensor([s.prefix_len, s.table_row, n])
        host[3 : 3 + n] = torch.tensor(s.token_ids)
        chunk_ids = host[3 + width :]
        chunk_ids.fill_(-1)
        for point, sid in s.snapshots:
            if point < n:
                chunk_ids[point // CHUNK_TOKENS - 1] = sid

    def fill_metadata(self, static: ForwardBatch, inputs: torch.Tensor) -> None:
        """The step's metadata, in place, from the uploaded inputs (the token ids, new-token count and
        snapshot ids are views of them)."""
        width = static.input_ids.shape[0]
        prefix, row, n = inputs[:3, None]
        c = self.caches
        out = static.metadata_tensors()
        uniform_metadata(prefix, row, width, c.table.table, c.kpool, c.scratch_slot, n, out=out)
        static.logits_index.copy_(n - 1)


# A prefill bucket's one graph.
PREFILL = "prefill"


class PrefillGraphs:
    """Fixed-shape prefill batches of one sequence padded to the token buckets up to `max_tokens`
    (`bank`), captured as CUDA graphs when `capture` (in `pool`, shared with the decode graphs: they
    never replay at once).

    Invariant: the batch and output `run` returns stay valid until the next `run`."""

    kind, bucket_unit = "prefill", "tokens"
    bodies = warm_bodies = (PREFILL,)

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        max_tokens: int,
        capture: bool,
        proposer: Proposer | None = None,
        pool: tuple[int, int] | None = None,
    ):
        why = prefill_graph_refusal(model, proposer)
        if why is not None:
            raise ValueError(f"prefill graphs: {why}")
        self.layout = PrefillLayout(caches)
        self.model, self.caches, self.proposer = model, caches, proposer
        self.bank = GraphBank(self, prefill_buckets(max_tokens), caches.table.table.device, pool)
        if capture:
            self.bank.capture()

    @property
    def buckets(self) -> list[int]:
        return self.bank.buckets

    @property
    def observes(self) -> bool:
        """The proposer's observe runs inside the replay (nothing is left for the step to observe)."""
        return self.proposer is not None

    def accepts(self, seqs: Sequence[SequenceChunk]) -> bool:
        """One plain chunk of at most the largest bucket's tokens whose snapshots (if any) fall at its
        end or at multiples of `CHUNK_TOKENS` inside it (where the KDA kernels take them)."""
        if len(seqs) != 1:
            return False
        s = seqs[0]
        n = len(s.token_ids)
        return (
            not s.verify
            and not s.score
            and 1 <= n <= self.buckets[-1]
            and all(point == n or (0 < point < n and point % CHUNK_TOKENS == 0) for point, _ in s.snapshots)
        )

    def run(self, seqs: Sequence[SequenceChunk]) -> tuple[ForwardBatch, ForwardOutput]:
        """The step's padded batch (its bucket's static one) and its forward's output: the logits of
        the chunk's last token, `[1, vocab]`, and with a proposer the bucket's features; the chunk's
        snapshots are taken."""
        if not self.accepts(seqs):
            raise ValueError(
                f"seqs: a prefill graph takes one chunk of 1 to {self.buckets[-1]} tokens that neither "
                f"verifies nor scores its prompt, its snapshots at its end or at multiples of {CHUNK_TOKENS}"
            )
        bucket = self.bank.bucket_for(len(seqs[0].token_ids))
        self.bank.upload(bucket, seqs)
        logits, *features = self.bank.replay(bucket, PREFILL)
        out = ForwardOutput(logits, *features)
        self._snapshot(seqs[0], out.features)
        return self.bank.static[bucket], out

    def body(self, name: str, bucket: int) -> tuple[torch.Tensor, ...]:
        """`(logits [1, vocab],)` of the bucket's static batch, and its features after them where the
        forward captures some; a proposer observes the chunk."""
        static = self.bank.static[bucket]
        self.layout.fill_metadata(static, self.bank.step_inputs[bucket])
        if self.proposer is None:
            return (self.model(static).logits,)
        out = self.model(static, self.proposer.capture_layers)
        device = out.logits.device
        lengths, anchors = static.layout.lengths.int(), out.logits.argmax(-1)
        commit = StepCommit(lengths, anchors, torch.arange(1, device=device), out.features)
        self.proposer.observe(static, commit)
        return (out.logits,) if out.features is None else (out.logits, out.features)

    def _snapshot(self, s: SequenceChunk, features: torch.Tensor | None) -> None:
        """Complete the chunk's snapshots: one at its end takes the slot's KDA state (those inside it
        the kernels took); each, the features of its last token (of the forward's `features`), for a
        proposer that resumes from them."""
        c = self.caches
        for point, sid in s.snapshots:
            if point == len(s.token_ids):
                c.snapshots.conv[:, sid] = c.states.conv[:, s.state_slot]
                c.snapshots.recurrent[:, sid] = c.states.recurrent[:, s.state_slot]
            if c.snapshot_features.shape[1] and features is not None:
                c.snapshot_features[sid] = features[point - 1]
