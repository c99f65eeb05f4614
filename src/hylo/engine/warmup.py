"""The start-up warm-up: one eager step of each shape class a request can reach, run on dummy tokens
before the engine reports ready, so that no request pays for compiling a kernel.

Why: Triton compiles a kernel at its first launch with a new specialisation: each value of its
constexprs (tile and padding sizes the wrappers derive from token, sequence and pool counts, mostly
as powers of two) and each integer argument's class (equal to 1, divisible by 16, neither). Graph
capture (`graph_bank`) compiles what the graphs replay; the eager paths compiled at their first
request (issue 45: a fresh H100 took 5.8 s to the first token of the first 8K-token prompt). They are
prefill chunks longer than the largest prefill-graph bucket, mixed steps (a prefill chunk beside decode
rows or verify blocks), several sequences prefilled in one step, prompt logprobs, prefix-cache
snapshot steps, batches past the largest graph bucket, and the proposer's eager observe and propose.

What runs (`warmup_steps`, every step on the eager route whatever graphs the engine has):
- token counts: one sequence from position 0 feeding n tokens, n each power of two up to the longest
  prefill chunk and, beside each, 2^k + kpool + 1 (its token count and its k-pool count neither 1
  nor a multiple of 16), and the longest chunk itself;
- contexts: for each power of two T past the longest chunk, and the request table's length, a chunk
  ending at T that samples nothing (a long prompt's middle chunk), a decode token and (with a proposer)
  a verify block just before T, so that the pool counts the indexer sizes its tiles by are reached;
- sequence counts S (1, then 2^k - 1 and 2^k, up to the running-request limit): S decode rows, S
  short prefills sharing one chunk's budget, a prefill chunk beside S - 1 decode rows, and with a
  proposer S verify blocks and a prefill chunk beside S - 1 verify blocks; a batch's last row samples
  (temperature, top-k, top-p, min-p, logprobs), the others pick greedily;
- a chunk that scores its prompt (prompt logprobs), of the most tokens such a chunk takes;
- with prefix-cache snapshots: a chunk leaving them at a KDA chunk boundary and at its end, and one
  leaving one off a boundary (the segmented path).
Each goes through the runner as a step read at once (`ModelRunner.launch`, `collect`): the forward,
the picks, the verify blocks' acceptance and KDA commit, the prompt logprobs, the proposer's observe
and drafts.

Where it writes: every warm-up sequence lives in the scratch slot (`CacheManager.scratch_slot`: its
request-table row, every position of which maps into the scratch page, its KDA state slot, its draft
row and its `last_sampled` entry), which no request ever owns; snapshot steps borrow one free snapshot
id and put back its contents and the id. No request, page, slot, prefix-cache node or sampling seed is
touched: the engine serves after a warm-up exactly as without one.

The builder runs it on CUDA unless `--skip-warmup` (`EngineConfig.skip_warmup`, as SGLang's
`--skip-server-warmup`). On the CPU every op runs its torch reference and nothing compiles: it is
skipped there (and logged), which keeps the many engines of the test suite fast.

Compiled kernels persist on disk: Triton's in `TRITON_CACHE_DIR` (default `~/.triton/cache`, under
`TRITON_HOME` when set), keyed by the kernel's source, specialisation, GPU and Triton version; hylo's
CUDA C++ libraries in `$HYLO_CACHE/kernels` (default `~/.cache/hylo/kernels`, `ops/gemm/cuda_build`).
A restart on the same machine finds them there and the warm-up costs the steps' run time and the
kernels' loading; a fresh machine or a container without those directories compiles everything once,
in the warm-up.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DecodeGraphs
from hylo.engine.drafting import DraftDriver
from hylo.engine.prefill_graph import PrefillGraphs
from hylo.engine.request import Request, Status
from hylo.engine.route import RunAhead, StepRoute, pick_route
from hylo.engine.runner import ModelRunner
from hylo.engine.scheduler import MAX_SCORED_CHUNK_TOKENS
from hylo.engine.verify_graph import VerifyGraphs
from hylo.memory.manager import CacheManager, MemoryPlan
from hylo.ops.kda import CHUNK_TOKENS
from hylo.sampling import SamplingParams
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.proposer import Proposer

logger = logging.getLogger("hylo")

# What a warm-up chunk is (`WarmupChunk.kind`): a prompt's last chunk (it samples), a chunk of a prompt
# that goes on (it samples nothing), one decode token, a verify block, a last chunk scoring its prompt.
LAST, MIDDLE, DECODE, VERIFY, SCORE = "last", "middle", "decode", "verify", "score"

GREEDY = SamplingParams(temperature=0)
SAMPLED = SamplingParams(temperature=0.7, top_k=40, top_p=0.9, min_p=0.01, logprobs=2, seed=0)
SCORED = SamplingParams(temperature=0, prompt_logprobs=1)


def compiles_kernels(device: torch.device) -> bool:
    """Whether first launches on `device` compile kernels (the GPU's Triton and CUDA kernels; the CPU
    runs the torch references)."""
    return device.type == "cuda"


def warmup_refusal(skip: bool, device: torch.device) -> str | None:
    """Why an engine on `device` starts without a warm-up (`skip`: `--skip-warmup`), None when it warms up."""
    if skip:
        return "--skip-warmup"
    if not compiles_kernels(device):
        return f"nothing compiles on {device.type}"
    return None


@dataclass(frozen=True)
class WarmupChunk:
    """One warm-up sequence: `tokens` new tokens after `prefix` cached ones, as `kind` says;
    `snapshots`: prefix-cache snapshots after that many of its tokens."""

    kind: str
    prefix: int
    tokens: int
    snapshots: tuple[int, ...] = ()


@dataclass(frozen=True)
class WarmupStep:
    """One eager step of the warm-up; `path` names the shape class it stands for (in errors, tests)."""

    path: str
    chunks: tuple[WarmupChunk, ...]


@dataclass(frozen=True)
class WarmupShapes:
    """The engine's limits the warm-up's shapes follow: the longest prefill chunk
    (`EngineConfig.longest_prefill_step`), the request table's length, the running-request limit, the
    k-pool size, the verify block (None without a proposer), whether prefix-cache snapshots are taken
    and whether a step may mix prefill chunks with decode or verify rows (`builder.mixes_steps`)."""

    longest_chunk: int
    max_len: int
    max_seqs: int
    kpool: int
    verify_block: int | None
    snapshots: bool
    mixed: bool = True

    @classmethod
    def of(
        cls,
        longest_prefill_step: int,
        plan: MemoryPlan,
        caches: CacheManager,
        proposer: Proposer | None,
        mixed: bool = True,
    ) -> WarmupShapes:
        """The shapes of an engine of `plan` with these caches and proposer."""
        return cls(
            min(longest_prefill_step, plan.max_len), plan.max_len, plan.num_slots, caches.kpool,
            None if proposer is None else proposer.verify_shape.block,
            caches.prefix is not None and plan.num_snapshots > 0, mixed,
        )  # fmt: skip

    @property
    def room(self) -> int:
        """The last position + 1 a warm-up chunk may reach: a proposer drafts past a chunk's end."""
        return self.max_len - (self.verify_block - 1 if self.verify_block else 0)

    @property
    def short(self) -> int:
        """A short chunk that crosses two KDA chunk boundaries and completes pools, with a tail."""
        return min(2 * CHUNK_TOKENS + self.kpool + 1, self.longest_chunk)


def token_counts(longest: int, kpool: int) -> list[int]:
    """1, every power of two up to `longest` and beside it 2^k + kpool + 1, and `longest` itself: each
    next-power-of-two class of counts up to `longest` with a member divisible by 16 (from 16 up) and
    one that is not, whose k-pool count is not either."""
    counts, p = {longest}, 1
    while p <= longest:
        counts.update(n for n in (p, p + kpool + 1) if n <= longest)
        p *= 2
    return sorted(counts)


def sequence_counts(most: int) -> list[int]:
    """1, then 2^k - 1 and 2^k up to `most`, and `most`: each next-power-of-two class of S + 1 (how the
    KDA kernels size a step's sequence tiles) and of S, up to `most`."""
    counts, p = {1, most}, 2
    while p <= most:
        counts.update((p - 1, p))
        p *= 2
    return sorted(counts)


def warmup_steps(shapes: WarmupShapes) -> list[WarmupStep]:
    """The warm-up's steps for an engine of `shapes` (see the module), those that fit its table."""
    steps = [
        *_token_steps(shapes),
        *_context_steps(shapes),
        *(step for s in sequence_counts(shapes.max_seqs) for step in _batch_steps(shapes, s)),
        WarmupStep(
            "prompt logprobs", (WarmupChunk(SCORE, 0, min(MAX_SCORED_CHUNK_TOKENS, shapes.longest_chunk)),)
        ),
        *_snapshot_steps(shapes),
    ]
    return [step for step in steps if all(0 <= c.prefix <= shapes.room - c.tokens for c in step.chunks)]


def _token_steps(shapes: WarmupShapes) -> list[WarmupStep]:
    counts = token_counts(min(shapes.longest_chunk, shapes.room), shapes.kpool)
    return [WarmupStep("prefill", (WarmupChunk(LAST, 0, n),)) for n in counts]


def _context_steps(shapes: WarmupShapes) -> list[WarmupStep]:
    longest, room, tail = shapes.longest_chunk, shapes.room, shapes.kpool + 1
    ends, end = {room} if room > longest else set(), 2 * longest
    while end <= room:
        ends.add(end)
        end *= 2
    steps = []
    for end in sorted(ends):
        steps.append(WarmupStep("long context", (WarmupChunk(MIDDLE, end - longest, longest),)))
        steps.append(WarmupStep("long decode", (WarmupChunk(DECODE, end - tail - 1, 1),)))
        if shapes.verify_block:
            block = shapes.verify_block
            steps.append(WarmupStep("long verify", (WarmupChunk(VERIFY, end - tail - block, block),)))
    return steps


def _batch_steps(shapes: WarmupShapes, seqs: int) -> list[WarmupStep]:
    """The steps of `seqs` sequences: decode rows, short prefills, mixed steps (where the engine mixes),
    verify blocks."""
    short, block = shapes.short, shapes.verify_block
    each = max(1, min(short, shapes.longest_chunk // seqs))  # the prefills share one chunk's budget
    rows = seqs - 1
    steps = [
        WarmupStep("decode batch", (WarmupChunk(DECODE, short, 1),) * seqs),
        WarmupStep("prefill batch", (WarmupChunk(LAST, 0, each),) * seqs),
    ]
    mixes = rows and shapes.mixed
    if mixes:
        steps.append(
            WarmupStep("mixed", (WarmupChunk(LAST, 0, short), *(WarmupChunk(DECODE, short, 1),) * rows))
        )
    if block:
        steps.append(WarmupStep("verify batch", (WarmupChunk(VERIFY, short, block),) * seqs))
        if mixes:
            verify = (WarmupChunk(VERIFY, short, block),) * rows
            steps.append(WarmupStep("mixed verify", (WarmupChunk(LAST, 0, short), *verify)))
    return steps


def _snapshot_steps(shapes: WarmupShapes) -> list[WarmupStep]:
    if not shapes.snapshots:
        return []
    n = shapes.short
    if n < 2:
        return []
    off = CHUNK_TOKENS + 1 if n > CHUNK_TOKENS + 1 else n - 1  # inside the chunk, off a KDA chunk's end
    steps = [WarmupStep("snapshot off a KDA chunk boundary", (WarmupChunk(LAST, 0, n, (off,)),))]
    if n > CHUNK_TOKENS:
        on = WarmupChunk(LAST, 0, n, (CHUNK_TOKENS, n))
        steps.insert(0, WarmupStep("snapshots on KDA chunk boundaries", (on,)))
    return steps


class _EagerPaths:
    """The runner's paths with no graphs (`route.Paths`): every warm-up step takes the eager route."""

    graphs: DecodeGraphs | None = None
    verify_graphs: VerifyGraphs | None = None
    prefill_graphs: PrefillGraphs | None = None

    def __init__(self, caches: CacheManager, drafting: DraftDriver | None):
        self.caches, self.drafting = caches, drafting


def _read_at_once(plan: StepPlan, chunks: Sequence[ScheduledChunk], route: StepRoute) -> RunAhead:
    return RunAhead.refused("a warm-up step is read at once")


def warm_up(runner: ModelRunner, caches: CacheManager, steps: Sequence[WarmupStep], vocab: int) -> float:
    """Run `steps` eagerly through `runner` in the scratch slot of `caches` (see the module); the
    seconds they took. Safe to use when no step is in flight (at start-up: the builder's call)."""
    if caches.scratch_slot is None:
        raise ValueError("caches: the warm-up runs in the scratch slot (MemoryPlan scratch=True)")
    borrowed = _borrow_snapshot(caches) if any(c.snapshots for s in steps for c in s.chunks) else None
    paths, plan = _EagerPaths(caches, runner.drafting), StepPlan(verify=True, draft=True)
    start = time.perf_counter()
    try:
        for step in steps:
            sid = None if borrowed is None else borrowed[0]
            chunks = [
                _scheduled(c, i, len(step.chunks), caches, vocab, sid) for i, c in enumerate(step.chunks)
            ]
            try:
                runner.collect(runner.launch(chunks, pick_route(chunks, plan, paths, _read_at_once)))
            except Exception as exc:
                sizes = [(c.kind, c.prefix, c.tokens) for c in step.chunks]
                raise RuntimeError(
                    f"warm-up step {step.path!r} ((kind, prefix, tokens) {sizes}) failed: {exc} "
                    "(--skip-warmup starts the engine without the warm-up)"
                ) from exc
        device = caches.table.table.device
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    finally:
        if borrowed is not None:
            _give_back(caches, *borrowed)
    return time.perf_counter() - start


def _scheduled(
    c: WarmupChunk, row: int, rows: int, caches: CacheManager, vocab: int, sid: int | None
) -> ScheduledChunk:
    """Warm-up sequence `row` of a step of `rows` as the scheduler would make it: a request in the scratch
    slot with `c.prefix` tokens computed (the last row of a batch samples, the others pick greedily)."""
    tokens = [(i * 7919 + row * 104729) % vocab for i in range(c.prefix + c.tokens + 1)]  # varied ids
    params = SCORED if c.kind == SCORE else SAMPLED if row == rows - 1 > 0 else GREEDY
    if c.kind in (DECODE, VERIFY):  # the prompt, then the token the block or decode row feeds first
        prompt, output = tokens[: c.prefix], tokens[c.prefix : c.prefix + 1]
    else:  # a middle chunk's prompt goes on after it
        prompt, output = tokens[: c.prefix + c.tokens + (c.kind == MIDDLE)], []
    request = Request(f"warm-up-{row}", prompt, params, frozenset(), caches.table.max_len)
    request.output_ids, request.num_computed = output, c.prefix
    request.status, request.slot = Status.RUNNING, caches.scratch_slot
    snapshots = tuple((c.prefix + point, sid) for point in c.snapshots)
    return ScheduledChunk(request, c.tokens, verify=c.kind == VERIFY, snapshots=snapshots)


def _borrow_snapshot(caches: CacheManager) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A free snapshot id and its contents (on the host: no device memory is taken for them)."""
    got = caches.snapshot_ids.alloc(1)
    if got is None:
        raise ValueError("caches: the warm-up's snapshot steps need a free prefix-cache snapshot")
    (sid,) = got
    states = caches.snapshots
    kept = (states.conv[:, sid], states.recurrent[:, sid], caches.snapshot_features[sid])
    return sid, *(t.to("cpu", copy=True) for t in kept)


def _give_back(
    caches: CacheManager, sid: int, conv: torch.Tensor, recurrent: torch.Tensor, features: torch.Tensor
) -> None:
    """Put back a borrowed snapshot's contents, then its id (`FreeList.free` restores the order)."""
    caches.snapshots.conv[:, sid] = conv
    caches.snapshots.recurrent[:, sid] = recurrent
    caches.snapshot_features[sid] = features
    caches.snapshot_ids.free([sid])
