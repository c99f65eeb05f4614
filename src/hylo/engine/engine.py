"""The engine: requests in, tokens out, one scheduled step at a time.

The step loop (`Engine.step`) reads as schedule-next, launch, settle-previous: one variable
(`in_flight`) holds the step launched and not yet read. Who owns what is said in the package
docstring (`hylo.engine`); the engine holds the requests by id, turns what a step read into text and
finished requests (`StepOutput`), and asks the draft-length policy for each step's plan.
"""

from __future__ import annotations

import gc
import logging
import threading
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from hylo.config import EngineConfig
from hylo.engine.builder import build_engine
from hylo.engine.chunk import ScheduledChunk
from hylo.engine.launched import LaunchedStep
from hylo.engine.picking import ChunkResult
from hylo.engine.request import Request, Status
from hylo.engine.route import RunAhead, StepRoute
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.parallel.control import Abort, AddRequest
from hylo.parallel.ranks import Ranks
from hylo.sampling import SamplingParams
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.proposer import Proposer, ProposerBuild
from hylo.structured import Grammars
from hylo.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("hylo")


def checked_token_ids(field: str, ids: Iterable[int], vocab: int) -> list[int]:
    """`ids` as a list of ints, or a ValueError naming `field` and the first id outside [0, vocab).
    Packed as int64 in C and range-checked by one reduction: a 13K-token prompt is checked in ~0.4 ms
    (a Python loop over it took ~0.8, paid before its first kernel is queued)."""
    try:
        packed = array("q", ids)
    except (TypeError, OverflowError) as error:
        raise ValueError(f"{field}: token ids must be integers in [0, {vocab}) ({error})") from None
    if packed:
        low, high = torch.aminmax(torch.frombuffer(packed, dtype=torch.long))
        if low < 0 or high >= vocab:
            bad = next(t for t in packed if not 0 <= t < vocab)
            raise ValueError(f"{field}: token id {bad} is outside the vocabulary [0, {vocab})")
    return packed.tolist()


@dataclass(frozen=True, eq=False)
class CheckedPrompt:
    """A prompt's ids as `Engine.validate_prompt` accepted them, for one engine and one `SamplingParams`:
    that engine's `add_request` and `validate_prompt` take it again, with those params, without a second
    pass over the ids (a server checks every prompt of a request before it queues any, then queues each:
    at 13K tokens each pass costs ~0.4 ms before the first kernel). `ids` is the engine's own list, not
    the caller's; safe to use when `params` is not changed after the check (the server and `LLM` copy
    params, never change them)."""

    ids: list[int]
    params: SamplingParams
    engine: Engine

    def __len__(self) -> int:
        return len(self.ids)


@dataclass
class StepOutput:
    """What one step did to one request: its new final text and tokens, and whether it finished."""

    request: Request
    new_token_ids: list[int]
    new_text: str
    accepted_drafts: int | None = None  # set for a verify step
    num_drafts: int | None = None  # the drafts that verify step checked (accepted_drafts of them kept)

    @property
    def finished(self) -> bool:
        return self.request.status is Status.FINISHED


class Engine:
    """Loads the model, sizes the caches from one memory budget (`engine/builder.py`), and runs the
    step loop. Safe to use from one thread at a time (`compile_constraint` from any)."""

    def __init__(
        self,
        config: EngineConfig,
        proposer: Proposer | ProposerBuild | None = None,
        decode_graphs: bool | None = None,
        target: Glm5NextForCausalLM | None = None,
        ranks: Ranks | None = None,
    ):
        """`proposer` overrides the one `config.speculative_algorithm` would build: a `ProposerBuild`
        (its caches are allocated with the target's from one budget and handed to it) or a proposer
        without caches of its own, made before the engine (it receives the draft rows). `decode_graphs`
        overrides whether decode steps run as fixed-shape batches (by default: on CUDA, as graph
        replays, unless `config.disable_cuda_graph`): plain decode steps without a proposer, verify
        steps with one that drafts on the device, and one request's prefill chunks up to
        `config.cuda_graph_max_prefill_tokens`; on the CPU they run as plain calls (for tests).
        `target`: an already loaded model of `config.model` to serve instead of loading it (several
        engines over one model in one process, as the benchmarks compare them). `ranks`: this process's
        rank of a tensor-parallel engine of `config.tp_size` ranks, as `hylo.distributed.launch.start`
        returns it (rank 0 there has started the other ranks); by default one rank."""
        self.config = config
        self.closed = False
        self.ranks = ranks if ranks is not None else Ranks()
        try:
            if self.ranks.parallel.size != config.tp_size:
                raise ValueError(
                    f"tp_size {config.tp_size}: the engine is given {self.ranks.parallel.size} rank(s); "
                    "start them with hylo.distributed.launch.start(config)"
                )
            if config.tp_size > 1 and (proposer is not None or target is not None):
                raise ValueError(
                    "tp_size > 1: every rank loads its own shard; a proposer or target cannot be given"
                )
            parts = build_engine(config, self.ranks, proposer, decode_graphs, target)
        except BaseException:
            self.ranks.discard()  # the other ranks of an engine that cannot start go with it
            raise
        self.device, self.dtype, self.model = parts.device, parts.dtype, parts.model
        self.tokenizer, self.context_len, self.plan = parts.tokenizer, parts.context_len, parts.plan
        self.caches, self.proposer = parts.caches, parts.proposer
        self.runner, self.scheduler = parts.runner, parts.scheduler
        self.ledger = parts.scheduler.ledger  # the scheduler's: what is launched and not yet read
        self.policy, self.buckets, self.memory_report = parts.policy, parts.buckets, parts.memory_report
        self._grammars = None  # hylo.structured.Grammars, made by the first constrained request
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, Request] = {}
        self.in_flight: LaunchedStep | None = None  # the step launched and not yet read
        self.last_run_ahead: RunAhead | None = None  # whether the last step scheduled ran ahead, or why not
        self._held_plan: StepPlan | None = None  # made for a step ahead that was not launched
        # when the last step's results were applied; None while the engine has had nothing to run since
        self._last_settled: float | None = None
        if self.ranks.publisher is not None:
            self.ranks.publisher.start()

    @property
    def overlap(self) -> bool:
        """Steps may run ahead of the read before them (the overlap schedule; `InFlightLedger`)."""
        return self.ledger.overlap

    @property
    def eos_token_ids(self) -> list[int]:
        if self.tokenizer is not None:
            return self.tokenizer.eos_token_ids
        eos = self.model.config.eos_token_id
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    def compile_constraint(self, params: SamplingParams):
        """The compiled structured-output constraint of `params` (`hylo.structured`; compiled once,
        then cached), or a ValueError naming the field. Safe to call from any thread."""
        if params.constraint is None:
            raise ValueError("params: no json_schema, regex or ebnf to compile")
        with self._grammars_lock:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError(f"{params.constraint[0]}: structured outputs need the model's tokenizer")
                # a grammar ends on the model's eos tokens (a request's own stop ids stop it as usual)
                self._grammars = Grammars(self.tokenizer, self.model.config.vocab_size, self.eos_token_ids)
            grammars = self._grammars
        return grammars.compile(params)

    def add_request(
        self, request_id: str, prompt_ids: Sequence[int] | CheckedPrompt, params: SamplingParams
    ) -> list[Request]:
        """Validate and queue a prompt (one this engine checked for `params` is not checked again:
        `CheckedPrompt`); `params.n` sequences (ids `request_id`, or `request_id-i`)."""
        if request_id in self.requests or f"{request_id}-0" in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt = self.validate_prompt(prompt_ids, params).ids
        compiled = self.compile_constraint(params) if params.constraint is not None else None
        stop_ids = frozenset(params.stop_token_ids) | frozenset(
            () if params.ignore_eos else self.eos_token_ids
        )
        created = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            seed = self.runner.draw_seed() if params.seed is None else params.seed + i
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens)
            request = Request(rid, prompt, params, stop_ids, self.context_len, detok, seed)
            if compiled is not None:
                request.grammar = Grammars.matcher(compiled)
            self.requests[rid] = request
            self.scheduler.add(request)
            created.append(request)
        if self.ranks.publisher is not None:
            self.ranks.publisher.record(AddRequest(request_id, prompt, params))
        return created

    def validate_prompt(
        self, prompt_ids: Sequence[int] | CheckedPrompt, params: SamplingParams
    ) -> CheckedPrompt:
        """The prompt checked against `params` (`CheckedPrompt`; one this engine checked for the same
        params is returned as it is), or a ValueError naming what is wrong; nothing is queued on error."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        if isinstance(prompt_ids, CheckedPrompt):
            if prompt_ids.engine is self and prompt_ids.params is params:
                return prompt_ids
            prompt_ids = prompt_ids.ids  # another engine's or other params': its ids checked again
        vocab = self.model.config.vocab_size
        prompt = checked_token_ids("prompt", prompt_ids, vocab)
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        if len(prompt) >= self.context_len:
            raise ValueError(f"prompt: {len(prompt)} tokens, the context length is {self.context_len}")
        needed = min(len(prompt) + params.max_tokens, self.context_len)
        if needed > self.plan.max_total_num_tokens:
            raise ValueError(
                f"prompt + max_tokens: {needed} tokens can never fit the cache of "
                f"{self.plan.max_total_num_tokens} tokens (max_total_num_tokens)"
            )
        for field, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            checked_token_ids(field, ids, vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        return CheckedPrompt(prompt, params, self)

    def abort(self, request_id: str) -> Request | None:
        """Finish a request now (reason `abort`), freeing its pages and slot."""
        if self.ranks.publisher is not None:
            self.ranks.publisher.record(Abort(request_id))
        request = self.requests.pop(request_id, None)
        if request is None or request.status is Status.FINISHED:
            return None
        self.scheduler.finish(request)
        request.finish("abort")
        return request

    def _fail(self, request: Request) -> None:
        """Finish a request with reason `error`, freeing its pages and slot unless that is done."""
        if self.requests.pop(request.request_id, None) is not None:
            self.scheduler.finish(request)
        request.finish("error")

    def has_unfinished(self) -> bool:
        """Requests to serve, or a step still in flight (whose results the next `step` returns)."""
        return not self.closed and (self.scheduler.has_work() or self.in_flight is not None)

    @property
    def failure(self) -> str | None:
        """Why the engine cannot go on (a rank was lost), None while it can."""
        return self.ranks.failure

    def check_alive(self) -> None:
        """Raise when the engine cannot go on (`failure`, or closed)."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        if self.failure is not None:
            raise RuntimeError(f"the engine cannot go on: {self.failure}")

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine, end the requests still in it (reason
        `abort`) and give back every device tensor the engine holds: its caches, proposer, graphs (and
        their memory pool) and model (an engine serving the same model as `target` keeps that). The
        engine cannot step afterwards; closing it again does nothing."""
        self.ranks.close()
        if self.closed:
            return
        self.closed = True
        for request in self.requests.values():
            if request.status is not Status.FINISHED:
                request.finish("abort")
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no launched step still uses what is released below
        self.requests, self.in_flight, self._held_plan = {}, None, None
        self.runner.reader.close()
        self.runner = self.scheduler = self.ledger = self.caches = self.proposer = self.model = None
        self._grammars = None
        # now, not whenever the collector next runs: what the engine held may sit in reference cycles
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the device, not only to PyTorch's cache

    def step(self, plan: StepPlan | None = None) -> list[StepOutput]:
        """Run one step and return what it produced. `plan`: a follower rank's, as rank 0 published
        it; rank 0 (and an engine of one rank) makes its own and publishes it to the others first.

        The loop is schedule-next, launch, settle-previous. A step that may run ahead of its read (the
        overlap schedule: `InFlightLedger.run_ahead` decides, and says why not: `last_run_ahead`) is
        launched without waiting for it; before its results are read the next step is scheduled and
        launched behind it where it can be (`Scheduler.schedule_ahead`), so the host's scheduling,
        batch building and detokenising run while the device computes. A call then returns the
        outputs of the step launched before, and leaves the one after it in flight (`in_flight`).
        Any other step is read at once: `_settle(_launch(...))`, the reading schedule. The plan of a
        step ahead that cannot be launched is held for the next call."""
        self.check_alive()
        if self.in_flight is None:  # nothing unread: the step is scheduled from what was read
            bucket = self._bucket()
            plan = plan if plan is not None else self._next_plan(bucket)
            if self.ranks.publisher is not None:
                self.ranks.publisher.step(plan.verify, plan.draft)
            chunks = self.scheduler.schedule(draft=plan.verify)
            if not chunks:
                return []
            start = time.perf_counter()
            route = self.runner.route(chunks, plan, self.ledger.run_ahead)
            self.last_run_ahead = route.run_ahead
            if not route.ahead:
                return self._settle(self._launch(chunks, route), bucket, start)
            self.in_flight = self._launch(chunks, route)
        start, bucket = time.perf_counter(), self._bucket()
        behind, self.in_flight = self.in_flight, self._launch_behind(self.in_flight, self._next_plan(bucket))
        outputs = self._settle(behind, bucket, start)
        if self.in_flight is not None and self.in_flight.read is None:  # it picks now, after the read
            self.runner.sample_launched(self.in_flight)
        return outputs

    def _launch_behind(self, behind: LaunchedStep, plan: StepPlan) -> LaunchedStep | None:
        """The step of `plan` after `behind`, scheduled and launched before `behind` is read where the
        scheduler can make it (`Scheduler.schedule_ahead`) and the ledger lets it run ahead; else
        None, and the plan waits for the next call (`last_run_ahead` says why)."""
        chunks = self.scheduler.schedule_ahead([ch.request for ch in behind.chunks], plan)
        if isinstance(chunks, RunAhead):  # no step can be made before the read
            self.last_run_ahead = chunks
        else:
            route = self.runner.route(chunks, plan, self.ledger.run_ahead)
            self.last_run_ahead = route.run_ahead
            if route.ahead:
                return self._launch(chunks, route)
        self._held_plan = plan  # the next step, scheduled once the tokens are read
        return None

    def _launch(self, chunks: list[ScheduledChunk], route: StepRoute) -> LaunchedStep:
        """Launch the step on its route (`ModelRunner.launch`) and record it in the ledger."""
        launched = self.runner.launch(chunks, route)
        self.ledger.launched(chunks, route)
        return launched

    def _settle(self, launched: LaunchedStep, bucket: int, start: float) -> list[StepOutput]:
        """Read a launched step (`ModelRunner.collect`; a verify step that ran ahead first has its
        blocks cut by the ledger) and apply it; the policy learns what it cost: the wall time since
        the step before it was applied, everything between included (scheduling, launching, the
        read, the bookkeeping, the caller's own work between calls: what a step costs the requests'
        throughput, in either mode), or since `start` after a time with nothing to run."""
        ahead = launched.route.ahead
        if ahead:
            launched.chunks = self.ledger.cut(launched.chunks)
        results = self.runner.collect(launched)
        outputs = self._apply(launched.chunks, results, ahead)
        now = time.perf_counter()
        if self.policy is not None:
            since = start if self._last_settled is None else self._last_settled
            self._record(bucket, launched.chunks, results, now - since)
        self._last_settled = now if self.has_unfinished() else None
        return outputs

    def _next_plan(self, bucket: int) -> StepPlan:
        """The plan of the next step: one made for a step ahead that was not launched, else the
        policy's (every step verifies and drafts without one)."""
        if self._held_plan is not None:
            plan, self._held_plan = self._held_plan, None
            return plan
        return self.policy.plan(bucket) if self.policy is not None else StepPlan(True, True)

    def _apply(
        self, chunks: Sequence[ScheduledChunk], results: Sequence[ChunkResult], ahead: bool
    ) -> list[StepOutput]:
        """The requests' bookkeeping after a step: the ledger records what the read brought
        (`InFlightLedger.settle`: committed positions, a constrained request's drafts), the scheduler
        publishes the prefix-cache snapshots it left, then prompt logprobs are kept and the picked
        tokens appended (finishing those that stop). A step run `ahead` gives nothing to its
        requests that ended while it ran (aborted, or stopped by the step before)."""
        outputs = []
        for ch, result in zip(chunks, results, strict=True):
            request = ch.request
            if not self.ledger.settle(ch, result, ahead):
                continue
            if result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs)
            if ch.snapshots:
                self.scheduler.publish(ch)
            if result.tokens and request.params.max_tokens == 0:  # the prompt is scored: done
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
                request.finish("length")
                outputs.append(StepOutput(request, [], "", None))
                continue
            if ch.verifies_drafts:
                request.metrics.spec_verify_steps += 1
                request.metrics.spec_accepted_tokens += result.accepted
            if result.tokens:
                accepted = result.accepted if ch.verifies_drafts else None
                drafted = ch.num_drafts if ch.verifies_drafts else None
                outputs.append(StepOutput(request, *self._append(request, result), accepted, drafted))
        return outputs

    def _append(self, request: Request, result: ChunkResult) -> tuple[list[int], str]:
        """Append the tokens a step read for `request` until one finishes it: (tokens taken, their new
        final text). A request whose bookkeeping fails ends alone (reason `error`): the batch goes on."""
        text, taken = "", []
        try:
            for k, token in enumerate(result.tokens):
                taken.append(token)
                text += request.append(token, result.logprobs[k] if result.logprobs else None)
                if request.status is Status.FINISHED:
                    self.scheduler.finish(request)
                    self.requests.pop(request.request_id, None)
                    break
        except Exception:
            logger.exception("request %s failed", request.request_id)
            self._fail(request)
        return taken, text

    def _bucket(self) -> int:
        """The batch-size bucket of the running requests (the graphs' buckets)."""
        running = max(1, len(self.scheduler.running))
        return next((b for b in self.buckets if b >= running), running)

    def _record(self, bucket: int, chunks, results, seconds: float) -> None:
        """Tell the policy what a decode step (no prefill chunk) cost and committed."""
        if not all(ch.verify or (ch.num_tokens == 1 and ch.request.output_ids) for ch in chunks):
            return
        verified = [r.committed for ch, r in zip(chunks, results, strict=True) if ch.verifies_drafts]
        mean = sum(verified) / len(verified) if verified else None
        self.policy.record(bucket, bool(verified), seconds, mean)
