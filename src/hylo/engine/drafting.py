"""The draft driver: every call the runner makes into the proposer, and the ring state drafting keeps.

`DraftDriver` owns, for one engine with a proposer:
- the proposer's observe and propose after each step: on the device before the step's read (a
  proposer that drafts from device tensors: `after_picks`), or on the host after it (`needs_host`:
  `after_read`), from the step's `StepCommit` (`step_commit`, which the picks fill in);
- the deferred ring of the decode graphs: a plain graph step that drafts nothing leaves its observe
  there (`decode_variant`), and the next step that observes first has the proposer
  observe what waits (`catch_up`), so it still sees every committed token in order;
- the drafts' way into a verify step (`feed_drafts`: the proposer's device rows into an eager batch)
  and back to the host for a constrained request, whose next verify masks each position after the
  drafts before it (`constrained_drafts` with the step's read, `give_drafts` into its results).

Invariants: the proposer observes every committed position exactly once and in order, before any
step that drafts from it; `Request.deferred_from` (where a request's waiting positions start) is
written by the scheduler's ledger alone, as each step is launched (`InFlightLedger.launched`: set by
a deferring step, cleared by any other, which catches up first) and on preemption; the driver reads
it. A position waits in the ring only while fewer than `DecodeGraphs.deferred_tokens` positions of
its request wait (`ring_has_room`, checked before each deferring step).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DEFER, DRAFT, OBSERVE, DecodeGraphs
from hylo.engine.picking import ChunkResult
from hylo.engine.request import Request
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.host_copy import to_device
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput
from hylo.speculative.proposer import HostCommit, Proposer, StepCommit


class DraftDriver:
    """Drives `proposer` for the runner of one engine (see the module). `graphs`: the engine's decode
    graphs, whose deferred ring holds the features of observes left for later (None: nothing defers).
    Safe to use from the engine's stepping thread only, like the runner."""

    def __init__(self, proposer: Proposer, caches: CacheManager, graphs: DecodeGraphs | None):
        self.proposer, self.caches, self.graphs = proposer, caches, graphs

    @property
    def capture_layers(self) -> tuple[int, ...]:
        """The target layers whose features an eager forward captures for the proposer."""
        return self.proposer.capture_layers

    def decode_variant(self, requests: Sequence[Request], draft: bool) -> tuple[str, bool]:
        """(variant, draft left to do) of a plain decode-graph step of `requests` whose graphs defer:
        one that drafts nothing leaves its observe in the ring while it has room (`DEFER`); one whose
        every row picks its raw argmax drafts inside its graph (`DRAFT`, nothing left to draft)."""
        if not draft and self.ring_has_room(requests):
            return DEFER, False
        if draft and all(r.picks_argmax for r in requests):
            return DRAFT, False
        return OBSERVE, draft

    def ring_has_room(self, requests: Sequence[Request]) -> bool:
        """Whether one more deferred observe of each of `requests` fits the decode graphs' ring."""
        room = self.graphs.deferred_tokens
        return all(r.deferred_from is None or r.num_computed - r.deferred_from < room for r in requests)

    def catch_up(self, requests: Sequence[Request]) -> None:
        """The proposer observes the deferred positions of `requests` (`Request.deferred_from ..
        num_computed - 1`, their features from the decode graphs' ring) in one eager batch."""
        pending = [r for r in requests if r.deferred_from is not None]
        if not pending:
            return
        chunks = [
            SequenceChunk(r.tokens(r.deferred_from, r.num_computed), r.deferred_from, r.slot, r.slot, False)
            for r in pending
        ]
        c = self.caches
        batch = ForwardBatch.build(chunks, c.table.table, c.tokens, c.states, c.kpool)
        device = batch.input_ids.device
        room = self.graphs.deferred_tokens
        ring = [(r.slot, p % room) for r in pending for p in range(r.deferred_from, r.num_computed)]
        index = to_device(ring, device, torch.long)
        features = self.graphs.deferred[index[:, 0], index[:, 1]]
        counts = to_device([r.num_computed - r.deferred_from for r in pending], device, torch.int32)
        none = torch.zeros(0, dtype=torch.long, device=device)
        anchors = torch.zeros(len(pending), dtype=torch.long, device=device)
        self.proposer.observe(batch, StepCommit(counts, anchors, none, features))

    def feed_drafts(self, batch: ForwardBatch, chunks: Sequence[ScheduledChunk]) -> None:
        """Copy each verify chunk's drafts from the proposer's device rows into the batch's input ids."""
        targets, rows, columns, offset = [], [], [], 0
        for ch in chunks:
            if ch.verify:
                n = ch.num_drafts
                targets += range(offset + 1, offset + 1 + n)
                rows += [ch.request.slot] * n
                columns += range(n)
            offset += ch.num_tokens
        if targets:
            device = batch.input_ids.device
            index = to_device([targets, rows, columns], device, torch.long)
            batch.input_ids[index[0]] = self.proposer.drafts[index[1], index[2]]

    def observe_picks(self, batch: ForwardBatch, forward: ForwardOutput, tokens: torch.Tensor) -> None:
        """The proposer observes an eager plain decode step (`batch`, its `forward`) launched ahead of
        its read, once its picks (`tokens [rows]`) are made: one committed token and one anchor per
        row, every row sampling."""
        n = tokens.shape[0]
        counts = torch.ones(n, dtype=torch.int32, device=tokens.device)
        sampling = torch.arange(n, device=tokens.device)
        self.proposer.observe(batch, StepCommit(counts, tokens, sampling, forward.features))

    def step_commit(
        self, chunks: Sequence[ScheduledChunk], forward: ForwardOutput, observed: bool, draft: bool
    ) -> StepCommit | None:
        """The commit of a step the runner picks eagerly (`forward`: its forward's output), for its
        picks to fill in: every chunk's tokens committed and no anchor yet (the plain picks write their
        anchors, a verify block its committed count and anchor), its sampling chunks drafting next.
        None when the proposer needs nothing from the step: its observe ran in its graph and it drafts
        nothing."""
        if not (self.proposer.needs_host or not observed or draft):
            return None
        device = forward.logits.device
        counts = to_device([ch.num_tokens for ch in chunks], device, torch.int32)
        anchors = torch.zeros(len(chunks), dtype=torch.long, device=device)
        sampling = [i for i, ch in enumerate(chunks) if ch.samples]
        return StepCommit(counts, anchors, to_device(sampling, device, torch.long), forward.features)

    def after_picks(self, batch: ForwardBatch, commit: StepCommit, observed: bool, draft: bool) -> None:
        """Before the step's read: a proposer that drafts from device tensors observes what the step
        committed (unless its graph did) and drafts for the next step (when `draft`)."""
        if self.proposer.needs_host:
            return
        if not observed and draft:
            self.proposer.observe_and_propose(batch, commit)
        elif not observed:
            self.proposer.observe(batch, commit)
        elif draft:
            self.proposer.propose(batch, commit)

    def after_read(
        self,
        batch: ForwardBatch,
        commit: StepCommit,
        chunks: Sequence[ScheduledChunk],
        results: Sequence[ChunkResult],
        draft: bool,
    ) -> None:
        """After the step's read: a `needs_host` proposer observes the step as the host read it
        (`StepCommit.host`) and drafts for the next step (when `draft`)."""
        if not self.proposer.needs_host:
            return
        offsets = itertools.accumulate(batch.extend_lens, initial=0)
        commit.host = [
            HostCommit(ch.request, ch.request.num_computed, r.committed, offset, r.tokens)
            for ch, r, offset in zip(chunks, results, offsets, strict=False)
        ]
        self.proposer.observe(batch, commit)
        if draft:
            self.proposer.propose(batch, commit)

    def keep_snapshot_features(self, batch: ForwardBatch, forward: ForwardOutput) -> None:
        """The features (of `forward`, the eager `batch`'s) of each prefix snapshot's last token the
        batch takes, for a proposer that resumes from a snapshot (`Proposer.needs_last_features`,
        `Proposer.resume`)."""
        offsets = [0, *itertools.accumulate(batch.extend_lens)]
        points = [(offsets[i] + k - 1, sid) for i, pts in batch.snapshot_points.items() for k, sid in pts]
        index = to_device(points, forward.features.device, torch.long)
        self.caches.snapshot_features[index[:, 1]] = forward.features[index[:, 0]]

    def constrained_drafts(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The drafts just made for the constrained requests (their next verify masks each position
        after the drafts before it), to come back with the step's read; None without any."""
        rows = [r.slot for r in requests if r.grammar is not None]
        if not rows or self.proposer.needs_host:
            return None
        return self.proposer.drafts[to_device(rows, self.proposer.drafts.device, torch.long)]

    @staticmethod
    def give_drafts(
        results: Sequence[ChunkResult], requests: Sequence[Request], drafts: torch.Tensor | None
    ) -> None:
        """Hand the constrained requests' drafts, as read (`constrained_drafts`), to their results."""
        if drafts is None:
            return
        rows = iter(drafts.tolist())
        for result, request in zip(results, requests, strict=True):
            if request.grammar is not None:
                result.drafts = next(rows)
