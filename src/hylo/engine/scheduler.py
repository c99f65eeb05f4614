"""Continuous batching: which requests run in the next step, and how many tokens each feeds."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, replace

from hylo.engine.request import Request, Status
from hylo.memory.manager import CacheManager

# A chunk that scores its prompt (prompt logprobs) returns logits for every token: at most this many
# tokens a chunk, so that those logits stay bounded ([tokens, vocab] fp32: 0.6 GiB for 155K ids).
MAX_SCORED_CHUNK_TOKENS = 1024


@dataclass(frozen=True)
class ScheduledChunk:
    """`num_tokens` of the request's uncomputed tokens; a `verify` chunk instead feeds the anchor and
    its first `num_tokens - 1` drafts (which the proposer keeps on the device; none for a decoding
    request without a draft budget in a step where others verify: it verifies a block of one token)."""

    request: Request
    num_tokens: int
    verify: bool = False

    @property
    def verifies_drafts(self) -> bool:
        """A verify chunk with drafts (a block of one token verifies nothing: it decodes)."""
        return self.verify and self.num_tokens > 1

    @property
    def samples(self) -> bool:
        """The chunk ends at the request's last uncomputed token, so the target picks what follows."""
        return self.verify or self.num_tokens == self.request.remaining


class Scheduler:
    """FCFS with chunked prefill, mixed prefill + decode steps and preemption by recompute.

    Each step: every running request whose prompt is done decodes one token (or, with speculation,
    verifies an anchor and up to `num_draft_tokens` drafts); partially prefilled
    running requests continue, then waiting requests are admitted in arrival order, while the step's
    prefill budget (`chunked_prefill_size` tokens), the running limit, slots and pages allow. When a
    running request needs a page and none is free, the most recently admitted other request is
    preempted: its caches are released and it returns to the head of the queue, to be recomputed
    from its prompt and the tokens it already generated. With speculation every chunk's pages also
    cover `num_draft_tokens` positions past it: a proposer drafting at the end of the step may write
    its caches there.
    """

    def __init__(
        self, caches: CacheManager, max_running: int, chunked_prefill_size: int, num_draft_tokens: int = 0
    ):
        self.caches = caches
        self.num_draft_tokens = num_draft_tokens
        self.max_running = max_running
        self.prefill_budget = chunked_prefill_size
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self, draft: bool = True) -> list[ScheduledChunk]:
        """The next step's chunks; without `draft` decoding requests decode one token plainly."""
        chunks: list[ScheduledChunk] = []
        budget = self.prefill_budget
        for request in list(self.running):
            if request.status is not Status.RUNNING:
                continue  # preempted while making room for an earlier request
            drafts = request.draft_budget(self.num_draft_tokens) if draft and request.remaining == 1 else 0
            n = 1 + drafts if request.remaining == 1 else self._prefill_tokens(request, budget)
            if n == 0 or not self._grow(request, self._reserve(request.num_computed + n)):
                continue
            if request.remaining > 1:
                budget -= n
            chunks.append(ScheduledChunk(request, n, verify=drafts > 0))
        if any(ch.verify for ch in chunks):
            # the one-token decode rows of a verify step verify a block without drafts: every row of
            # the step is then a verify block, which the verify graphs take
            chunks = [replace(ch, verify=True) if _one_token_decode(ch) else ch for ch in chunks]
        while self.waiting and budget > 0 and len(self.running) < self.max_running:
            request = self.waiting[0]
            n = self._prefill_tokens(request, budget)
            if self.caches.pages_needed(0, self._reserve(n)) > self.caches.pages.num_free:
                break
            slot = self.caches.acquire_slot()
            if slot is None:
                break
            self.waiting.popleft()
            request.slot, request.status = slot, Status.RUNNING
            self.caches.grow(slot, request.pages, self._reserve(n))
            self.running.append(request)
            budget -= n
            chunks.append(ScheduledChunk(request, n))
        return chunks

    @staticmethod
    def _prefill_tokens(request: Request, budget: int) -> int:
        if request.scores_prompt:
            budget = min(budget, MAX_SCORED_CHUNK_TOKENS)
        return min(request.remaining, budget)

    def _reserve(self, num_tokens: int) -> int:
        """Positions to back for a chunk ending at `num_tokens`: the drafts' lookahead included."""
        return min(num_tokens + self.num_draft_tokens, self.caches.plan.max_len)

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
