"""Plain decode steps as CUDA-graph replays, one graph per batch-size bucket and variant (a `GraphBank`).

A plain decode step (every sequence feeds one token and samples, no verify chunk) of B sequences
runs in the smallest bucket >= B: the step uploads one small tensor from pinned memory (each
sequence's prefix length, request-table row and token; filler sequences on the cache manager's
scratch slot pad it to the bucket), the replay builds the batch's metadata from it and the request
table on the device (`uniform_metadata`: positions, cache slots, completed pools, a pool table as
wide as the request table), runs the forward, and the first B rows of its logits are the step's.
Sampling stays outside the graph. Any other step runs eagerly.

`UniformBlocks` is the layout decode steps share with verify steps (`verify_graph`): every sequence
of a bucket feeds the same number of tokens.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from hylo.engine.graph_bank import GraphBank
from hylo.engine.request import IN_FLIGHT
from hylo.forward_batch import FixedShape, ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.ops.batch_metadata import InFlight, uniform_metadata
from hylo.speculative.proposer import Proposer, StepCommit

# A plain decode step that drafts nothing leaves a device proposer's observe for later: the step's
# target features wait in a ring of positions per request (`DecodeGraphs.deferred`) until a step
# that observes (one that drafts, runs eagerly or verifies) or a full ring has the proposer observe
# them in one batch, its weights read once for all of them. The ring holds as many positions as
# DEFERRED_RING_BYTES allow for every request-table row, within these bounds.
MIN_DEFERRED_TOKENS, MAX_DEFERRED_TOKENS = 32, 256
DEFERRED_RING_BYTES = 256 * 2**20

# What a decode graph does with a device proposer (its variants, one graph each per bucket): observe
# the step (`OBSERVE`, also the only one without such a proposer), leave the observe for later
# (`DEFER`), or observe and draft from the greedy picks (`DRAFT`).
OBSERVE, DEFER, DRAFT = "observe", "defer", "draft"


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below `max_batch_size`, then `max_batch_size` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    small = [b for b in (1, 2, 4) if b < max_batch_size]
    return [*small, *range(8, max_batch_size, 8), max_batch_size]


class UniformBlocks:
    """The layout of a bucket of sequences that each feed `width` tokens after their prefix (a
    `graph_bank.BatchLayout`). A step uploads `[fields, bucket]`: per sequence its prefix length,
    request-table row and first token (`IN_FLIGHT`: the token its row sampled last,
    `CacheManager.last_sampled`), and with `after_commit` whether it starts after the commit of a
    verify step still in flight on its row (then `CacheManager.last_committed` of the row is added to
    its prefix length). Filler sequences feed `width` tokens at the start of the scratch slot's row.

    Invariant: a static batch points at the scratch slot and at the slots of the last step it ran,
    nothing else; its pool table is as wide as the request table, a step filling its first columns."""

    def __init__(self, caches: CacheManager, width: int, after_commit: bool = False):
        if caches.scratch_slot is None:
            raise ValueError(
                "caches: fixed-shape decode batches need a scratch slot (MemoryPlan scratch=True)"
            )
        self.caches, self.width, self.after_commit = caches, width, after_commit
        self.pool_width = caches.table.table.shape[1] // caches.kpool

    def row(self, seq: SequenceChunk) -> tuple[int, ...]:
        """What a step uploads of `seq`."""
        flag = (int(seq.after_commit),) if self.after_commit else ()
        return seq.prefix_len, seq.table_row, seq.token_ids[0], *flag

    def filler(self) -> tuple[int, ...]:
        """What a step uploads of a filler sequence (the scratch slot's row, at its start)."""
        return 0, self.caches.scratch_slot, 0, *((0,) if self.after_commit else ())

    def filler_inputs(self, bucket: int) -> torch.Tensor:
        return torch.tensor([self.filler()] * bucket).t().contiguous()

    def static_batch(self, bucket: int, inputs: torch.Tensor) -> ForwardBatch:
        """A batch of `bucket` filler sequences, its pool table as wide as the request table's (its
        metadata is filled from `inputs` by `fill_metadata`, not viewed)."""
        c = self.caches
        fixed = FixedShape(bucket, self.pool_width, c.scratch_slot, self.width, c.kpool)
        batch = ForwardBatch.build([], c.table.table, c.tokens, c.states, c.kpool, fixed=fixed)
        full_width = torch.full((bucket, self.pool_width), -1, device=batch.pool_table.device)
        return dataclasses.replace(batch, pool_table=full_width)

    def write_inputs(self, bucket: int, seqs: Sequence[SequenceChunk], host: torch.Tensor) -> None:
        rows = [self.row(s) for s in seqs] + [self.filler()] * (bucket - len(seqs))
        host.copy_(torch.tensor(rows).t())

    def fill_metadata(self, static: ForwardBatch, inputs: torch.Tensor) -> None:
        """The step's batch metadata, in place, from the uploaded `inputs` and the request table, and
        each sequence's first token (`uniform_metadata` with an `InFlight`: one launch on CUDA)."""
        c = self.caches
        prefix, rows, first = inputs[0], inputs[1], inputs[2]
        after = (inputs[3], c.last_committed) if self.after_commit else (None, None)
        ids = static.input_ids.view(len(static.extend_lens), self.width)[:, 0]
        in_flight = InFlight(first, IN_FLIGHT, c.last_sampled, ids, *after)
        uniform_metadata(
            prefix, rows, self.width, c.table.table, c.kpool, c.scratch_slot,
            out=static.metadata_tensors(), in_flight=in_flight,
        )  # fmt: skip


class DecodeGraphs:
    """Fixed-shape decode batches for the buckets up to `max_batch_size` (`bank`), captured as CUDA
    graphs when `capture` (into `pool` when given: a CUDA graph memory pool to share, the decode and
    verify graphs never replay at once).

    With a `proposer`, the forward also captures its features (the step's output holds them) and, for
    one that drafts from device tensors, its observe runs inside the graph too; each bucket then has
    two more variants: a deferring one, whose step writes the features to the `deferred` ring
    (`[request-table rows, deferred_tokens, features]`) instead of running the observe (for steps that
    draft nothing), and a drafting one, whose step also drafts for the next from each sequence's argmax
    (for steps whose every row picks its raw argmax).

    Invariant: the batch and output `run` returns stay valid until the next `run`.
    """

    kind, bucket_unit = "decode", "batch sizes"
    tokens_per_seq = 1

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        max_batch_size: int,
        capture: bool,
        proposer: Proposer | None = None,
        pool: tuple[int, int] | None = None,
    ):
        self.layout = UniformBlocks(caches, self.tokens_per_seq)
        self.model, self.caches, self.proposer = model, caches, proposer
        self.deferred: torch.Tensor | None = None
        self.deferred_tokens = 0
        if self.defers:
            self._make_ring()
        self.bodies = (OBSERVE, DEFER, DRAFT) if self.defers else (OBSERVE,)
        self.warm_bodies = (DRAFT,) if self.defers else (OBSERVE,)
        device = caches.table.table.device
        self.bank = GraphBank(self, batch_size_buckets(max_batch_size), device, pool)
        if capture:
            self.bank.capture()

    def _make_ring(self) -> None:
        """The deferred ring: as many positions per request-table row as `DEFERRED_RING_BYTES` hold."""
        width = len(self.proposer.capture_layers) * self.model.config.hidden_size
        weight = self.model.embed_tokens.weight
        rows = self.caches.table.table.shape[0]
        fits = DEFERRED_RING_BYTES // max(1, rows * width * weight.element_size())
        self.deferred_tokens = max(MIN_DEFERRED_TOKENS, min(MAX_DEFERRED_TOKENS, fits))
        shape = (rows, self.deferred_tokens, width)
        self.deferred = torch.zeros(shape, dtype=weight.dtype, device=weight.device)

    @property
    def buckets(self) -> list[int]:
        return self.bank.buckets

    @property
    def observes(self) -> bool:
        """The proposer's observe runs inside the replay (nothing is left for the step to observe)."""
        return self.proposer is not None and not self.proposer.needs_host

    @property
    def defers(self) -> bool:
        """A step may leave its observe for later (a proposer that observes from device tensors)."""
        return self.observes

    def accepts(self, seqs: Sequence[SequenceChunk]) -> bool:
        """A plain decode step that fits the largest bucket."""
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == 1 and s.sample and not s.verify and not s.score for s in seqs
        )

    def run(
        self, seqs: Sequence[SequenceChunk], variant: str = OBSERVE
    ) -> tuple[ForwardBatch, ForwardOutput]:
        """The step's padded batch (the bucket's static one) and its forward's output: the logits of
        its sequences, `[len(seqs), vocab]`, in order, and with a proposer the whole bucket's
        features. `DEFER` and `DRAFT` only where `defers`: with `DEFER` the step's features go to the
        deferred ring at each sequence's (table row, position % deferred_tokens) instead of to the
        proposer's observe (the caller keeps track of what waits there: `Request.deferred_from`);
        with `DRAFT` the proposer also drafts, anchored on each sequence's argmax (right for
        raw-argmax rows only: the caller's choice)."""
        if not self.accepts(seqs):
            raise ValueError(
                f"seqs: a fixed-shape decode takes up to {self.buckets[-1]} sequences of one sampled "
                "token each"
            )
        if variant != OBSERVE and not self.defers:
            raise ValueError(f"variant: {variant} needs decode graphs of a device proposer")
        bucket = self.bank.bucket_for(len(seqs))
        self.bank.upload(bucket, seqs)
        logits, *features = self.bank.replay(bucket, variant)
        return self.bank.static[bucket], ForwardOutput(logits[: len(seqs)], *features)

    def body(self, name: str, bucket: int) -> tuple[torch.Tensor, ...]:
        """What the replay of variant `name` computes: `(logits,)` of the bucket's static batch, and
        its features after them where the forward captures some."""
        static = self.bank.static[bucket]
        self.layout.fill_metadata(static, self.bank.step_inputs[bucket])
        if self.proposer is None:
            return (self.model(static).logits,)
        out = self.model(static, self.proposer.capture_layers)
        if name == DEFER:  # filler sequences write the scratch row's ring
            if out.features is not None:  # (a proposer may read no features)
                ring = static.positions % self.deferred_tokens
                self.deferred[static.state_slots, ring] = out.features
        elif self.observes:
            device = out.logits.device
            ones = torch.ones(bucket, dtype=torch.int32, device=device)
            anchors, sampling = out.logits.argmax(-1), torch.arange(bucket, device=device)
            commit = StepCommit(ones, anchors, sampling, out.features)
            if name == DRAFT:
                self.proposer.observe_and_propose(static, commit)
            else:
                self.proposer.observe(static, commit)
        return (out.logits,) if out.features is None else (out.logits, out.features)
