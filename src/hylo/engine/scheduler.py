"""Continuous batching: which requests run in the next step, and how many tokens each feeds."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.ledger import InFlightLedger
from hylo.engine.request import Request, Status
from hylo.engine.route import RunAhead
from hylo.memory.manager import CacheManager, copies_last_page
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.verify import VerifyShape

# Without mixed steps, while at most this many prompts have prefill work a step prefills one of them in
# a chunk the prefill graphs take: a replay costs a fraction of an eager step's host work (about a
# fifth on the demo model, RESULTS S26-2), so a few replays beat one eager step; more prompts than
# this (a burst of arrivals) share one eager step.
ONE_PROMPT_STEPS_UP_TO = 4
# A chunk that scores its prompt (prompt logprobs) returns logits for every token: at most this many
# tokens a chunk, so that those logits stay bounded ([tokens, vocab] fp32: 0.6 GiB for 155K ids).
MAX_SCORED_CHUNK_TOKENS = 1024


class Scheduler:
    """FCFS with chunked prefill, mixed prefill + decode steps and preemption by recompute.

    Each step: every running request whose prompt is done decodes one token (or, with speculation,
    verifies an anchor and up to `verify_shape.drafts` drafts); partially prefilled
    running requests continue, then waiting requests are admitted in arrival order, while the step's
    prefill budget, the running limit, slots and pages allow. The budget is `chunked_prefill_size`
    tokens while any request decodes (a decoding token waits on the whole step), `idle_prefill_size`
    while none does (nobody waits; fewer, longer steps read every weight fewer times a prompt). When a
    running request needs a page and none is free, the most recently admitted other request is
    preempted: its caches are released and it returns to the head of the queue, to be recomputed
    from its prompt and the tokens it already generated. With speculation every chunk's pages also
    cover `verify_shape.drafts` positions past it: a proposer drafting at the end of the step may write
    its caches there.

    With a prefix cache (`caches.prefix`), an admitted request starts from its deepest cached
    snapshot (`PrefixCache.match`; not a request that scores its prompt, which needs every
    position's logits), and prefill chunks leave the snapshots the cache asks for, which `publish`
    puts in the tree once the step has computed them.
    """

    def __init__(
        self,
        caches: CacheManager,
        max_running: int,
        chunked_prefill_size: int,
        idle_prefill_size: int,
        verify_shape: VerifyShape | None = None,
        proposer: Any = None,
        overlap: bool = False,
        verify_graphs: bool = False,
        mixed_steps: bool = True,
        prefill_graphs: bool = False,
    ):
        """`overlap`, `verify_graphs`: whether steps may run ahead of the read before them at all, and
        verify steps as verify-graph replays (`InFlightLedger`). `mixed_steps`: whether a step may
        hold prefill chunks beside decode or verify rows; without, a step with prefill work to do
        (a prompt going on, a waiting request that can start) runs only that, and the decoding
        requests go on in the next step, whose rows the decode or verify graphs can replay (a mixed
        step runs eagerly). `prefill_graphs`: the engine replays one prompt's short chunks in prefill
        graphs. `chunked_prefill_size` / `idle_prefill_size`: a step's prefill budget while a request
        decodes / while none does (the engine's `EngineConfig.longest_prefill_step`)."""
        self.caches = caches
        self.prefix = caches.prefix
        self.proposer = proposer
        self.verify_shape = verify_shape  # None: no speculative decoding
        self.max_running = max_running
        self.prefill_budget = chunked_prefill_size
        self.idle_prefill_budget = idle_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.mixed_steps = mixed_steps
        self.prefill_graphs = prefill_graphs
        self.ledger = InFlightLedger(proposer, overlap, verify_graphs)  # what is launched and unread

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft: bool = True) -> list[ScheduledChunk]:
        """The next step's chunks; without `draft` decoding requests decode one token plainly. Without
        `mixed_steps`, only prefill chunks while any can be scheduled (see `__init__`): one prompt's
        chunk while at most `ONE_PROMPT_STEPS_UP_TO` prompts have prefill work (with `prefill_graphs`:
        a prefill graph replays it where it takes it; a longer chunk runs eagerly), all that fit the
        budget otherwise."""
        if not self.mixed_steps:
            prompts = sum(r.remaining > 1 for r in self.running) + len(self.waiting)
            one = self.prefill_graphs and prompts <= ONE_PROMPT_STEPS_UP_TO
            chunks = self._schedule(draft, decode=False, prompts=1 if one else None)
            if chunks:
                return chunks  # else no prompt goes on and none could start: the decoding requests go on
        return self._schedule(draft, decode=True)

    def _schedule(self, draft: bool, decode: bool, prompts: int | None = None) -> list[ScheduledChunk]:
        """`schedule`'s chunks, the decoding requests' rows among them only with `decode`; without
        `decode`, prefill chunks of at most `prompts` requests (None: any)."""
        assert prompts is None or not decode, "a prompt limit counts a step of prefill chunks alone"
        chunks: list[ScheduledChunk] = []
        decoding = any(r.status is Status.RUNNING and r.remaining == 1 for r in self.running)
        budget = self.prefill_budget if decoding else self.idle_prefill_budget
        room = (lambda: True) if prompts is None else (lambda: len(chunks) < prompts)
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier request
            if (request.remaining == 1 and not decode) or (request.remaining > 1 and not room()):
                continue
            drafts = request.draft_budget(self._max_drafts) if draft and request.remaining == 1 else 0
            n = 1 + drafts if request.remaining == 1 else self._prefill_tokens(request, budget)
            if n == 0 or not self._grow(request, self._reserve(request.num_computed + n)):
                continue
            if request.remaining > 1:
                budget -= n
                chunks.append(ScheduledChunk(request, n, snapshots=self._snapshots(request, n)))
                continue
            chunks.append(ScheduledChunk(request, n, verify=drafts > 0))
        if any(ch.verify for ch in chunks):
            # the one-token decode rows of a verify step verify a block without drafts: every row of
            # the step is then a verify block, which the verify graphs take
            chunks = [replace(ch, verify=True) if _one_token_decode(ch) else ch for ch in chunks]
        while self.waiting and budget > 0 and len(self.running) < self.max_running and room():
            if not self._admit(self.waiting[0], budget, chunks):
                break
            budget -= chunks[-1].num_tokens
        return chunks

    def schedule_ahead(self, in_flight: Sequence[Request], plan: StepPlan) -> list[ScheduledChunk] | RunAhead:
        """The step after one still running on the device whose every chunk decodes a token of
        `in_flight` (the overlap schedule), decided before that step's tokens are read: each of
        those requests decodes its in-flight token, but for those the tokens in flight end (they reach
        `max_tokens` or the length limit; a verify step in flight emits at least one token). A
        request that stops at an in-flight token (a stop id or string) runs this step for nothing:
        its result is dropped.

        With a verify `plan` (and a proposer), the step in flight verified a block of every one of
        `in_flight` and this one verifies the next: a whole block each (the draft budget is not known
        before the read; the ledger cuts the blocks once it is: `InFlightLedger.cut`), its pages
        backed for the most the step in flight can commit and this block after it.

        Refused (why, as a `RunAhead`) where no step of `plan` may run ahead (`InFlightLedger.
        plan_refusal`, asked before any page is taken) or this step could differ from the one
        `schedule` would make once the tokens are read; the caller then reads first."""
        why = self.ledger.plan_refusal(plan)
        if why is not None:
            return RunAhead.refused(why)
        verify = plan.verify and self.proposer is not None
        live = {r for r in in_flight if r.status is Status.RUNNING}  # not those ended since
        if set(self.running) != live:
            return RunAhead.refused("a running request has no token in flight (a prefill goes on)")
        if any(bool(r.verifying) != verify for r in live):
            return RunAhead.refused("the step in flight is of the other kind (plain or verify)")
        if self.waiting and self.caches.slots.num_free and len(self.running) < self.max_running:
            return RunAhead.refused("a waiting request could be admitted")
        going_on = [r for r in self.running if r.tokens_left > r.in_flight + r.verifying]
        if not going_on:
            return RunAhead.refused("every request ends with the tokens in flight")
        width = self.verify_shape.block if verify else 1
        for request in going_on:
            assert request.slot is not None and request.remaining == 1
            end = request.num_computed + (2 * width if verify else 1)
            if not self.caches.grow(request.slot, request.pages, self._reserve(end)):
                # (the pages it did grow are the next step's anyway)
                return RunAhead.refused("the pages cannot grow without preempting")
        return [ScheduledChunk(request, width, verify=verify) for request in going_on]

    def _admit(self, request: Request, budget: int, chunks: list[ScheduledChunk]) -> bool:
        """Start `request` (from its cached prefix, if any) with its first chunk appended to `chunks`;
        False, with nothing taken, when no slot or not enough pages are free."""
        if self.caches.slots.num_free == 0:
            return False
        hit = None
        if self.prefix is not None and not request.scores_prompt:
            hit = self.prefix.match(request.tokens(0, request.total_len))
        start = hit.length if hit else 0
        n = self._prefill_tokens(request, budget, request.total_len - start)
        shared = hit.pages if hit else []
        self.caches.share(shared)  # before making room: eviction must not take them
        private_copy = int(hit is not None and copies_last_page(self.proposer))
        need = self.caches.pages_needed(len(shared), self._reserve(start + n)) + private_copy
        if not self.caches.make_room(need):
            self.caches.unshare(shared)
            return False
        slot = self.caches.acquire_slot()
        self.waiting.popleft()
        request.slot, request.status = slot, Status.RUNNING
        if self.prefix is not None:
            self.prefix.stats.query_tokens += request.total_len
        if hit is not None:
            self.caches.resume(slot, hit, request.pages, self.proposer)
            request.num_computed = start
            self.prefix.stats.hit_tokens += start
        self.caches.grow(slot, request.pages, self._reserve(start + n))
        self.running.append(request)
        chunks.append(ScheduledChunk(request, n, snapshots=self._snapshots(request, n)))
        return True

    def _snapshots(self, request: Request, n: int) -> tuple[tuple[int, int], ...]:
        """The snapshots a prefill chunk of `n` tokens from `request.num_computed` leaves (with ids)."""
        if self.prefix is None:
            return ()
        start, end = request.num_computed, request.total_len
        positions = self.prefix.snapshot_positions(request.tokens(0, start + n), start, start + n, end)
        taken = []
        for position in positions:
            sid = self.prefix.alloc_snapshot()
            if sid is None:
                break
            taken.append((position, sid))
        return tuple(taken)

    def publish(self, chunk: ScheduledChunk) -> None:
        """Put the snapshots `chunk` left, now computed, and the pages before them in the prefix cache."""
        if chunk.snapshots:
            request = chunk.request
            last = max(position for position, _ in chunk.snapshots)
            self.prefix.insert_snapshots(request.tokens(0, last), request.pages, chunk.snapshots)

    @staticmethod
    def _prefill_tokens(request: Request, budget: int, remaining: int | None = None) -> int:
        if request.scores_prompt:
            budget = min(budget, MAX_SCORED_CHUNK_TOKENS)
        return min(request.remaining if remaining is None else remaining, budget)

    @property
    def _max_drafts(self) -> int:
        """The drafts a verify block holds (0 without speculative decoding): a chunk's pages also back
        that many positions past it, where a proposer drafting at the end of the step writes."""
        return 0 if self.verify_shape is None else self.verify_shape.drafts

    def _reserve(self, num_tokens: int) -> int:
        """Positions to back for a chunk ending at `num_tokens`: the drafts' lookahead included."""
        return min(num_tokens + self._max_drafts, self.caches.plan.max_len)

    def _grow(self, request: Request, num_tokens: int) -> bool:
        """Pages for `num_tokens` positions of `request`, preempting later requests if needed; False
        when `request` itself had to be preempted."""
        assert request.slot is not None
        while not self.caches.grow(request.slot, request.pages, num_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is request:
                return False
        return True

    def preempt(self, request: Request) -> None:
        self.num_preemptions += 1
        self._release(request)
        request.status, request.num_computed, request.deferred_from = Status.WAITING, 0, None
        self.waiting.appendleft(request)

    def finish(self, request: Request) -> None:
        """Drop a finished or aborted request from the queues and free its memory."""
        if request in self.waiting:
            self.waiting.remove(request)
        elif request.slot is not None:
            self._release(request)

    def _release(self, request: Request) -> None:
        assert request.slot is not None
        self.caches.release(request.slot, request.pages)
        request.slot = None
        self.running.remove(request)


def _one_token_decode(chunk: ScheduledChunk) -> bool:
    """A plain chunk of a request's one uncomputed token that scores no prompt position."""
    request = chunk.request
    return not chunk.verify and chunk.num_tokens == 1 == request.remaining and not request.scores_prompt
