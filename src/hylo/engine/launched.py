"""A launched step: what it does on the device after its forward, up to the start of its one read,
and what that read becomes (one result per chunk).

The ways a step picks are a closed set, one class each (`StepPicks`):
- `PicksAtOnce`: a step read at once after an eager, decode-graph or prefill-graph forward: the
  picks, the verify blocks' acceptance and KDA commit and the prompt logprobs (`picking`), with the
  proposer's commit around them (`DraftDriver`: before the read, or after it for a `needs_host` one);
- `PicksAhead`: a plain decode step run ahead: each row's pick into `CacheManager.last_sampled`
  (where the next step's in-flight tokens come from), at launch or, where a row is constrained, once
  the step before it has been read and applied; an eager forward's observe after the picks;
- `VerifyReplay`: a verify step as the verify graphs' replays (forward, acceptance, KDA commit, the
  proposer's observe and drafts).
`start` launches the picks and starts the read; `results` turns the read into results for the chunks
as the scheduler's ledger leaves them (the blocks of a verify step run ahead are cut first).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from hylo.engine import picking
from hylo.engine.chunk import ScheduledChunk
from hylo.engine.drafting import DraftDriver
from hylo.engine.picking import ChunkResult
from hylo.engine.reader import Logprobs, PendingRead, Reader, StepRead
from hylo.engine.route import Path, StepRoute
from hylo.engine.verify_graph import VerifyGraphs
from hylo.forward_batch import ForwardBatch
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.speculative.proposer import StepCommit


@dataclass(frozen=True)
class PickParts:
    """What every step's picks use, one set per runner (`ModelRunner.parts`): the model (its vocabulary
    and KDA commit), the rows' last picks (`CacheManager.last_sampled`), the draft driver (None
    without a proposer) and the engine's reader."""

    model: Glm5NextForCausalLM
    last_sampled: torch.Tensor
    drafting: DraftDriver | None
    reader: Reader


class StepPicks(Protocol):
    def start(self) -> PendingRead:
        """Launch the step's picks on the device and start its one read (nothing waits)."""

    def results(self, chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
        """One result per chunk of `chunks` from the step's read, on the host."""


@dataclass
class LaunchedStep:
    """A step launched on the device (`ModelRunner.launch`) whose results are on their way to the host
    (`read`; None for a step run ahead whose picks wait for the read before it:
    `ModelRunner.sample_launched`); `ModelRunner.collect` turns them into one result per chunk."""

    chunks: list[ScheduledChunk]
    route: StepRoute
    picks: StepPicks
    read: PendingRead | None = None

    @property
    def verifies(self) -> bool:
        return self.chunks[0].verify


@dataclass(eq=False)
class _PicksOfForward:
    """Picks from the step's own forward of `batch`: `start` drops the forward and keeps of the batch
    only what the read still needs."""

    parts: PickParts
    chunks: Sequence[ScheduledChunk]
    route: StepRoute
    batch: ForwardBatch | None
    forward: ForwardOutput | None


@dataclass(eq=False)
class PicksAtOnce(_PicksOfForward):
    """The picks of a step read at once, from its forward of `batch` (see the module)."""

    # what the proposer observes of the step (`DraftDriver.step_commit`)
    commit: StepCommit | None = field(default=None, init=False)

    def start(self) -> PendingRead:
        p, chunks, route, batch, forward = self.parts, self.chunks, self.route, self.batch, self.forward
        drafting, layout, draft, logits = p.drafting, route.layout, route.draft, forward.logits
        if drafting is not None:
            self.commit = drafting.step_commit(chunks, forward, route.observed, draft)
        picked = picking.sample_plain(chunks, layout, batch, logits, p.last_sampled, self.commit)
        acceptance = picking.accept_blocks(chunks, layout, batch, forward, p.model, self.commit)
        if self.commit is not None:
            drafting.after_picks(batch, self.commit, route.observed, draft)
        scored = picking.score_prompts(logits, chunks, layout)
        requests = [ch.request for ch in chunks]
        drafts = drafting.constrained_drafts(requests) if drafting is not None and draft else None
        # what the step still needs is the commit and batch a `needs_host` proposer observes after the read
        self.forward, self.batch = None, self.batch if self.commit is not None else None
        return p.reader.start(picking.step_read(picked, acceptance, scored, drafts))

    def results(self, chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
        results = picking.step_results(chunks, self.route.layout, read)
        DraftDriver.give_drafts(results, [ch.request for ch in chunks], read.drafts)
        if self.commit is not None:  # a `needs_host` proposer observes what was read
            self.parts.drafting.after_read(self.batch, self.commit, chunks, results, self.route.draft)
        return results


class PicksAhead(_PicksOfForward):
    """The picks of a plain decode step run ahead, from its forward of `batch` (see the module). They
    count the step's own token in flight (`sampling_batch`'s `counted`) where they wait for the read
    before them: the scheduler's ledger counted it at launch."""

    def start(self) -> PendingRead:
        p, forward = self.parts, self.forward
        counted = self.route.run_ahead.picks_after_read
        picked = picking.sample_launched(self.chunks, self.batch, forward.logits, p.last_sampled, counted)
        if p.drafting is not None and self.route.path is Path.EAGER:  # it observes after its picks
            p.drafting.observe_picks(self.batch, forward, picked.tokens)
        self.batch = self.forward = None
        return p.reader.start(StepRead(tokens=picked.tokens, token_logprobs=Logprobs.of(picked)))

    def results(self, chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
        return picking.launched_results(chunks, read)


class VerifyReplay:
    """A verify step as `graphs`' replays of the route's blocks (see the module): its acceptance, and
    for a step read at once the constrained requests' next drafts, are what its read takes."""

    def __init__(
        self, parts: PickParts, chunks: Sequence[ScheduledChunk], route: StepRoute, graphs: VerifyGraphs
    ):
        self.parts, self.chunks, self.route, self.graphs = parts, chunks, route, graphs

    def start(self) -> PendingRead:
        p, chunks, requests = self.parts, self.chunks, [ch.request for ch in self.chunks]
        verifying = picking.verify_blocks(chunks, self.graphs.tokens_per_seq, p.model)
        acceptance = self.graphs.run(self.route.seqs, verifying)
        logprobs = Logprobs.of(acceptance)
        read = StepRead(accepted=acceptance.accepted, emitted=acceptance.emitted, block_logprobs=logprobs)
        read.drafts = None if self.route.ahead else p.drafting.constrained_drafts(requests)
        return p.reader.start(read)

    def results(self, chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
        results = picking.verify_results(chunks, read)
        DraftDriver.give_drafts(results, [ch.request for ch in chunks], read.drafts)
        return results
