"""One step on the device: scheduled chunks -> batch tensors -> model -> picked tokens, read once."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, replace

import torch

from hylo.engine.cuda_graph import DEFER, DRAFT, OBSERVE, DecodeGraphs
from hylo.engine.prefill_graph import PrefillGraphs
from hylo.engine.reader import Logprobs, PendingRead, Reader, StepRead
from hylo.engine.request import IN_FLIGHT, Request, Status
from hylo.engine.scheduler import ScheduledChunk
from hylo.engine.verify_graph import VerifyGraphs
from hylo.forward_batch import ForwardBatch, SequenceChunk
from hylo.host_copy import to_device
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.sampling import SampleRow, logprob_entry, sample
from hylo.speculative.proposer import HostCommit, Proposer, StepCommit
from hylo.speculative.verify import accept
from hylo.structured import allowed_tokens, block_bitmasks, fill_bitmasks


@dataclass
class ChunkResult:
    """Tokens the target picked after a chunk (one, or a verify step's accepted drafts + one) and
    how many of the chunk's tokens are now committed to the caches."""

    tokens: list[int]
    logprobs: list[dict[int, float]] | None
    committed: int
    accepted: int = 0
    # prompt logprobs the chunk scored, to extend `Request.prompt_logprobs` (Request.prompt_targets)
    prompt_logprobs: list[dict[int, float]] | None = None
    # a constrained request's drafts for its next step (`Request.host_drafts`), None if none were made
    drafts: list[int] | None = None


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
    observing: ForwardBatch | None = None  # an eager step's batch, for the proposer's observe after its picks

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
    observes first has the proposer observe what waits (`_catch_up`), so the proposer still sees
    every committed token in order. A plain graph step of raw-argmax rows that drafts does so in its
    graph (`DRAFT`)."""

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
        device = model.embed_tokens.weight.device
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.reader = Reader()  # this engine's pinned read buffers (`Engine.close` empties them)

    def step(self, chunks: Sequence[ScheduledChunk], draft: bool = True) -> list[ChunkResult]:
        """Run the chunks; one result per chunk. The one device-to-host read is of the picked tokens
        (and of logprobs, when asked). Without `draft` the proposer only observes the step (its drafts
        are not needed next step); a replayed verify step drafts regardless."""
        targets = [_prompt_targets(ch) for ch in chunks]  # prompt positions each chunk scores
        seqs = [_sequence(ch, bool(t[1])) for ch, t in zip(chunks, targets, strict=True)]
        requests = [ch.request for ch in chunks]
        snapshots = any(ch.snapshots for ch in chunks)  # only eager forwards take prefix snapshots
        plain_graph = not snapshots and self.graphs is not None and self.graphs.accepts(seqs)
        variant = OBSERVE
        if plain_graph and self.graphs.defers:
            if not draft and self._ring_has_room(requests):
                variant = DEFER  # a plain step that drafts nothing leaves its observe for later
            elif draft and all(r.picks_argmax for r in requests):
                variant, draft = DRAFT, False  # its graph drafts from the picks: nothing is left to draft
        if variant != DEFER:  # this step observes: the proposer sees every earlier token first
            self._catch_up(requests)
        full = None if snapshots else self._full_blocks(seqs)
        if full is not None and self.verify_graphs.accepts(full):
            num_drafts = [ch.num_tokens - 1 for ch in chunks]
            allowed = self._verify_allowed(requests, self.verify_graphs.tokens_per_seq)
            acceptance = self.verify_graphs.run(full, requests, num_drafts, self.generator, allowed)
            read = self.reader.read(
                StepRead(
                    accepted=acceptance.accepted, emitted=acceptance.emitted,
                    block_logprobs=Logprobs.of(acceptance), drafts=self._constrained_drafts(requests),
                )
            )  # fmt: skip
            results = _verify_results(chunks, read)
            _give_drafts(results, requests, read.drafts)
            return results
        observed = False
        if plain_graph:
            batch, logits = self.graphs.run(seqs, variant)
            observed = self.graphs.observes  # or deferred: nothing is left to observe now either
            if variant == DEFER:
                _mark_deferred(requests)
        elif self.prefill_graphs is not None and self.prefill_graphs.accepts(seqs):
            batch, logits = self.prefill_graphs.run(seqs)  # takes the chunk's snapshots too
            observed = self.prefill_graphs.observes
        else:
            c = self.caches
            batch = ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool)
            if self.proposer is not None:
                _feed_drafts(batch, chunks, self.proposer.drafts)
            capture = self.proposer.capture_layers if self.proposer is not None else ()
            batch.snapshot_pool = c.snapshots
            logits = self.model(batch, capture)
            if snapshots and c.snapshot_features.shape[1]:
                self._snapshot_features(batch)
        return self._pick(chunks, batch, logits, observed, draft, targets)

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
            return self.graphs.defers and self._ring_has_room(requests)
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

    def _ring_has_room(self, requests: Sequence[Request]) -> bool:
        """Whether one more deferred observe of each of `requests` fits the decode graphs' ring."""
        room = self.graphs.deferred_tokens
        return all(r.deferred_from is None or r.num_computed - r.deferred_from < room for r in requests)

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
            requests = [ch.request for ch in chunks]
            blocks = self._verify_blocks(chunks)
            num_drafts = [ch.num_tokens - 1 for ch in chunks]
            acceptance = self.verify_graphs.run(blocks, requests, num_drafts, self.generator)
            read = self.reader.start(
                StepRead(
                    accepted=acceptance.accepted, emitted=acceptance.emitted,
                    block_logprobs=Logprobs.of(acceptance),
                )
            )  # fmt: skip
            return LaunchedStep(list(chunks), read)
        seqs = [_sequence(ch, False) for ch in chunks]
        c, proposer = self.caches, self.proposer
        observing = None
        if self.graphs is not None and self.graphs.accepts(seqs):
            _, logits = self.graphs.run(seqs, OBSERVE if proposer is None else DEFER)
            if proposer is not None:
                _mark_deferred([ch.request for ch in chunks])
        else:
            batch = ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool)
            ids = batch.input_ids  # an in-flight token is its row's last pick, as the decode graphs take it
            ids.copy_(torch.where(ids == IN_FLIGHT, c.last_sampled[batch.token_rows], ids))
            logits = self.model(batch, proposer.capture_layers if proposer is not None else ())
            observing = batch if proposer is not None else None
        launched = LaunchedStep(list(chunks), None, logits, observing)
        if sample_now:
            self._sample(launched, own_counted=False)
        return launched

    def sample_launched(self, launched: LaunchedStep) -> None:
        """The picks of a step launched without them, its requests' bookkeeping counting its token in
        flight already (`Engine`); rows of requests that ended meanwhile pick unconstrained (dropped)."""
        self._sample(launched, own_counted=True)

    def _sample(self, launched: LaunchedStep, own_counted: bool) -> None:
        c, logits = self.caches, launched.logits
        requests = [ch.request for ch in launched.chunks]
        rows = []
        for r in requests:
            earlier = r.in_flight - own_counted  # in-flight tokens before this step's pick
            unread = self._unread(r, earlier) if r.status is Status.RUNNING else None
            rows.append(
                SampleRow(r.params, r.prompt_ids, r.output_ids, r.generator, r.banned_ids(earlier), unread)
            )
        live = [r.grammar if r.status is Status.RUNNING else None for r in requests]
        bitmasks = fill_bitmasks(live, logits.shape[-1], logits.device)
        allowed = None if bitmasks is None else allowed_tokens(bitmasks, logits.shape[-1])
        picked = sample(logits, rows, self.generator, allowed)
        held = [i for i, r in enumerate(requests) if r.slot is not None]  # not those that ended meanwhile
        slots = to_device([requests[i].slot for i in held], logits.device, torch.long)
        if len(held) == len(requests):
            c.last_sampled[slots] = picked.tokens
        else:
            c.last_sampled[slots] = picked.tokens[to_device(held, logits.device, torch.long)]
        if launched.observing is not None:  # what `_pick` has the proposer observe of a plain step
            n = len(requests)
            counts = torch.ones(n, dtype=torch.int32, device=logits.device)
            commit = StepCommit(counts, picked.tokens, torch.arange(n, device=logits.device))
            self.proposer.observe(launched.observing, commit)
            launched.observing = None
        read = StepRead(tokens=picked.tokens, token_logprobs=Logprobs.of(picked))
        launched.read, launched.logits = self.reader.start(read), None

    def _unread(self, request: Request, earlier: int) -> torch.Tensor | None:
        """A penalised request's output token still in flight before this pick (on the device), which
        its penalties count; None when the host has read them all (or nothing penalises them)."""
        if not (earlier and request.params.penalized):
            return None
        assert earlier == 1 and request.slot is not None  # the step before this one's
        return self.caches.last_sampled[request.slot : request.slot + 1]

    @staticmethod
    def collect(launched: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step's picks: one result per chunk, as `step` gives them (a verify
        step's `chunks` first cut to the blocks the requests' draft budgets allow)."""
        read = launched.read.wait()
        if launched.verifies:
            # a block launched ahead is whole: it is cut to what the request's draft budget allows now
            # that the step before it has been applied, the block a step scheduled then would have held
            launched.chunks = [
                replace(ch, num_tokens=min(ch.num_tokens, 1 + ch.request.draft_budget(ch.num_tokens - 1)))
                for ch in launched.chunks
            ]
            return _verify_results(launched.chunks, read)
        results = []
        for k, ch in enumerate(launched.chunks):
            token = int(read.tokens[k])
            results.append(ChunkResult([token], _entries(ch.request, [token], read.token_logprobs, k), 1))
        return results

    def _snapshot_features(self, batch: ForwardBatch) -> None:
        """The features of each snapshot's last token, for a proposer that resumes from them."""
        offsets = [0, *itertools.accumulate(batch.extend_lens)]
        points = [(offsets[i] + k - 1, sid) for i, pts in batch.snapshot_points.items() for k, sid in pts]
        index = to_device(points, batch.features.device, torch.long)
        self.caches.snapshot_features[index[:, 1]] = batch.features[index[:, 0]]

    def _verify_allowed(self, requests: Sequence[Request], width: int) -> torch.Tensor | None:
        """What each position of the requests' verify blocks of `width` may hold (`[blocks · width,
        vocab]` bool: structured outputs, `block_bitmasks`), None when no request is constrained."""
        vocab = self.model.config.vocab_size
        device = self.model.embed_tokens.weight.device
        blocks = [(r.grammar, r.host_drafts or []) for r in requests]
        bitmasks = block_bitmasks(blocks, width, vocab, device)
        return None if bitmasks is None else allowed_tokens(bitmasks, vocab)

    def _constrained_drafts(self, requests: Sequence[Request]) -> torch.Tensor | None:
        """The drafts just made for the constrained requests (their next verify masks each position
        after the drafts before it), to come back with the step's read; None without any."""
        rows = [r.slot for r in requests if r.grammar is not None]
        if not rows or self.proposer is None or self.proposer.needs_host:
            return None
        return self.proposer.drafts[to_device(rows, self.proposer.drafts.device, torch.long)]

    def _catch_up(self, requests: Sequence[Request]) -> None:
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
        batch.features = self.graphs.deferred[index[:, 0], index[:, 1]]
        counts = to_device([r.num_computed - r.deferred_from for r in pending], device, torch.int32)
        none = torch.zeros(0, dtype=torch.long, device=device)
        self.proposer.observe(
            batch, StepCommit(counts, torch.zeros(len(pending), dtype=torch.long, device=device), none)
        )
        for r in pending:
            r.deferred_from = None

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
        logits: torch.Tensor,
        observed: bool,
        draft: bool,
        targets: Sequence[tuple[int, list[int]]],
    ) -> list[ChunkResult]:
        device = logits.device
        plain = [i for i, ch in enumerate(chunks) if ch.samples and not ch.verify]
        verifying = [i for i, ch in enumerate(chunks) if ch.verify]
        rows_of = _logit_rows(chunks, targets)
        proposer = self.proposer
        # a plain step whose observe ran in its graph and that drafts nothing leaves the proposer nothing
        needs_commit = proposer is not None and (proposer.needs_host or not observed or draft)
        counts = anchors = None
        if needs_commit:
            counts = to_device([ch.num_tokens for ch in chunks], device, torch.int32)
            anchors = torch.zeros(len(chunks), dtype=torch.long, device=device)
        picked, acceptance = None, None
        if plain:
            rows = [
                SampleRow(r.params, r.prompt_ids, r.output_ids, r.generator, r.banned_ids())
                for r in (chunks[i].request for i in plain)
            ]
            picked_rows = [rows_of[i][-1] for i in plain]  # a scoring chunk's last row samples
            leading = picked_rows == list(range(len(picked_rows)))  # a decode step: no index upload
            vocab = logits.shape[-1]
            bitmasks = fill_bitmasks([chunks[i].request.grammar for i in plain], vocab, device)
            allowed = None if bitmasks is None else allowed_tokens(bitmasks, vocab)
            picked = sample(
                logits[: len(plain)] if leading else logits[picked_rows], rows, self.generator, allowed
            )
            if anchors is not None and plain == list(range(len(plain))):
                anchors[: len(plain)] = picked.tokens
            elif anchors is not None:  # (indexing by a list would upload it from pageable memory)
                anchors[to_device(plain, device, torch.long)] = picked.tokens
        if verifying:
            width = max(chunks[i].num_tokens for i in verifying)
            index = [[rows_of[i][min(j, len(rows_of[i]) - 1)] for j in range(width)] for i in verifying]
            index_d = to_device(index, device, torch.long)
            drafts = batch.input_ids[index_d[:, 1:]]
            verifiers = [chunks[i].request for i in verifying]
            acceptance = accept(
                logits[index_d], drafts, [chunks[i].num_tokens - 1 for i in verifying], verifiers,
                self.generator, self._verify_allowed(verifiers, width),
            )  # fmt: skip
            committed = (acceptance.accepted + 1).int()
            self.model.commit(batch, committed)
            if needs_commit:
                verify_index = to_device(verifying, device, torch.long)
                counts[verify_index] = committed
                anchors[verify_index] = acceptance.emitted.gather(1, acceptance.accepted[:, None])[:, 0]
        commit = None
        if needs_commit:
            sampling = to_device(sorted(plain + verifying), device, torch.long)
            commit = StepCommit(counts, anchors, sampling)
        if needs_commit and not proposer.needs_host:
            if not observed and draft:
                proposer.observe_and_propose(batch, commit)
            elif not observed:
                proposer.observe(batch, commit)
            elif draft:
                proposer.propose(batch, commit)

        scoring = [i for i, (_, tokens) in enumerate(targets) if tokens]
        scored = _score_prompts(
            logits, [chunks[i] for i in scoring], [targets[i] for i in scoring], [rows_of[i] for i in scoring]
        )
        requests = [ch.request for ch in chunks]
        read = self.reader.read(
            StepRead(
                tokens=picked.tokens if picked else None, token_logprobs=Logprobs.of(picked),
                accepted=acceptance.accepted if acceptance else None,
                emitted=acceptance.emitted if acceptance else None,
                block_logprobs=Logprobs.of(acceptance), prompt_logprobs=scored,
                drafts=self._constrained_drafts(requests) if draft else None,
            )
        )  # fmt: skip
        results = [ChunkResult([], None, ch.num_tokens) for ch in chunks]
        for k, i in enumerate(plain):
            token = int(read.tokens[k])
            lp = _entries(chunks[i].request, [token], read.token_logprobs, k)
            results[i] = ChunkResult([token], lp, chunks[i].num_tokens)
        for k, i in enumerate(verifying):
            accepted = int(read.accepted[k])
            tokens = read.emitted[k, : accepted + 1].tolist()
            results[i] = ChunkResult(
                tokens, _entries(chunks[i].request, tokens, read.block_logprobs, k), accepted + 1, accepted
            )
        offset, prompt = 0, read.prompt_logprobs
        for i in scoring:
            tokens = targets[i][1]
            n = chunks[i].request.params.prompt_logprobs
            results[i].prompt_logprobs = [
                logprob_entry(t, float(prompt.chosen[offset + j]), prompt.top_ids[offset + j, :n].tolist(),
                              prompt.top_values[offset + j, :n].tolist(), n)
                for j, t in enumerate(tokens)
            ]  # fmt: skip
            offset += len(tokens)
        _give_drafts(results, requests, read.drafts)
        if needs_commit and proposer.needs_host:
            offsets = [0, *batch.extend_lens]
            for j in range(1, len(offsets)):
                offsets[j] += offsets[j - 1]
            commit.host = [
                HostCommit(ch.request, ch.request.num_computed, r.committed, off, r.tokens)
                for ch, r, off in zip(chunks, results, offsets, strict=False)
            ]
            proposer.observe(batch, commit)
            if draft:
                proposer.propose(batch, commit)
        return results


def _samples_ahead(request: Request, width: int) -> bool:
    """Whether a sampled row's verify block of `width` may be launched before the step ahead of it is
    read: its acceptance (`verify.accept`, between the graphs' replays) reads no output token
    (no penalties), no `min_tokens` ban is left, and its drafts stay clear of the token and length
    limits even after the most the step ahead can commit (its draft count, and so its draws from its
    generator, are those of the block the reading schedule would verify)."""
    unread = width * request.verifying  # the most the verify step in flight commits
    return not request.params.penalized and not request.banned_ids() and request.tokens_left - unread >= width


def _verify_results(chunks: Sequence[ScheduledChunk], read: StepRead) -> list[ChunkResult]:
    """One result per verify chunk from the host copies of its acceptance (`read`). A block padded past a
    request's draft budget (its chunk's `num_tokens`) ends the request this step (greedy rows verify
    its placeholder drafts too): its tokens stop at the budget (what the caches hold past it belongs to
    nobody once it finishes)."""
    results = []
    for i, ch in enumerate(chunks):
        n = min(int(read.accepted[i]) + 1, ch.num_tokens)
        tokens = read.emitted[i, :n].tolist()
        results.append(ChunkResult(tokens, _entries(ch.request, tokens, read.block_logprobs, i), n, n - 1))
    return results


def _give_drafts(results: list[ChunkResult], requests: Sequence[Request], drafts) -> None:
    """Hand the constrained requests' drafts, as read (`_constrained_drafts`), to their results."""
    if drafts is None:
        return
    rows = iter(drafts.tolist())
    for result, request in zip(results, requests, strict=True):
        if request.grammar is not None:
            result.drafts = next(rows)


def _prompt_targets(ch: ScheduledChunk) -> tuple[int, list[int]]:
    if ch.verify:
        return 0, []
    return ch.request.prompt_targets(ch.request.num_computed, ch.num_tokens)


def _score_prompts(
    logits: torch.Tensor,
    chunks: Sequence[ScheduledChunk],
    targets: Sequence[tuple[int, list[int]]],
    rows_of: Sequence[list[int]],
) -> Logprobs | None:
    """The logprobs (chosen `[N]`, top `[N, n]`) of the prompt positions the chunks score (`targets`:
    `_prompt_targets` of each), in order, n the largest `prompt_logprobs` asked; nothing is read
    back. None when no chunk scores."""
    if not chunks:
        return None
    rows, tokens = [], []
    for ch, (first, chunk_tokens), chunk_rows in zip(chunks, targets, rows_of, strict=True):
        lead = first - 1 - ch.request.num_computed  # the logits row of position first - 1
        rows += chunk_rows[lead : lead + len(chunk_tokens)]
        tokens += chunk_tokens
    device = logits.device
    index = to_device([rows, tokens], device, torch.long)
    logprobs = torch.log_softmax(logits[index[0]].float(), dim=-1)
    top = logprobs.topk(max(ch.request.params.prompt_logprobs for ch in chunks), dim=-1)
    return Logprobs(logprobs.gather(1, index[1][:, None])[:, 0], top.indices, top.values)


def _mark_deferred(requests: Sequence[Request]) -> None:
    """A replay left these requests' observe in the deferred ring: their deferred positions start at
    the first step that did (`Request.deferred_from`)."""
    for r in requests:
        if r.deferred_from is None:
            r.deferred_from = r.num_computed


def _sequence(ch: ScheduledChunk, score: bool) -> SequenceChunk:
    """The chunk's tokens; a verify chunk feeds its anchor and placeholders where its drafts go (the
    drafts themselves are on the device: `_feed_drafts`, or the verify graph)."""
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


def _feed_drafts(batch: ForwardBatch, chunks: Sequence[ScheduledChunk], drafts: torch.Tensor) -> None:
    """Copy each verify chunk's drafts from the proposer's device rows into the batch's input ids."""
    targets, rows, columns, offset = [], [], [], 0
    for ch in chunks:
        if ch.verify:
            n = ch.num_tokens - 1
            targets += range(offset + 1, offset + 1 + n)
            rows += [ch.request.slot] * n
            columns += range(n)
        offset += ch.num_tokens
    if targets:
        device = batch.input_ids.device
        index = to_device([targets, rows, columns], device, torch.long)
        batch.input_ids[index[0]] = drafts[index[1], index[2]]


def _entries(request, tokens: list[int], logprobs: Logprobs | None, k: int) -> list[dict[int, float]] | None:
    """Host logprob dicts of row `k` of a read's logprobs (`StepRead.token_logprobs`, `block_logprobs`)."""
    n = request.params.logprobs
    if n is None or logprobs is None:
        return None
    chosen, top_ids, top_values = logprobs.chosen, logprobs.top_ids, logprobs.top_values
    # row k: one position (a plain sample, `[n]`) or a verify block's positions (`[T, n]`); n may be 0
    chosen, top_ids, top_values = chosen[k].reshape(-1), top_ids[k], top_values[k]
    if top_ids.dim() == 1:
        top_ids, top_values = top_ids[None], top_values[None]
    return [
        logprob_entry(t, float(chosen[j]), top_ids[j].tolist(), top_values[j].tolist(), n)
        for j, t in enumerate(tokens)
    ]


def _logit_rows(
    chunks: Sequence[ScheduledChunk], targets: Sequence[tuple[int, list[int]]]
) -> list[list[int]]:
    """Rows of the forward's logits that belong to each chunk (see `ForwardBatch.logits_index`): every
    token's for a verify chunk and a chunk that scores prompt positions, else the sampled one's."""
    rows, n = [], 0
    for ch, (_, scored) in zip(chunks, targets, strict=True):
        count = ch.num_tokens if ch.verify or scored else int(ch.samples)
        rows.append(list(range(n, n + count)))
        n += count
    return rows
