"""One step on the device: scheduled chunks -> batch tensors -> model -> picked tokens, read once.

The runner routes a step (an eager forward, or a decode-, verify- or prefill-graph replay) and
builds its eager batch; what the logits become is `engine/picking.py`'s (the picks, acceptance and
prompt logprobs on the device, the results after the read), every proposer call is the draft
driver's (`engine/drafting.py`), the one read the reader's (`engine/reader.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hylo.engine import picking
from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DEFER, OBSERVE, DecodeGraphs
from hylo.engine.drafting import DraftDriver
from hylo.engine.picking import ChunkResult, PickLayout
from hylo.engine.prefill_graph import PrefillGraphs
from hylo.engine.reader import Logprobs, PendingRead, Reader, StepRead
from hylo.engine.request import IN_FLIGHT, Request
from hylo.engine.verify_graph import VerifyGraphs
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.speculative.proposer import Proposer


@dataclass
class LaunchedStep:
    """A step launched on the device (`ModelRunner.launch`) whose picks are on their way to the host
    (`read`); `ModelRunner.collect` turns them into results. A plain decode step's requests already
    count its token as computed and its pick as in flight (`Request.in_flight`); a verify step's count
    it as verifying (`Request.verifying`). Launched without its picks, `read` is None and `logits` the
    forward's until `ModelRunner.sample_launched`."""

    chunks: list[ScheduledChunk]
    read: PendingRead | None
    logits: torch.Tensor | None = None
    # an eager step's batch and forward, for the proposer's observe after its picks
    observing: tuple[ForwardBatch, ForwardOutput] | None = None

    @property
    def verifies(self) -> bool:
        return self.chunks[0].verify


class ModelRunner:
    """Plain decode steps go through `graphs` when it accepts them, verify steps through
    `verify_graphs`, one-sequence prefill chunks through `prefill_graphs` (CUDA-graph replays of
    fixed-shape batches); everything else runs eagerly.

    A speculative step (eager or replayed) is device work from the batch upload to the one read of
    the picked tokens: drafts come from the proposer's device rows, acceptance, the KDA commit, the
    proposer's observe and its next drafts all run before that read (a `needs_host` proposer's after).
    With a proposer, `graphs` must have been captured with it: a proposer observes every forward's
    features, which those graphs then produce (and observe inside, for a device-side proposer). A
    plain graph step that drafts nothing defers that observe (the `DEFER` graphs); the next step that
    observes first has the proposer observe what waits (`DraftDriver.catch_up`), so the proposer still
    sees every committed token in order. A plain graph step of raw-argmax rows that drafts does so in
    its graph (`DRAFT`)."""

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        seed: int,
        proposer: Proposer | None = None,
        graphs: DecodeGraphs | None = None,
        verify_graphs: VerifyGraphs | None = None,
        prefill_graphs: PrefillGraphs | None = None,
    ):
        for name, captured in (("graphs", graphs), ("prefill_graphs", prefill_graphs)):
            if captured is not None and captured.proposer is not proposer:
                raise ValueError(
                    f"{name}: graphs serve an engine with a proposer only when captured with it (its "
                    "features, and its observe for a proposer that drafts on the device)"
                )
        self.model, self.caches, self.proposer = model, caches, proposer
        self.graphs, self.verify_graphs, self.prefill_graphs = graphs, verify_graphs, prefill_graphs
        self.drafting = None if proposer is None else DraftDriver(proposer, caches, graphs)
        device = model.embed_tokens.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.reader = Reader()  # this engine's pinned read buffers (`Engine.close` empties them)

    def step(self, chunks: Sequence[ScheduledChunk], draft: bool = True) -> list[ChunkResult]:
        """Run the chunks; one result per chunk. The one device-to-host read is of the picked tokens
        (and of logprobs, when asked). Without `draft` the proposer only observes the step (its drafts
        are not needed next step); a replayed verify step drafts regardless."""
        targets = [picking.prompt_targets(ch) for ch in chunks]  # prompt positions each chunk scores
        seqs = [_sequence(ch, bool(t[1])) for ch, t in zip(chunks, targets, strict=True)]
        requests = [ch.request for ch in chunks]
        snapshots = any(ch.snapshots for ch in chunks)  # only eager forwards take prefix snapshots
        plain_graph = not snapshots and self.graphs is not None and self.graphs.accepts(seqs)
        variant = OBSERVE
        if plain_graph and self.graphs.defers:
            variant, draft = self.drafting.decode_variant(requests, draft)
        if variant != DEFER and self.drafting is not None:  # this step observes: all before it first
            self.drafting.catch_up(requests)
        full = None if snapshots else self._full_blocks(seqs)
        if full is not None and self.verify_graphs.accepts(full):  # a replay read at once
            read = self.reader.read(self._replay_verify(chunks, full, draft_rows=True))
            results = picking.verify_results(chunks, read)
            DraftDriver.give_drafts(results, requests, read.drafts)
            return results
        observed = False
        if plain_graph:
            batch, forward = self.graphs.run(seqs, variant)
            observed = self.graphs.observes  # or deferred: nothing is left to observe now either
            if variant == DEFER:
                self.drafting.mark_deferred(requests)
        elif self.prefill_graphs is not None and self.prefill_graphs.accepts(seqs):
            batch, forward = self.prefill_graphs.run(seqs)  # takes the chunk's snapshots too
            observed = self.prefill_graphs.observes
        else:
            batch, forward = self._eager_forward(chunks, seqs, snapshots)
        return self._pick(chunks, batch, forward, observed, draft, PickLayout.of(chunks, targets))

    def _replay_verify(
        self, chunks: Sequence[ScheduledChunk], blocks: list[SequenceChunk], draft_rows: bool
    ) -> StepRead:
        """The verify graphs' replay of the step's `blocks` (at their width) and what its read takes:
        the acceptance, and with `draft_rows` the constrained requests' next drafts."""
        verifying = picking.verify_blocks(chunks, self.verify_graphs.tokens_per_seq, self.model)
        acceptance = self.verify_graphs.run(blocks, verifying, self.generator)
        requests = [ch.request for ch in chunks]
        return StepRead(
            accepted=acceptance.accepted, emitted=acceptance.emitted, block_logprobs=Logprobs.of(acceptance),
            drafts=self.drafting.constrained_drafts(requests) if draft_rows else None,
        )  # fmt: skip

    def _eager_forward(
        self, chunks: Sequence[ScheduledChunk], seqs: list[SequenceChunk], snapshots: bool
    ) -> tuple[ForwardBatch, ForwardOutput]:
        """The step's batch built and run eagerly (a verify chunk's drafts fed from the proposer's
        rows, the features a resuming proposer needs kept with the prefix snapshots)."""
        c = self.caches
        batch = ForwardBatch.build(
            seqs, c.table.table, c.tokens, c.states, c.kpool, snapshot_pool=c.snapshots
        )
        if self.drafting is not None:
            self.drafting.feed_drafts(batch, chunks)
        capture = self.drafting.capture_layers if self.drafting is not None else ()
        forward = self.model(batch, capture)
        if snapshots and c.snapshot_features.shape[1]:
            self.drafting.keep_snapshot_features(batch, forward)
        return batch, forward

    def overlaps(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """Whether `launch` takes the step: plain decode chunks (one token each, sampled), scoring no
        prompt position. With a proposer, one that observes from device tensors, and the step either a
        decode-graph replay that defers its observe (room left in the ring) or an eager forward with
        nothing deferred before it (it observes at once; what waits would need tokens still in flight).
        Or a verify step the verify graphs take whose acceptance is theirs (`_verify_overlaps`)."""
        if any(ch.verify for ch in chunks):
            return self._verify_overlaps(chunks)
        plain = all(
            ch.num_tokens == 1 and ch.samples and not ch.verify and not ch.snapshots
            and not ch.request.scores_prompt
            for ch in chunks
        )  # fmt: skip
        if not plain or self.proposer is None:
            return plain
        if self.proposer.needs_host:
            return False
        requests = [ch.request for ch in chunks]
        if self.graphs is not None and self.graphs.accepts([_sequence(ch, False) for ch in chunks]):
            return self.graphs.defers and self.drafting.ring_has_room(requests)
        return all(r.deferred_from is None for r in requests)

    def _verify_overlaps(self, chunks: Sequence[ScheduledChunk]) -> bool:
        """A verify step that is device work from upload to read, with the blocks the schedule that
        reads every step would verify: the verify graphs take its blocks, and every row has no observe
        deferred and no grammar, and either picks its raw argmax (a block launched ahead is cut to its
        draft budget once read) or samples with what it knows before the read (`_samples_ahead`)."""
        if self.verify_graphs is None or not all(ch.verify for ch in chunks):
            return False
        width = self.verify_graphs.tokens_per_seq
        on_device = all(
            r.grammar is None and r.deferred_from is None and (r.picks_argmax or _samples_ahead(r, width))
            for r in (ch.request for ch in chunks)
        )
        return on_device and self._verify_blocks(chunks) is not None

    def _verify_blocks(self, chunks: Sequence[ScheduledChunk]) -> list[SequenceChunk] | None:
        """The verify step's blocks at the graphs' width (`_full_blocks`), None where one cannot grow."""
        return self._full_blocks([_sequence(ch, False) for ch in chunks])

    def launch(self, chunks: Sequence[ScheduledChunk], sample_now: bool = True) -> LaunchedStep:
        """Launch a plain decode step (`overlaps`) without waiting for it: the forward (a decode-graph
        replay where it fits), the picks, each row's pick into `CacheManager.last_sampled` (where the
        next step's in-flight tokens come from) and the copy of the picks to the host. A chunk may feed
        an in-flight token (`Request.tokens`). Without `sample_now` only the forward is launched:
        `sample_launched` picks later, once the step before has been applied (a constrained row's
        grammar must have taken its token first). With a proposer the step drafts nothing: a replay
        leaves its observe in the deferred ring, an eager forward's observe runs after its picks.

        A verify step (`_verify_overlaps`) replays the verify graphs, its blocks starting after the
        commit of the verify step ahead of it where that one is unread (`SequenceChunk.after_commit`),
        and starts the read of its acceptance."""
        if chunks[0].verify:
            read = self.reader.start(
                self._replay_verify(chunks, self._verify_blocks(chunks), draft_rows=False)
            )
            return LaunchedStep(list(chunks), read)
        seqs = [_sequence(ch, False) for ch in chunks]
        c, drafting = self.caches, self.drafting
        observing = None
        if self.graphs is not None and self.graphs.accepts(seqs):
            _, forward = self.graphs.run(seqs, OBSERVE if drafting is None else DEFER)
            if drafting is not None:
                drafting.mark_deferred([ch.request for ch in chunks])
        else:
            batch = ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool)
            ids = batch.input_ids  # an in-flight token is its row's last pick, as the decode graphs take it
            ids.copy_(torch.where(ids == IN_FLIGHT, c.last_sampled[batch.token_rows], ids))
            forward = self.model(batch, drafting.capture_layers if drafting is not None else ())
            observing = (batch, forward) if drafting is not None else None
        launched = LaunchedStep(list(chunks), None, forward.logits, observing)
        if sample_now:
            self._sample(launched, own_counted=False)
        return launched

    def sample_launched(self, launched: LaunchedStep) -> None:
        """The picks of a step launched without them, its requests' bookkeeping counting its token in
        flight already (`Engine`); rows of requests that ended meanwhile pick unconstrained (dropped)."""
        self._sample(launched, own_counted=True)

    def _sample(self, launched: LaunchedStep, own_counted: bool) -> None:
        """The launched step's picks (`picking.sample_launched`), the proposer's observe of an eager
        forward, and the start of the read."""
        picked = picking.sample_launched(
            launched.chunks, launched.logits, self.generator, self.caches.last_sampled, own_counted
        )
        if launched.observing is not None:  # what `_pick` has the proposer observe of a plain step
            self.drafting.observe_picks(*launched.observing, picked.tokens)
            launched.observing = None
        read = StepRead(tokens=picked.tokens, token_logprobs=Logprobs.of(picked))
        launched.read, launched.logits = self.reader.start(read), None

    @staticmethod
    def collect(launched: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step's picks: one result per chunk, as `step` gives them (a verify
        step's `chunks` first cut to the blocks the requests' draft budgets allow)."""
        read = launched.read.wait()
        if not launched.verifies:
            return picking.launched_results(launched.chunks, read)
        # a block launched ahead is whole: it is cut to what the request's draft budget allows now
        # that the step before it has been applied, the block a step scheduled then would have held
        launched.chunks = [
            replace(ch, num_tokens=min(ch.num_tokens, 1 + ch.request.draft_budget(ch.num_drafts)))
            for ch in launched.chunks
        ]
        return picking.verify_results(launched.chunks, read)

    def _full_blocks(self, seqs: list[SequenceChunk]) -> list[SequenceChunk] | None:
        """The verify step as blocks of the verify graphs' width: shorter blocks (a request within a
        block of its token limit) verify placeholder drafts up to the width, where the request table
        has room for them. None when the step is not all verify blocks or a block cannot grow."""
        graphs = self.verify_graphs
        if graphs is None or not all(s.verify for s in seqs):
            return None
        width, room = graphs.tokens_per_seq, self.caches.table.table.shape[1]
        # a block after a commit in flight starts up to a block later
        if any(s.prefix_len + width * (1 + s.after_commit) > room or len(s.token_ids) > width for s in seqs):
            return None
        return [
            SequenceChunk([*s.token_ids, *[0] * (width - len(s.token_ids))], s.prefix_len, s.table_row,
                          s.state_slot, True, True, after_commit=s.after_commit)
            for s in seqs
        ]  # fmt: skip

    def _pick(
        self,
        chunks: Sequence[ScheduledChunk],
        batch: ForwardBatch,
        forward: ForwardOutput,
        observed: bool,
        draft: bool,
        layout: PickLayout,
    ) -> list[ChunkResult]:
        """The picks of an eagerly picked step (`engine/picking.py`), the proposer's commit before the
        read and after it (`DraftDriver`), and the one read."""
        drafting = self.drafting
        logits = forward.logits
        commit = None if drafting is None else drafting.step_commit(chunks, forward, observed, draft)
        picked = picking.sample_plain(
            chunks, layout, logits, self.generator, self.caches.last_sampled, commit
        )
        acceptance = picking.accept_blocks(chunks, layout, batch, forward, self.model, self.generator, commit)
        if commit is not None:
            drafting.after_picks(batch, commit, observed, draft)
        scored = picking.score_prompts(logits, chunks, layout)
        requests = [ch.request for ch in chunks]
        drafts = drafting.constrained_drafts(requests) if drafting is not None and draft else None
        read = self.reader.read(picking.step_read(picked, acceptance, scored, drafts))
        results = picking.step_results(chunks, layout, read)
        DraftDriver.give_drafts(results, requests, read.drafts)
        if commit is not None:
            drafting.after_read(batch, commit, chunks, results, draft)
        return results


def _samples_ahead(request: Request, width: int) -> bool:
    """Whether a sampled row's verify block of `width` may be launched before the step ahead of it is
    read: its acceptance (`verify.accept`, between the graphs' replays) reads no output token
    (no penalties), no `min_tokens` ban is left, and its drafts stay clear of the token and length
    limits even after the most the step ahead can commit (its draft count, and so its draws from its
    generator, are those of the block the reading schedule would verify)."""
    unread = width * request.verifying  # the most the verify step in flight commits
    return not request.params.penalized and not request.banned_ids() and request.tokens_left - unread >= width


def _sequence(ch: ScheduledChunk, score: bool) -> SequenceChunk:
    """The chunk's tokens; a verify chunk feeds its anchor and placeholders where its drafts go (the
    drafts themselves are on the device: `DraftDriver.feed_drafts`, or the verify graph)."""
    r = ch.request
    if ch.verify:
        # behind a verify step still unread, the block starts where that one's commit leaves it
        assert r.verifying <= 1, "a block is built with at most the verify step before it unread"
        after = bool(r.verifying)
        anchor = IN_FLIGHT if after else r.tokens(r.num_computed, r.num_computed + 1)[0]
        tokens = [anchor] + [0] * (ch.num_tokens - 1)
        return SequenceChunk(tokens, r.num_computed, r.slot, r.slot, True, True, after_commit=after)
    tokens = r.tokens(r.num_computed, r.num_computed + ch.num_tokens)
    points = [(position - r.num_computed, sid) for position, sid in ch.snapshots]
    return SequenceChunk(tokens, r.num_computed, r.slot, r.slot, ch.samples, False, score, points)
