"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from hylo.config import EngineConfig
from hylo.engine.builder import build_engine
from hylo.engine.chunk import ScheduledChunk
from hylo.engine.picking import ChunkResult
from hylo.engine.request import Request, Status
from hylo.engine.runner import LaunchedStep
from hylo.models.glm5_next import Glm5NextForCausalLM
from hylo.parallel.control import Abort, AddRequest
from hylo.parallel.ranks import Ranks
from hylo.sampling import SamplingParams
from hylo.speculative.adaptive import StepPlan
from hylo.speculative.proposer import Proposer, ProposerBuild
from hylo.structured import Grammars
from hylo.tokenizer import IncrementalDetokenizer

logger = logging.getLogger("hylo")


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
        self.caches, self.proposer, self.runner = parts.caches, parts.proposer, parts.runner
        self.scheduler, self.policy, self.overlap = parts.scheduler, parts.policy, parts.overlap
        self.buckets, self.memory_report = parts.buckets, parts.memory_report
        self._grammars = None  # hylo.structured.Grammars, made by the first constrained request
        self._grammars_lock = threading.Lock()
        self.requests: dict[str, Request] = {}
        self.in_flight: LaunchedStep | None = None
        self._held_plan: StepPlan | None = None  # made for a step ahead that was not launched
        if self.ranks.publisher is not None:
            self.ranks.publisher.start()

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
        self, request_id: str, prompt_ids: Sequence[int], params: SamplingParams
    ) -> list[Request]:
        """Validate and queue a prompt; `params.n` sequences (ids `request_id`, or `request_id-i`)."""
        if request_id in self.requests or f"{request_id}-0" in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        prompt = self.validate_prompt(prompt_ids, params)
        compiled = self.compile_constraint(params) if params.constraint is not None else None
        stop_ids = frozenset(params.stop_token_ids) | frozenset(
            () if params.ignore_eos else self.eos_token_ids
        )
        created = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            generator = None
            if params.seed is not None:
                generator = torch.Generator(device=self.device).manual_seed(params.seed + i)
            detok = None
            if self.tokenizer is not None:
                detok = IncrementalDetokenizer(self.tokenizer, prompt, params.skip_special_tokens)
            request = Request(rid, prompt, params, stop_ids, self.context_len, detok, generator)
            if compiled is not None:
                request.grammar = Grammars.matcher(compiled)
            self.requests[rid] = request
            self.scheduler.add(request)
            created.append(request)
        if self.ranks.publisher is not None:
            self.ranks.publisher.record(AddRequest(request_id, prompt, params))
        return created

    def validate_prompt(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        """The prompt as a list, or a ValueError naming what is wrong; nothing is queued on error."""
        if self.closed:
            raise RuntimeError("the engine is closed")
        prompt = [int(t) for t in prompt_ids]
        vocab = self.model.config.vocab_size
        if not prompt:
            raise ValueError("prompt: must contain at least one token")
        bad = [t for t in prompt if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if len(prompt) >= self.context_len:
            raise ValueError(f"prompt: {len(prompt)} tokens, the context length is {self.context_len}")
        needed = min(len(prompt) + params.max_tokens, self.context_len)
        if needed > self.plan.max_total_num_tokens:
            raise ValueError(
                f"prompt + max_tokens: {needed} tokens can never fit the cache of "
                f"{self.plan.max_total_num_tokens} tokens (max_total_num_tokens)"
            )
        for field, ids in (("stop_token_ids", params.stop_token_ids), ("logit_bias", params.logit_bias)):
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise ValueError(f"{field}: token id {bad[0]} is outside the vocabulary [0, {vocab})")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop: stop strings need a tokenizer, and this model has none")
        return prompt

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
        self.runner = self.scheduler = self.caches = self.proposer = self.model = self._grammars = None
        # now, not whenever the collector next runs: what the engine held may sit in reference cycles
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the device, not only to PyTorch's cache

    def step(self, plan: StepPlan | None = None) -> list[StepOutput]:
        """Run one step and return what it produced. `plan`: a follower rank's, as rank 0 published
        it; rank 0 (and an engine of one rank) makes its own and publishes it to the others first.

        With the overlap schedule (`overlap`), a plain decode step is launched without waiting for
        it (`ModelRunner.launch`); before its tokens are read the next step is scheduled and launched
        behind it where it can be (`Scheduler.schedule_ahead`), so the host's scheduling, batch
        building and detokenising run while the device computes. A call then returns the outputs of
        the step launched before, and leaves the one after it in flight (`in_flight`). In a speculative
        engine the steps that overlap are the plain ones that draft nothing (`DraftLengthPolicy`'s
        choice while verifying does not pay) and verify steps after verify steps whose rows need
        nothing from the host's read (`ModelRunner.overlaps`): the block behind an unread one starts
        where that one's commit leaves it, on the device. The plan of a step ahead that cannot be
        launched is held for the next call."""
        self.check_alive()
        if self.in_flight is None:
            bucket = self._bucket()
            if plan is None:
                plan = self._next_plan(bucket)
            if self.ranks.publisher is not None:
                self.ranks.publisher.step(plan.verify, plan.draft)
            chunks = self.scheduler.schedule(draft=plan.verify)
            if not chunks:
                return []
            if not (self._overlaps(plan) and self.runner.overlaps(chunks)):
                start = time.perf_counter()
                results = self.runner.step(chunks, draft=plan.draft)
                if self.policy is not None:
                    self._record(bucket, chunks, results, time.perf_counter() - start)
                return self._apply(chunks, results)
            self.in_flight = self._launch(chunks)
        start, bucket = time.perf_counter(), self._bucket()
        launched, self.in_flight = self.in_flight, None
        ahead, plan_ahead = None, self._next_plan(bucket)
        if self._overlaps(plan_ahead):
            requests = [ch.request for ch in launched.chunks]
            verify = plan_ahead.verify and self.proposer is not None
            ahead = self.scheduler.schedule_ahead(requests, verify=verify)
        if ahead and self.runner.overlaps(ahead):
            # a constrained row picks once its grammar has taken the token read below
            constrained = any(ch.request.grammar is not None for ch in ahead)
            self.in_flight = self._launch(ahead, sample_now=not constrained)
        else:
            self._held_plan = plan_ahead  # the next step, scheduled once the tokens are read
        results = self.runner.collect(launched)
        outputs = self._apply(launched.chunks, results, launched=True)
        if self.policy is not None:  # an overlapped step costs the time between two reads
            self._record(bucket, launched.chunks, results, time.perf_counter() - start)
        if self.in_flight is not None and self.in_flight.read is None:
            self.runner.sample_launched(self.in_flight)
        return outputs

    def _next_plan(self, bucket: int) -> StepPlan:
        """The plan of the next step: one made for a step ahead that was not launched, else the
        policy's (every step verifies and drafts without one)."""
        if self._held_plan is not None:
            plan, self._held_plan = self._held_plan, None
            return plan
        return self.policy.plan(bucket) if self.policy is not None else StepPlan(True, True)

    def _overlaps(self, plan: StepPlan) -> bool:
        """Whether a step of `plan` may run ahead of the read before it: a plain step drafting nothing,
        or a verify step where verify graphs exist (`plan` means nothing to an engine without a
        proposer)."""
        if not self.overlap or self.proposer is None:
            return self.overlap
        return self.runner.verify_graphs is not None if plan.verify else not plan.draft

    def _launch(self, chunks: list[ScheduledChunk], sample_now: bool = True) -> LaunchedStep:
        launched = self.runner.launch(chunks, sample_now)
        for ch in chunks:
            if ch.verify:  # what it commits is known once read
                ch.request.verifying += 1
            else:  # the step's token is computed, its pick on its way
                ch.request.num_computed += 1
                ch.request.in_flight += 1
        return launched

    def _apply(
        self, chunks: Sequence[ScheduledChunk], results: Sequence[ChunkResult], launched: bool = False
    ) -> list[StepOutput]:
        """The requests' bookkeeping after a step: committed positions, picked tokens (finishing
        those that stop), prompt logprobs, prefix-cache snapshots. A `launched` step's positions
        are counted already (a verify step's once read); its requests that ended while it ran
        (aborted, or stopped by the step before) take nothing from it."""
        outputs = []
        for ch, result in zip(chunks, results, strict=True):
            request = ch.request
            if launched:
                if ch.verify:
                    request.verifying -= 1
                else:
                    request.in_flight -= 1
                if request.status is Status.FINISHED:
                    continue
            if not launched or ch.verify:
                request.num_computed += result.committed
            if result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs)
            if ch.snapshots:
                self.scheduler.publish(ch)
            request.host_drafts = result.drafts
            if result.tokens and request.params.max_tokens == 0:  # the prompt is scored: done
                self.scheduler.finish(request)
                self.requests.pop(request.request_id, None)
                request.finish("length")
                outputs.append(StepOutput(request, [], "", None))
                continue
            if ch.verifies_drafts:
                request.metrics.spec_verify_steps += 1
                request.metrics.spec_accepted_tokens += result.accepted
            if not result.tokens:
                continue
            text, taken = "", []
            try:
                for k, token in enumerate(result.tokens):
                    taken.append(token)
                    text += request.append(token, result.logprobs[k] if result.logprobs else None)
                    if request.status is Status.FINISHED:
                        self.scheduler.finish(request)
                        self.requests.pop(request.request_id, None)
                        break
            except Exception:  # this request's bookkeeping failed: it alone ends, the batch goes on
                logger.exception("request %s failed", request.request_id)
                self._fail(request)
            accepted = result.accepted if ch.verifies_drafts else None
            drafted = ch.num_drafts if ch.verifies_drafts else None
            outputs.append(StepOutput(request, taken, text, accepted, drafted))
        return outputs

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
