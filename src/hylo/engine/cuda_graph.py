"""Plain decode steps as CUDA-graph replays, one graph per batch-size bucket, captured at engine start.

A plain decode step (every sequence feeds one token and samples, no verify chunk) of B sequences
runs in the smallest bucket >= B: the step uploads one small tensor from pinned memory (each
sequence's prefix length, request-table row and token; filler sequences on the cache manager's
scratch slot pad it to the bucket), the replay builds the batch's metadata from it and the request
table on the device (`uniform_metadata`: positions, cache slots, completed pools, a pool table as
wide as the request table), runs the forward, and the first B rows of its logits are the step's.
Sampling stays outside the graph. Any other step runs eagerly.

Without capture (the CPU) the static batch goes through a plain call of the same code instead of a
replay: the same fixed-shape path, so that it can be checked against the eager one anywhere.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Sequence

import torch
from tqdm import tqdm

from hylo.engine.request import IN_FLIGHT, Request
from hylo.forward_batch import FixedShape, ForwardBatch, SequenceChunk, uniform_metadata
from hylo.memory.manager import CacheManager
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.speculative.proposer import Proposer, StepCommit
from hylo.speculative.verify import MAX_BLOCK_TOKENS, Acceptance, accept, greedy_accept

logger = logging.getLogger("hylo")

# Eager runs before a capture: kernels compile and per-batch host caches fill outside the graph.
WARMUP_RUNS = 2
# A plain decode step that drafts nothing leaves a device proposer's observe for later: the step's
# target features wait in a ring of positions per request (`DecodeGraphs.deferred`) until a step
# that observes (one that drafts, runs eagerly or verifies) or a full ring has the proposer observe
# them in one batch, its weights read once for all of them. The ring holds as many positions as
# DEFERRED_RING_BYTES allow for every request-table row, within these bounds.
MIN_DEFERRED_TOKENS, MAX_DEFERRED_TOKENS = 32, 256
DEFERRED_RING_BYTES = 256 * 2**20

# What a decode graph does with a device proposer: observe the step (`OBSERVE`), leave the observe
# for later (`DEFER`), or observe and draft from the greedy picks (`DRAFT`).
OBSERVE, DEFER, DRAFT = "observe", "defer", "draft"

# Every engine of the process captures (and warms up) its graphs on one stream per device. PyTorch keeps
# a cuBLAS workspace (32 MiB on Hopper) for each (handle, stream) a matmul ever ran on, for the life of
# the process (a captured graph bakes in its address), and MoE decode keeps ticket counters per stream
# (`ops.moe.decode.tickets`): a stream per engine left both behind for every engine closed. Sharing them
# is safe for the reason the graphs of one engine share a memory pool: graphs replay one at a time, on
# the current stream.
_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """The stream every CUDA graph of `device` is warmed up and captured on (made on first use)."""
    device = torch.device(device)
    if device.index is None:
        device = torch.device(device.type, torch.cuda.current_device())
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def batch_size_buckets(max_batch_size: int) -> list[int]:
    """1, 2, 4, then every multiple of 8 below `max_batch_size`, then `max_batch_size` itself."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size must be >= 1, got {max_batch_size}")
    small = [b for b in (1, 2, 4) if b < max_batch_size]
    return [*small, *range(8, max_batch_size, 8), max_batch_size]


class DecodeGraphs:
    """Fixed-shape decode batches for the buckets up to `max_batch_size`, captured as CUDA graphs when
    `capture` (all in one memory pool, the largest first so that the others reuse its memory).

    With a proposer that observes from device tensors, each bucket has two more graphs: a deferring
    one, whose step writes the features to the `deferred` ring (`[request-table rows,
    deferred_tokens, features]`) instead of running the observe (for steps that draft nothing), and
    a drafting one, whose step also drafts for the next from each sequence's argmax (for steps whose
    every row picks its raw argmax).

    Invariants: a static batch points at the scratch slot and at the slots of the last step it ran,
    nothing else; the batch and logits `run` returns stay valid until the next `run`.
    """

    tokens_per_seq = 1
    kind = "decode"
    bucket_unit = "batch sizes"
    memory_bytes = 0  # what the captured graphs hold, for the start-up memory report

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        max_batch_size: int,
        capture: bool,
        proposer: Proposer | None = None,
        pool: tuple[int, int] | None = None,
    ):
        """With a `proposer`, the forward also captures its features (the step's batch returns them)
        and, for one that drafts from device tensors, its observe runs inside the graph too. `pool`:
        a CUDA graph memory pool to share (the decode and verify graphs never replay at once)."""
        self.proposer, self.pool = proposer, pool
        if caches.scratch_slot is None:
            raise ValueError(
                "caches: fixed-shape decode batches need a scratch slot (MemoryPlan scratch=True)"
            )
        self.model, self.caches = model, caches
        self.deferred: torch.Tensor | None = None
        self.deferred_tokens = 0
        if self.defers:
            width = len(proposer.capture_layers) * model.config.hidden_size
            weight = model.embed_tokens.weight
            rows = caches.table.table.shape[0]
            fits = DEFERRED_RING_BYTES // max(1, rows * width * weight.element_size())
            self.deferred_tokens = max(MIN_DEFERRED_TOKENS, min(MAX_DEFERRED_TOKENS, fits))
            self.deferred = torch.zeros(
                rows, self.deferred_tokens, width, dtype=weight.dtype, device=weight.device
            )
        # (variant, bucket) -> the DEFER and DRAFT graphs and their outputs
        self.variants: dict[tuple[str, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...]]] = {}
        self.buckets = self._bucket_sizes(max_batch_size)
        self.pool_width = caches.table.table.shape[1] // caches.kpool
        self.static = self._static_batches()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, ...]] = {}
        if capture:
            self._capture_all()

    @staticmethod
    def _bucket_sizes(largest: int) -> list[int]:
        return batch_size_buckets(largest)

    def accepts(self, seqs: Sequence[SequenceChunk]) -> bool:
        """A plain decode step that fits the largest bucket."""
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == 1 and s.sample and not s.verify and not s.score for s in seqs
        )

    def run(self, seqs: Sequence[SequenceChunk], variant: str = OBSERVE) -> tuple[ForwardBatch, torch.Tensor]:
        """The step's padded batch (the bucket's static one) and the logits of its sequences,
        `[len(seqs), vocab]`, in order. `DEFER` and `DRAFT` only where `defers`: with `DEFER` the
        step's features go to the deferred ring at each sequence's (table row, position %
        deferred_tokens) instead of to the proposer's observe (the caller keeps track of what waits
        there: `Request.deferred_from`); with `DRAFT` the proposer also drafts, anchored on each
        sequence's argmax (right for raw-argmax rows only: the caller's choice)."""
        if not self.accepts(seqs):
            raise ValueError(
                f"seqs: a fixed-shape decode takes up to {self.buckets[-1]} sequences of one sampled "
                "token each"
            )
        if variant != OBSERVE and not self.defers:
            raise ValueError(f"variant: {variant} needs decode graphs of a device proposer")
        bucket, (logits,) = self._replay(seqs, variant)
        return self.static[bucket], logits[: len(seqs)]

    @property
    def observes(self) -> bool:
        """The proposer's observe runs inside the replay (nothing is left for the step to observe)."""
        return self.proposer is not None and not self.proposer.needs_host

    @property
    def defers(self) -> bool:
        """A step may leave its observe for later (a proposer that observes from device tensors)."""
        return self.observes

    def _replay(
        self, seqs: Sequence[SequenceChunk], variant: str = OBSERVE
    ) -> tuple[int, tuple[torch.Tensor, ...]]:
        """Upload the step's inputs of each sequence (`_upload`: prefix length, table row, first token),
        fillers after them, and replay (or, uncaptured, call) its bucket's graph of `variant`:
        (bucket, outputs)."""
        bucket = next(b for b in self.buckets if b >= len(seqs))
        # two pinned mirrors in turn: with overlapped steps the upload of the step before this one may
        # not have run yet, the one before that has (its tokens were read)
        self._uploads += 1
        host = self.host_inputs[bucket][self._uploads % 2]
        filler = [self._filler()] * (bucket - len(seqs))
        host.copy_(torch.tensor([self._upload(s) for s in seqs] + filler).t())
        self.step_inputs[bucket].copy_(host, non_blocking=True)
        static = self.static[bucket]
        if variant != OBSERVE:
            captured = self.variants.get((variant, bucket))
            if captured is None:
                return bucket, self._forward(static, variant)
            captured[0].replay()
            return bucket, captured[1]
        graph = self.graphs.get(bucket)
        if graph is None:
            return bucket, self._forward(static)
        graph.replay()
        return bucket, self.outputs[bucket]

    def _upload(self, seq: SequenceChunk) -> tuple[int, ...]:
        """What a step uploads of `seq`: its prefix length, table row and first token."""
        return seq.prefix_len, seq.table_row, seq.token_ids[0]

    def _filler(self) -> tuple[int, ...]:
        """What a step uploads of a filler sequence (the scratch slot's row, at its start)."""
        assert self.caches.scratch_slot is not None
        return 0, self.caches.scratch_slot, 0

    def _static_batches(self) -> dict[int, ForwardBatch]:
        """One static batch per bucket, its pool table as wide as the request table's, and the step's
        inputs of each sequence (`_upload`) with two pinned mirrors."""
        static = {}
        device = self.caches.table.table.device
        self.step_inputs: dict[int, torch.Tensor] = {}
        self.host_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._uploads = 0
        for bucket in self.buckets:
            batch = self._build([], bucket)
            full_width = torch.full((bucket, self.pool_width), -1, device=batch.pool_table.device)
            static[bucket] = dataclasses.replace(batch, pool_table=full_width)
            inputs = torch.tensor([self._filler()] * bucket).t().contiguous()
            mirror = inputs.pin_memory if device.type == "cuda" else inputs.clone
            self.host_inputs[bucket] = (mirror(), mirror())
            self.step_inputs[bucket] = inputs.to(device)
        return static

    def _fill_metadata(self, static: ForwardBatch) -> None:
        """The step's batch metadata, in place, from the uploaded inputs and the request table
        (`uniform_metadata`), and each sequence's first token: `IN_FLIGHT` takes the token its row
        sampled last (`CacheManager.last_sampled`, an overlapped step's)."""
        inputs = self.step_inputs[len(static.extend_lens)]
        prefix, rows, first = self._prefix(inputs), inputs[1], inputs[2]
        c = self.caches
        meta = uniform_metadata(prefix, rows, self.tokens_per_seq, c.table.table, c.kpool, c.scratch_slot)
        for name, value in meta.items():
            getattr(static, name).copy_(value)
        first = torch.where(first == IN_FLIGHT, c.last_sampled[rows], first)
        static.input_ids.view(len(static.extend_lens), self.tokens_per_seq)[:, 0] = first

    def _prefix(self, inputs: torch.Tensor) -> torch.Tensor:
        """Each sequence's prefix length from the step's uploaded inputs."""
        return inputs[0]

    def _forward(self, static: ForwardBatch, variant: str = OBSERVE) -> tuple[torch.Tensor, ...]:
        """What a replay of `variant` computes from the static batch (captured once per bucket and
        variant)."""
        self._fill_metadata(static)
        if self.proposer is None:
            return (self.model(static),)
        logits = self.model(static, self.proposer.capture_layers)
        if variant == DEFER:  # filler sequences write the scratch row's ring
            if static.features is not None:  # (a proposer may read no features)
                ring = static.positions % self.deferred_tokens
                self.deferred[static.state_slots, ring] = static.features
        elif self.observes:
            seqs = len(static.extend_lens)
            device = logits.device
            ones = torch.ones(seqs, dtype=torch.int32, device=device)
            commit = StepCommit(ones, logits.argmax(-1), torch.arange(seqs, device=device))
            if variant == DRAFT:
                self.proposer.observe_and_propose(static, commit)
            else:
                self.proposer.observe(static, commit)
        return (logits,)

    def _build(self, seqs: Sequence[SequenceChunk], bucket: int) -> ForwardBatch:
        c = self.caches
        assert c.scratch_slot is not None
        fixed = FixedShape(bucket, self.pool_width, c.scratch_slot, self.tokens_per_seq, c.kpool)
        return ForwardBatch.build(seqs, c.table.table, c.tokens, c.states, c.kpool, fixed=fixed)

    def _capture_all(self) -> None:
        device = self.caches.table.table.device
        start, reserved_before = time.perf_counter(), torch.cuda.memory_reserved(device)
        pool, stream = self.pool or torch.cuda.graph_pool_handle(), capture_stream(device)
        self.pool = pool
        bar = tqdm(
            reversed(self.buckets), total=len(self.buckets), desc=f"Capturing {self.kind} CUDA graphs",
            unit="graph",
        )  # fmt: skip
        # A garbage collection during a capture can free an earlier engine's graphs or pinned buffers,
        # and their CUDA calls invalidate the capture (torch >= 2.5 no longer collects before one): the
        # collector runs once here and stays off until every bucket is captured.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(device):
                for bucket in bar:
                    bar.set_postfix(bucket=bucket)
                    self._capture(bucket, pool, stream)
        finally:
            if collecting:
                gc.enable()
        logger.info(
            "captured %d %s CUDA graphs (%s %s) in %.1f s, using %.2f GiB",
            len(self.buckets),
            self.kind,
            self.bucket_unit,
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            self._record_memory(torch.cuda.memory_reserved(device) - reserved_before) / 2**30,
        )

    def _record_memory(self, used: int) -> int:
        self.memory_bytes = used
        return used

    def _capture(self, bucket: int, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        static = self.static[bucket]
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self._warm(static)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self.outputs[bucket] = self._forward(static)
        self.graphs[bucket] = graph
        for variant in (DEFER, DRAFT) if self.defers else ():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                outputs = self._forward(static, variant)
            self.variants[variant, bucket] = (graph, outputs)

    def _warm(self, static: ForwardBatch) -> None:
        """One eager run of everything a bucket captures."""
        self._forward(static, DRAFT if self.defers else OBSERVE)


class VerifyGraphs(DecodeGraphs):
    """Speculative steps as CUDA-graph replays: every sequence verifies its anchor and all
    drafts of `proposer.verify_shape` (T = its block), two graphs per batch-size bucket.

    A step uploads one small tensor (each block's prefix length, request-table row and anchor, from
    pinned memory). The first graph builds the rest of the batch's metadata from it and the request
    table on the device (positions, cache slots, completed pools, the pool table), copies the drafts
    from the proposer's device rows into the static batch, and runs the target's forward (with the
    proposer's features) and greedy acceptance into static `committed [B]` / `anchors [B]` buffers.
    The second graph commits what those buffers say: the KDA commit, the proposer's observe and its
    drafts for the next step. A step whose every row is a raw-argmax greedy row without logprobs
    replays both back to back; any other step (sampled, penalised, logit-biased, logprob or
    `min_tokens`-banned rows) runs `verify.accept` on the first graph's logits between the two
    replays, exactly as an eager step would (same arguments, same generators), and overwrites the
    buffers' rows of its blocks. Filler sequences verify T tokens at the start of the scratch slot's
    row and keep their greedy commit.

    Steps it does not take (a prefill chunk, more sequences than the largest bucket) run eagerly; a
    shorter block is padded to the width by the runner.

    A block may start after the commit of a verify step still in flight on its row
    (`SequenceChunk.after_commit`, the overlap schedule): the commit graph leaves each row's committed
    positions and anchor in `CacheManager.last_committed` and `last_sampled`, and the next step's
    first graph adds the one to the uploaded prefix length and takes the other as the anchor
    (`IN_FLIGHT`), so a verify step can be launched before the one ahead of it has been read.
    """

    kind = "verify"

    def __init__(
        self,
        model: Glm5NextForCausalLM,
        caches: CacheManager,
        proposer: Proposer,
        max_batch_size: int,
        capture: bool,
        pool: tuple[int, int] | None = None,
    ):
        if proposer.needs_host:
            raise ValueError(
                "proposer: a verify graph needs a proposer that drafts from device tensors alone"
            )
        self.tokens_per_seq = proposer.verify_shape.block
        if self.tokens_per_seq > min(MAX_BLOCK_TOKENS, caches.plan.page_size):
            raise ValueError(
                f"proposer.verify_shape: verify graphs take blocks of 2 to "
                f"{min(MAX_BLOCK_TOKENS, caches.plan.page_size)} tokens, got {self.tokens_per_seq}"
            )
        self.commits: dict[int, torch.cuda.CUDAGraph] = {}
        super().__init__(model, caches, max_batch_size, capture, proposer, pool)

    def accepts(self, seqs: Sequence[SequenceChunk]) -> bool:
        return len(seqs) <= self.buckets[-1] and all(
            len(s.token_ids) == self.tokens_per_seq and s.verify for s in seqs
        )

    @property
    def defers(self) -> bool:
        return False  # a verify step drafts: it observes

    def run(
        self,
        seqs: Sequence[SequenceChunk],
        requests: Sequence[Request],
        num_drafts: Sequence[int],
        generator: torch.Generator | None,
        allowed: torch.Tensor | None = None,
    ) -> Acceptance:
        """Verify and commit the blocks of `requests` (`num_drafts[b]` real drafts in block b, the rest
        padding; `allowed [blocks · T, vocab]`: structured outputs, as `verify.accept` takes it); the
        acceptance of the step's blocks, in order (with logprobs where asked)."""
        if not self.accepts(seqs) or len(requests) != len(seqs) or len(num_drafts) != len(seqs):
            raise ValueError(
                f"seqs: a verify graph takes up to {self.buckets[-1]} verify blocks of "
                f"{self.tokens_per_seq} tokens, with one request and draft count each"
            )
        n, width = len(seqs), self.tokens_per_seq
        bucket, (logits, target, committed, anchors) = self._replay(seqs)
        if all(r.picks_argmax and r.params.logprobs is None for r in requests):
            result = Acceptance(committed[:n] - 1, target[:n])
        else:
            drafts = self.static[bucket].input_ids.view(bucket, width)[:n, 1:]
            result = accept(
                logits.view(bucket, width, -1)[:n], drafts, num_drafts, requests, generator, allowed
            )
            committed[:n] = result.accepted + 1
            anchors[:n] = result.emitted.gather(1, result.accepted[:, None])[:, 0]
        graph = self.commits.get(bucket)
        if graph is None:
            self._commit(self.static[bucket], committed, anchors)
        else:
            graph.replay()
        return result

    def _upload(self, seq: SequenceChunk) -> tuple[int, ...]:
        """And whether the block starts after the commit in flight on its row."""
        return (*super()._upload(seq), int(seq.after_commit))

    def _filler(self) -> tuple[int, ...]:
        return (*super()._filler(), 0)

    def _prefix(self, inputs: torch.Tensor) -> torch.Tensor:
        return inputs[0] + inputs[3] * self.caches.last_committed[inputs[1]]

    def _forward(self, static: ForwardBatch) -> tuple[torch.Tensor, ...]:
        """The first graph: `(logits [B·T, vocab], greedy picks [B, T], committed [B], anchors [B])`."""
        blocks, width = len(static.extend_lens), self.tokens_per_seq
        self._fill_metadata(static)
        ids = static.input_ids.view(blocks, width)
        ids[:, 1:] = self.proposer.drafts[static.state_slots]
        logits = self.model(static, self.proposer.capture_layers)
        target = logits.argmax(-1).view(blocks, width)
        drafts = torch.full((blocks,), width - 1, device=ids.device)
        accepted = greedy_accept(target, ids[:, 1:], drafts)
        return logits, target, (accepted + 1).int(), target.gather(1, accepted[:, None])[:, 0]

    def _commit(self, static: ForwardBatch, committed: torch.Tensor, anchors: torch.Tensor) -> None:
        """The second graph: the KDA commit and the proposer's observe and drafts, from the buffers,
        and each row's committed positions and anchor for a block launched behind this step."""
        self.model.commit(static, committed)
        self.caches.last_committed[static.state_slots] = committed
        self.caches.last_sampled[static.state_slots] = anchors
        commit = StepCommit(committed, anchors, torch.arange(len(static.extend_lens), device=anchors.device))
        self.proposer.observe_and_propose(static, commit)

    def _warm(self, static: ForwardBatch) -> None:
        self._commit(static, *self._forward(static)[2:])

    def _capture(self, bucket: int, pool: tuple[int, int], stream: torch.cuda.Stream) -> None:
        super()._capture(bucket, pool, stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, stream=stream):
            self._commit(self.static[bucket], *self.outputs[bucket][2:])
        self.commits[bucket] = graph
