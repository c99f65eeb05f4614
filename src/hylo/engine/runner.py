"""One step on the device: scheduled chunks -> batch tensors -> model -> picked tokens, read once.

Every step goes launch -> collect (`ModelRunner.launch`, `ModelRunner.collect`): launch runs the step
on its route (`engine/route.py`: an eager forward, or a decode-, verify- or prefill-graph replay),
launches its picks and starts its one read (`engine/launched.py`); collect waits for the read and
makes one result per chunk. The reading schedule is `collect(launch(...))`; the overlap schedule
launches the next step between the two (`Engine.step`). What the logits become is
`engine/picking.py`'s, every proposer call is the draft driver's (`engine/drafting.py`), the read the
reader's (`engine/reader.py`). The runner writes no request's counters: the scheduler's ledger does
(`InFlightLedger.launched`, `InFlightLedger.settle`).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DecodeGraphs
from hylo.engine.drafting import DraftDriver
from hylo.engine.launched import LaunchedStep, PickParts, PicksAhead, PicksAtOnce, StepPicks, VerifyReplay
from hylo.engine.picking import ChunkResult
from hylo.engine.prefill_graph import PrefillGraphs
from hylo.engine.reader import Reader
from hylo.engine.request import IN_FLIGHT
from hylo.engine.route import Decide, Path, StepRoute, pick_route
from hylo.engine.verify_graph import VerifyGraphs
from hylo.forward_batch import ForwardBatch
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import ForwardOutput, Glm5NextForCausalLM
from hylo.sampling import SEED_END
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.proposer import Proposer


class ModelRunner:
    """Runs steps on the paths `engine/route.py` picks between: plain decode steps through `graphs`,
    verify steps through `verify_graphs`, one-sequence prefill chunks through `prefill_graphs` (CUDA-
    graph replays of fixed-shape batches), everything else eagerly.

    A speculative step (eager or replayed) is device work from the batch upload to the one read of
    the picked tokens: drafts come from the proposer's device rows, acceptance, the KDA commit, the
    proposer's observe and its next drafts all run before that read (a `needs_host` proposer's after).
    With a proposer, `graphs` must have been captured with it: a proposer observes every forward's
    features, which those graphs then produce (and observe inside, for a device-side proposer). A
    plain graph step that drafts nothing defers that observe (the `DEFER` graphs); the next step that
    observes first has the proposer observe what waits (`DraftDriver.catch_up`), so the proposer still
    sees every committed token in order. A plain graph step of raw-argmax rows that drafts does so in
    its graph (`DRAFT`). Safe to use from the engine's stepping thread only."""

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
        self._seeds = random.Random(seed)  # the seeds of requests without one (`draw_seed`)
        self.reader = Reader()  # this engine's pinned read buffers (`Engine.close` empties them)
        self.parts = PickParts(model, caches.last_sampled, self.drafting, self.reader)

    def draw_seed(self) -> int:
        """The sampling seed of a request that brings none, drawn at its arrival: the runner's `seed`
        and the arrival order decide it (every rank of a tensor-parallel engine adds the same
        requests in the same order, so they draw the same seeds)."""
        return self._seeds.randrange(SEED_END)

    def route(self, chunks: Sequence[ScheduledChunk], plan: StepPlan, decide: Decide) -> StepRoute:
        """The route of a step of `chunks` and `plan` over this runner's graphs as they are now, run
        ahead where `decide` (the scheduler's ledger) lets it (`pick_route`)."""
        return pick_route(chunks, plan, self, decide)

    def launch(self, chunks: Sequence[ScheduledChunk], route: StepRoute) -> LaunchedStep:
        """Launch the step on its `route` without waiting for it: the proposer's catch-up where the
        step observes, the forward, and the step's picks (`engine/launched.py`) with the start of its
        one read. A step run `route.ahead` may feed in-flight tokens (`Request.tokens`); one whose picks
        wait for the read before it (`RunAhead.picks_after_read`: a constrained row's grammar must take
        the token before first) launches only its forward, and `sample_launched` picks once the step
        before has been applied."""
        if self.drafting is not None and not route.defers:  # this step observes: all before it first
            self.drafting.catch_up([ch.request for ch in chunks])
        launched = LaunchedStep(list(chunks), route, self._picks(chunks, route))
        if not route.run_ahead.picks_after_read:
            launched.read = launched.picks.start()
        return launched

    def sample_launched(self, launched: LaunchedStep) -> None:
        """The picks of a step launched without them, its requests' bookkeeping counting its token in
        flight already (the scheduler's ledger); rows of requests that ended meanwhile pick
        unconstrained (dropped)."""
        launched.read = launched.picks.start()

    def collect(self, launched: LaunchedStep) -> list[ChunkResult]:
        """Wait for a launched step's read: one result per chunk (a verify step launched ahead has had
        its blocks cut to the requests' draft budgets by the scheduler's ledger: `InFlightLedger.cut`)."""
        return launched.picks.results(launched.chunks, launched.read.wait())

    def _picks(self, chunks: Sequence[ScheduledChunk], route: StepRoute) -> StepPicks:
        """The step's forward, and how it picks: the verify graphs' replays, or a forward whose picks are
        read at once or run ahead."""
        if route.path is Path.VERIFY_GRAPH:  # forward, acceptance, commit and drafts in the replays
            return VerifyReplay(self.parts, chunks, route, self.verify_graphs)
        batch, forward = self._forward(chunks, route)
        if route.ahead:
            return PicksAhead(self.parts, chunks, route, batch, forward)
        return PicksAtOnce(self.parts, chunks, route, batch, forward)

    def _forward(
        self, chunks: Sequence[ScheduledChunk], route: StepRoute
    ) -> tuple[ForwardBatch, ForwardOutput]:
        """The step's batch and forward: a decode- or prefill-graph replay (which takes the chunk's
        snapshots too), or the batch built and run eagerly (a verify chunk's drafts fed from the
        proposer's rows, an in-flight token from its row's last pick, the features a resuming proposer
        needs kept with the prefix snapshots)."""
        if route.path is Path.DECODE_GRAPH:
            return self.graphs.run(route.seqs, route.variant)
        if route.path is Path.PREFILL_GRAPH:
            return self.prefill_graphs.run(route.seqs)
        c, drafting = self.caches, self.drafting
        batch = ForwardBatch.build(
            route.seqs, c.table.table, c.tokens, c.states, c.kpool, snapshot_pool=c.snapshots
        )
        if route.ahead:  # an in-flight token is its row's last pick, as the decode graphs take it
            ids = batch.input_ids
            ids.copy_(torch.where(ids == IN_FLIGHT, c.last_sampled[batch.token_rows], ids))
        elif drafting is not None:
            drafting.feed_drafts(batch, chunks)
        forward = self.model(batch, () if drafting is None else drafting.capture_layers)
        if any(ch.snapshots for ch in chunks) and c.snapshot_features.shape[1]:
            drafting.keep_snapshot_features(batch, forward)
        return batch, forward
