"""A bank of CUDA graphs: one step shape's graphs for each bucket, captured at engine start, replayed.

The bank holds what every fixed-shape step has in common: its buckets; per bucket the static batch
and the step's inputs (a device tensor the graphs read, and two pinned mirrors the host writes in
turn); the capture (every graph in one memory pool, on one stream per device, the largest bucket first
so that the others reuse its memory, `WARMUP_RUNS` eager runs before it, the garbage collector off
throughout); the replay; and the memory figure. The step shape (`StepShape`) declares the rest: how a
bucket's sequences sit in its static batch and what a step uploads of them (its `BatchLayout`), and
the bodies each bucket captures. Shapes: decode (`cuda_graph.DecodeGraphs`, one body per variant),
verify (`verify_graph.VerifyGraphs`, a verify body and a commit body replayed in turn) and prefill
(`prefill_graph.PrefillGraphs`).

Without capture (the CPU) a replay is a plain call of the body on the static batch: the same
fixed-shape path, so that it can be checked against the eager one anywhere.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Sequence
from typing import NamedTuple, Protocol

import torch
from tqdm import tqdm

from hylo.forward_batch import ForwardBatch, SequenceChunk

logger = logging.getLogger("hylo")

# Eager runs before a capture: kernels compile and per-batch host caches fill outside the graph.
WARMUP_RUNS = 2

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


class BatchLayout(Protocol):
    """Where a step's sequences sit in a bucket's static batch, and what the step uploads of them."""

    def filler_inputs(self, bucket: int) -> torch.Tensor:
        """The step's inputs (on the host) of a bucket of filler sequences: what a capture runs on."""
        ...

    def static_batch(self, bucket: int, inputs: torch.Tensor) -> ForwardBatch:
        """The bucket's static batch (`inputs`: the bucket's step inputs on the device, which its
        tensors may view)."""
        ...

    def write_inputs(self, bucket: int, seqs: Sequence[SequenceChunk], host: torch.Tensor) -> None:
        """The step's inputs of `seqs` into `host`, a pinned mirror of the bucket's."""
        ...


class StepShape(Protocol):
    """What a kind of fixed-shape step declares to its `GraphBank`."""

    kind: str  # the step's name in the capture's log ("decode", "verify", "prefill")
    bucket_unit: str  # what a bucket counts ("batch sizes", "tokens")
    layout: BatchLayout
    bodies: tuple[str, ...]  # the graphs each bucket captures, in this order
    warm_bodies: tuple[str, ...]  # the bodies one eager run of everything a bucket captures calls

    def body(self, name: str, bucket: int) -> tuple[torch.Tensor, ...]:
        """What graph `name` of `bucket` computes from the bank's static batch and step inputs (a
        body may read the outputs of one run before it in the same step: `GraphBank.outputs`)."""
        ...


class Captured(NamedTuple):
    graph: torch.cuda.CUDAGraph
    outputs: tuple[torch.Tensor, ...]


class GraphBank:
    """The graphs of `shape` for `buckets`, on `device`, captured by `capture` into `pool` (a CUDA
    graph memory pool to share with other banks: the graphs of one engine never replay at once; one of
    its own when None).

    Invariants: a bucket's static batch and step inputs are made once and never reallocated (the
    graphs hold their addresses); `outputs[name, bucket]` are those of the latest run of that body,
    replayed or called, and stay valid until its next run.

    Safe to use when: one step at a time replays the bank's graphs, on the current stream."""

    memory_bytes = 0  # what the captured graphs hold, for the start-up memory report

    def __init__(
        self, shape: StepShape, buckets: list[int], device: torch.device, pool: tuple[int, int] | None
    ):
        self.shape, self.buckets, self.device, self.pool = shape, buckets, torch.device(device), pool
        self.static: dict[int, ForwardBatch] = {}
        self.step_inputs: dict[int, torch.Tensor] = {}
        # two pinned mirrors in turn: with overlapped steps the upload of the step before this one may
        # not have run yet, the one before that has (its tokens were read)
        self.host_inputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._uploads = 0
        for bucket in buckets:
            inputs = shape.layout.filler_inputs(bucket)
            mirror = inputs.pin_memory if self.device.type == "cuda" else inputs.clone
            self.host_inputs[bucket] = (mirror(), mirror())
            self.step_inputs[bucket] = inputs.to(self.device)
            self.static[bucket] = shape.layout.static_batch(bucket, self.step_inputs[bucket])
        self.graphs: dict[tuple[str, int], Captured] = {}
        self.outputs: dict[tuple[str, int], tuple[torch.Tensor, ...]] = {}

    def bucket_for(self, size: int) -> int:
        """The smallest bucket that holds `size` (sequences or tokens); at most the largest bucket."""
        return next(b for b in self.buckets if b >= size)

    def upload(self, bucket: int, seqs: Sequence[SequenceChunk]) -> None:
        """The step's inputs of `seqs` to the bucket's device tensor, from a pinned mirror."""
        self._uploads += 1
        host = self.host_inputs[bucket][self._uploads % 2]
        self.shape.layout.write_inputs(bucket, seqs, host)
        self.step_inputs[bucket].copy_(host, non_blocking=True)

    def replay(self, bucket: int, name: str) -> tuple[torch.Tensor, ...]:
        """Replay the bucket's graph `name` (uncaptured: call its body): its outputs."""
        captured = self.graphs.get((name, bucket))
        if captured is None:
            return self._call(name, bucket)
        captured.graph.replay()
        self.outputs[name, bucket] = captured.outputs
        return captured.outputs

    def warm(self, bucket: int) -> None:
        """One eager run of everything the bucket captures (kernels compiled, host caches filled)."""
        for name in self.shape.warm_bodies:
            self._call(name, bucket)

    def _call(self, name: str, bucket: int) -> tuple[torch.Tensor, ...]:
        outputs = self.outputs[name, bucket] = self.shape.body(name, bucket)
        return outputs

    def capture(self) -> None:
        """Capture every bucket's bodies, the largest bucket first, with the collector off."""
        start, reserved_before = time.perf_counter(), torch.cuda.memory_reserved(self.device)
        self.pool = self.pool or torch.cuda.graph_pool_handle()
        stream = capture_stream(self.device)
        kind = self.shape.kind
        bar = tqdm(
            reversed(self.buckets), total=len(self.buckets), desc=f"Capturing {kind} CUDA graphs",
            unit="graph",
        )  # fmt: skip
        # A garbage collection during a capture can free an earlier engine's graphs or pinned buffers,
        # and their CUDA calls invalidate the capture (torch >= 2.5 no longer collects before one): the
        # collector runs once here and stays off until every bucket is captured.
        gc.collect()
        collecting = gc.isenabled()
        gc.disable()
        try:
            with torch.cuda.device(self.device):
                for bucket in bar:
                    bar.set_postfix(bucket=bucket)
                    self._capture(bucket, stream)
        finally:
            if collecting:
                gc.enable()
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - reserved_before
        logger.info(
            "captured %d %s CUDA graphs (%s %s) in %.1f s, using %.2f GiB",
            len(self.buckets),
            kind,
            self.shape.bucket_unit,
            ",".join(map(str, self.buckets)),
            time.perf_counter() - start,
            self.memory_bytes / 2**30,
        )

    def _capture(self, bucket: int, stream: torch.cuda.Stream) -> None:
        """Warm the bucket up on `stream`, then capture its bodies in order."""
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(WARMUP_RUNS):
                self.warm(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        for name in self.shape.bodies:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                outputs = self.shape.body(name, bucket)
            self.graphs[name, bucket] = Captured(graph, outputs)
            self.outputs[name, bucket] = outputs
