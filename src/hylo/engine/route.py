"""A step's route: the path its device work takes, picked once per step from its chunks and plan.

The paths are a closed set (`Path`): an eager forward, a decode-graph replay in one of its variants
(observe, defer, draft: `cuda_graph`), the verify graphs' two replays, a prefill-graph replay.
`pick_route` is the one place that decides graph or eager, as vLLM's CUDA-graph dispatcher picks a
runtime mode by a batch descriptor; the runner launches what the route says (`ModelRunner.launch`).

A route also says whether its step runs ahead (`run_ahead`): launched before the step ahead of it is
read, its inputs may be tokens still in flight and its picks go to `CacheManager.last_sampled` for the
step behind it. Whether a step may run ahead is the scheduler's ledger's decision, asked once per pick
on the route the step would take ahead (`InFlightLedger.run_ahead`); refused, the step is read at once
on the same path.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DEFER, OBSERVE, DecodeGraphs
from hylo.engine.drafting import DraftDriver
from hylo.engine.picking import PickLayout, prompt_targets
from hylo.engine.prefill_graph import PrefillGraphs
from hylo.engine.request import IN_FLIGHT
from hylo.engine.verify_graph import VerifyGraphs
from hylo.forward_batch import SequenceChunk
from hylo.memory.manager import CacheManager
from hylo.speculative.adaptive import StepPlan


class Path(enum.Enum):
    EAGER = "eager"  # the batch built and run as plain calls
    DECODE_GRAPH = "decode graph"  # one replay of the decode graphs, in the route's variant
    VERIFY_GRAPH = "verify graph"  # the verify graphs' replays: verify and accept, then commit
    PREFILL_GRAPH = "prefill graph"  # one replay of the prefill graphs (one chunk)


@dataclass(frozen=True)
class RunAhead:
    """Whether a step runs ahead of the read before it (`ok`) and, refused, why (`reason`), as the
    scheduler's ledger decides it (`InFlightLedger.run_ahead`). `picks_after_read`: it runs ahead but
    picks once the step before has been read and applied (a constrained row: its grammar must take
    the token before first)."""

    ok: bool
    reason: str = ""
    picks_after_read: bool = False

    @classmethod
    def refused(cls, reason: str) -> RunAhead:
        return cls(False, reason)


AHEAD = RunAhead(True)  # a route as its step would take it ahead, before the ledger is asked


@dataclass(frozen=True)
class StepRoute:
    """How one step runs (`pick_route`). `seqs`: the step's sequences as its path takes them (a verify
    graph's blocks padded to the graphs' width). `variant`: a decode graph's (`OBSERVE` elsewhere).
    `draft`: the proposer drafts for the next step after this one's picks (what the variant did not).
    `observed`: the proposer's observe ran, or was deferred, inside the replay. `run_ahead`: whether
    the step runs ahead, and if not why. `layout`: the rows each chunk picks from, for a step read at
    once that is not a verify-graph replay (None for the others)."""

    path: Path
    seqs: list[SequenceChunk]
    variant: str = OBSERVE
    draft: bool = False
    observed: bool = False
    run_ahead: RunAhead = AHEAD
    layout: PickLayout | None = None

    @property
    def ahead(self) -> bool:
        """The step is launched before the one ahead of it is read."""
        return self.run_ahead.ok

    @property
    def defers(self) -> bool:
        """The step leaves the proposer's observe in the decode graphs' deferred ring."""
        return self.variant == DEFER


class Paths(Protocol):
    """What picking a route reads of the runner, at each pick (a benchmark may swap its graphs)."""

    caches: CacheManager
    drafting: DraftDriver | None
    graphs: DecodeGraphs | None
    verify_graphs: VerifyGraphs | None
    prefill_graphs: PrefillGraphs | None


# the scheduler's ledger's decision (`InFlightLedger.run_ahead`): may the step of (plan, chunks) run
# ahead on the route it would take ahead?
Decide = Callable[[StepPlan, Sequence[ScheduledChunk], StepRoute], RunAhead]


def pick_route(chunks: Sequence[ScheduledChunk], plan: StepPlan, paths: Paths, decide: Decide) -> StepRoute:
    """The route of a step of `chunks` and `plan` over the runner's `paths`: a verify step whose blocks
    the verify graphs take replays them (shorter blocks padded), a plain decode step the decode graphs
    take replays them, one prefill chunk the prefill graphs take replays them, anything else (prefix
    snapshots, prompt scoring, mixed steps, batches past the largest bucket) runs eagerly; each graph
    is asked once. The step runs ahead where the ledger lets it (`decide`, asked on the route it takes
    ahead: drafting nothing, a decode-graph replay deferring its observe where the ring has room);
    refused, it is read at once, its proposer drafting after it as `plan` says (never after a prefill
    graph's replay: the request's next block is its anchor alone, `Request.undrafted`)."""
    targets = [prompt_targets(ch) for ch in chunks]  # prompt positions each chunk scores
    seqs = [_sequence(ch, bool(scored)) for ch, (_, scored) in zip(chunks, targets, strict=True)]
    path, seqs = _path(chunks, seqs, paths)
    ahead = _on_path(path, seqs, chunks, False, paths)
    decision = decide(plan, chunks, ahead)
    if decision.ok:
        return replace(ahead, run_ahead=decision)
    read = _on_path(path, seqs, chunks, plan.draft, paths) if plan.draft else ahead
    layout = None if path is Path.VERIFY_GRAPH else PickLayout.of(chunks, targets)
    return replace(read, run_ahead=decision, layout=layout)


def _path(
    chunks: Sequence[ScheduledChunk], seqs: list[SequenceChunk], paths: Paths
) -> tuple[Path, list[SequenceChunk]]:
    """The path that takes the step, and its sequences as that path takes them."""
    graphs, verify_graphs, prefill_graphs = paths.graphs, paths.verify_graphs, paths.prefill_graphs
    snapshots = any(ch.snapshots for ch in chunks)  # only eager forwards and prefill graphs take them
    decode = not snapshots and graphs is not None and graphs.accepts(seqs)
    blocks = None if snapshots else _full_blocks(seqs, verify_graphs, paths.caches)
    if blocks is not None and verify_graphs.accepts(blocks):
        return Path.VERIFY_GRAPH, blocks
    if decode:
        return Path.DECODE_GRAPH, seqs
    if prefill_graphs is not None and prefill_graphs.accepts(seqs):
        return Path.PREFILL_GRAPH, seqs
    return Path.EAGER, seqs


def _on_path(
    path: Path, seqs: list[SequenceChunk], chunks: Sequence[ScheduledChunk], draft: bool, paths: Paths
) -> StepRoute:
    """The route on `path` of a step whose proposer drafts after it when `draft` (a replayed verify
    step drafts regardless; a decode-graph replay that defers or drafts inside leaves nothing to do)."""
    if path is Path.VERIFY_GRAPH:
        return StepRoute(path, seqs, draft=True)
    if path is Path.PREFILL_GRAPH:
        # no drafting after the replay: an eager propose for one request costs a few replays (RESULTS
        # S26-2), and the step after it verifies the request's anchor alone and drafts in its graph
        return StepRoute(path, seqs, observed=paths.prefill_graphs.observes)
    if path is Path.EAGER:
        return StepRoute(path, seqs, draft=draft)
    graphs, variant = paths.graphs, OBSERVE
    if graphs.defers:
        variant, draft = paths.drafting.decode_variant([ch.request for ch in chunks], draft)
    return StepRoute(path, seqs, variant, draft, graphs.observes)


def _full_blocks(
    seqs: list[SequenceChunk], graphs: VerifyGraphs | None, caches: CacheManager
) -> list[SequenceChunk] | None:
    """The verify step as blocks of the verify graphs' width: shorter blocks (a request within a
    block of its token limit) verify placeholder drafts up to the width, where the request table
    has room for them. None when the step is not all verify blocks or a block cannot grow."""
    if graphs is None or not all(s.verify for s in seqs):
        return None
    width, room = graphs.tokens_per_seq, caches.table.table.shape[1]
    # a block after a commit in flight starts up to a block later
    if any(s.prefix_len + width * (1 + s.after_commit) > room or len(s.token_ids) > width for s in seqs):
        return None
    return [
        SequenceChunk([*s.token_ids, *[0] * (width - len(s.token_ids))], s.prefix_len, s.table_row,
                      s.state_slot, True, True, after_commit=s.after_commit)
        for s in seqs
    ]  # fmt: skip


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
