"""What is in flight: the scheduler's ledger of launched steps, and the one rule for running ahead.

With the overlap schedule a step may be launched before the step ahead of it is read: it runs ahead.
`InFlightLedger.run_ahead` alone decides whether a step may, and says why not, as `ops/dispatch`
names a kernel's refusal. The ledger is also the one writer of a request's in-flight counters
(`Request.in_flight`, `verifying`, `num_computed`, `deferred_from`, `host_drafts`, `undrafted`; the scheduler
itself resets them when it admits or preempts a request): `launched` records a launched step,
`cut` trims the blocks of a verify step launched ahead to the draft budgets known once the step
before it is settled, and `settle` records what a step's read brought.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.picking import ChunkResult
from hylo.engine.request import Request, Status
from hylo.engine.route import Path, RunAhead, StepRoute
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.proposer import Proposer


class InFlightLedger:
    """The in-flight state of one engine's requests (see the module). `overlap`: the engine runs
    steps ahead at all (not with the overlap schedule disabled, nor on the ranks of a tensor-parallel
    engine, which step by rank 0's published plans and read every step). `verify_graphs`: it has verify
    graphs, the one path a verify step runs ahead on. Safe to use from the engine's stepping thread
    only, like the scheduler that owns it."""

    def __init__(self, proposer: Proposer | None, overlap: bool, verify_graphs: bool):
        self.proposer, self.overlap, self.verify_graphs = proposer, overlap, verify_graphs

    def run_ahead(self, plan: StepPlan, chunks: Sequence[ScheduledChunk], route: StepRoute) -> RunAhead:
        """May the step `chunks` of `plan` run ahead, on `route` (the route it takes ahead, as
        `pick_route` asks)? Only where it is device work up to its read and gets the inputs and picks
        the schedule that reads every step would give it: a plain decode step that drafts nothing
        (`_plain_refusal`), or a verify step the verify graphs take whose rows need nothing the read
        brings (`_verify_refusal`). A constrained row of a step behind an unread one picks after that
        read (its grammar must take the token in flight first)."""
        why = self.plan_refusal(plan)
        if why is None and any(ch.verify for ch in chunks):
            why = self._verify_refusal(chunks, route)
        elif why is None:
            why = self._plain_refusal(chunks, route, plan.draft)
        if why is not None:
            return RunAhead.refused(why)
        constrained = any(ch.request.grammar is not None and ch.request.in_flight for ch in chunks)
        return RunAhead(True, picks_after_read=constrained)

    def plan_refusal(self, plan: StepPlan) -> str | None:
        """Why no step of `plan` runs ahead, whatever its chunks (None: one may); the first part of
        `run_ahead`, which `Scheduler.schedule_ahead` asks before it takes any page for a step."""
        if not self.overlap:
            return "the overlap schedule is off (disabled, or a tensor-parallel engine)"
        if self.proposer is not None and plan.verify and not self.verify_graphs:
            return "a verify plan: verify steps run ahead as verify-graph replays only"
        if self.proposer is not None and not plan.verify and plan.draft:
            return "a plain step that drafts: the verify step after it needs its read"
        return None

    def _plain_refusal(self, chunks: Sequence[ScheduledChunk], route: StepRoute, draft: bool) -> str | None:
        """Why a step of no verify block may not run ahead (None: it may). Every chunk must decode one
        sampled token; with a proposer, one that observes on the device, no request's first drafts to
        make (`draft`, a request `undrafted`: a step ahead drafts nothing), and the step either a
        decode-graph replay that defers that observe (room left in the ring) or an eager forward with
        nothing deferred before it (it observes at once; what waits would need tokens in flight)."""
        if not all(_plain_decode(ch) for ch in chunks):
            return "not a plain decode step (a prefill chunk, snapshots or prompt scoring)"
        if self.proposer is None:
            return None
        if draft and any(ch.request.undrafted for ch in chunks):
            return "a request's first drafts to make (its prompt ended in a prefill-graph replay)"
        if self.proposer.needs_host:
            return "the proposer observes on the host, from the read"
        if route.path is Path.DECODE_GRAPH:
            return None if route.defers else "the decode graphs' deferred ring is full: the step observes"
        if any(ch.request.deferred_from is not None for ch in chunks):
            return "an eager step observes at once, after observes deferred to the ring"
        return None

    def _verify_refusal(self, chunks: Sequence[ScheduledChunk], route: StepRoute) -> str | None:
        """Why a verify step may not run ahead (None: it may). It must replay the verify graphs, and
        every row must have no observe deferred and no grammar (its block masks after drafts the host
        reads), and either pick its raw argmax (a block launched ahead is cut to its draft budget once
        read: `cut`) or sample with what it knows before the read (`_samples_ahead`)."""
        if route.path is not Path.VERIFY_GRAPH:  # a prefill beside it, or past the bucket or table row
            return "the verify graphs do not take its blocks"
        width = self.proposer.verify_shape.block
        for r in (ch.request for ch in chunks):
            if r.grammar is not None:
                return "a constrained row: its block is masked after the drafts the host reads"
            if r.deferred_from is not None:
                return "a row's observes wait in the deferred ring"
            if not (r.picks_argmax or _samples_ahead(r, width)):
                return "a sampled row whose acceptance needs the read (penalties, bans, its token limit)"
        return None

    def launched(self, chunks: Sequence[ScheduledChunk], route: StepRoute) -> None:
        """Record the step `chunks` as launched on `route`: a step that defers the proposer's observe
        leaves its positions waiting in the ring (`Request.deferred_from`), any other step with a
        proposer has it observe all that waited (`DraftDriver.catch_up`). A step run ahead counts at
        once what it computes: a plain step's token as computed and its pick as in flight, a verify
        step's block as verifying (what it commits is known once read). A prefill-graph replay drafts
        nothing (`route._on_path`): its requests' next blocks hold their anchors alone; any other step
        drafts where the next step verifies (the policy plans a drafting step before a verify step)."""
        for ch in chunks:
            r = ch.request
            r.undrafted = route.path is Path.PREFILL_GRAPH
            if route.defers and r.deferred_from is None:
                r.deferred_from = r.num_computed  # its observes wait in the ring from here
            elif not route.defers and self.proposer is not None:
                r.deferred_from = None  # the step had the proposer observe all that waited first
            if route.ahead and ch.verify:
                r.verifying += 1
            elif route.ahead:
                r.num_computed += 1
                r.in_flight += 1

    @staticmethod
    def cut(chunks: Sequence[ScheduledChunk]) -> list[ScheduledChunk]:
        """A verify step launched ahead verified whole blocks (the draft budgets were not known before
        the read ahead of it); now that the step before it is settled, each block is cut to what its
        request's draft budget allows: the block a step scheduled then would have held."""
        return [
            replace(ch, num_tokens=min(ch.num_tokens, 1 + ch.request.draft_budget(ch.num_drafts)))
            if ch.verify
            else ch
            for ch in chunks
        ]

    @staticmethod
    def settle(chunk: ScheduledChunk, result: ChunkResult, ahead: bool) -> bool:
        """Record what the read of a step launched `ahead` (or read at once) brought for `chunk`: its
        committed positions (a plain step run ahead counted its own when launched) and a constrained
        request's next drafts. False, with nothing recorded but the step's end, when the request
        ended while the step ran ahead (aborted, or stopped by the step before): it takes nothing."""
        request = chunk.request
        if ahead and chunk.verify:
            request.verifying -= 1
        elif ahead:
            request.in_flight -= 1
        if ahead and request.status is Status.FINISHED:
            return False
        if not ahead or chunk.verify:
            request.num_computed += result.committed
        request.host_drafts = result.drafts
        return True


def _plain_decode(ch: ScheduledChunk) -> bool:
    """A chunk that decodes one sampled token and scores no prompt position."""
    return (
        ch.num_tokens == 1
        and ch.samples
        and not ch.verify
        and not ch.snapshots
        and not ch.request.scores_prompt
    )


def _samples_ahead(request: Request, width: int) -> bool:
    """Whether a sampled row's verify block of `width` may be launched before the step ahead of it is
    read: its acceptance (`verify.accept`, between the graphs' replays) reads no output token
    (no penalties), no `min_tokens` ban is left, and its drafts stay clear of the token and length
    limits even after the most the step ahead can commit (its draft count, and so its draws from its
    generator, are those of the block the reading schedule would verify)."""
    unread = width * request.verifying  # the most the verify step in flight commits
    return not request.params.penalized and not request.banned_ids() and request.tokens_left - unread >= width
