"""The engine: requests in, tokens out, one scheduled step at a time."""

from __future__ import annotations

import gc
import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from hylo.config import DEFAULT_CUDA_GRAPH_MAX_BS, EngineConfig
from hylo.engine.chunk import ScheduledChunk
from hylo.engine.cuda_graph import DecodeGraphs, batch_size_buckets
from hylo.engine.picking import ChunkResult
from hylo.engine.prefill_graph import PrefillGraphs, prefill_graph_refusal
from hylo.engine.request import Request, Status
from hylo.engine.runner import LaunchedStep, ModelRunner
from hylo.engine.scheduler import Scheduler
from hylo.engine.verify_graph import VerifyGraphs
from hylo.memory.manager import (
    PREFIX_SNAPSHOT_SHARE,
    CacheManager,
    LoadPeak,
    MemoryPlan,
    format_memory_report,
    memory_report,
    target_cache_specs,
)
from hylo.models.glm5_next import Glm5NextForCausalLM, model_refusals
from hylo.models.loader import load_model, shard_digest
from hylo.parallel.control import Abort, AddRequest
from hylo.parallel.ranks import Ranks
from hylo.sampling import SamplingParams
from hylo.speculative.adaptive import DraftLengthPolicy, StepPlan
from hylo.speculative.proposer import Proposer, ProposerBuild, ProposerCaches
from hylo.speculative.token_map import load_token_map
from hylo.structured import Grammars
from hylo.tokenizer import IncrementalDetokenizer, Tokenizer

logger = logging.getLogger("hylo")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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
    """Loads the model, sizes the caches from one memory budget, and runs the step loop."""

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
            self._start(config, proposer, decode_graphs, target)
        except BaseException:
            self.ranks.discard()  # the other ranks of an engine that cannot start go with it
            raise

    def _start(
        self,
        config: EngineConfig,
        proposer: Proposer | ProposerBuild | None,
        decode_graphs: bool | None,
        target: Glm5NextForCausalLM | None,
    ) -> None:
        """Load the model, size and allocate the caches, build the proposer and capture the graphs."""
        path = Path(config.model) if config.model is not None else _demo_model()
        self.device, self.dtype = resolve_device(config.device, config.dtype)
        self.device = self.ranks.device or self.device
        dummy = config.load_format == "dummy"
        parallel = self.ranks.parallel
        with LoadPeak(self.device) as load_peak:
            self.model = target or load_model(
                path, self.device, self.dtype, random_weights=dummy, parallel=parallel,
                progress=None if self.ranks.leader else False,
                fp8_projections=False if config.fp8_projections == "dequantize" else None,
            )  # fmt: skip
        self.ranks.loaded()
        model_config = self.model.config
        if self.device.type == "cuda":
            for op, reason in model_refusals(model_config).items():
                logger.warning(
                    "%s: its Triton kernel cannot take this model (%s): it runs the torch reference",
                    op,
                    reason,
                )
        cache_config = parallel.local_config(model_config)  # KDA states hold this rank's heads
        tok_path = Path(config.tokenizer) if config.tokenizer else path
        self.tokenizer = Tokenizer.from_dir(tok_path) if (tok_path / "tokenizer.json").is_file() else None
        self._grammars = None  # hylo.structured.Grammars, made by the first constrained request
        self._grammars_lock = threading.Lock()
        self.context_len = config.context_length or model_config.max_position_embeddings
        indexer_dtype = torch.float8_e4m3fn if config.indexer_dtype == "fp8" else None
        build = self._build_proposer(path, indexer_dtype) if proposer is None else proposer
        if isinstance(build, Proposer):
            build = ProposerBuild.of(build)
        if decode_graphs is None:
            decode_graphs = self.device.type == "cuda" and not config.disable_cuda_graph
        prefix_cache = not config.disable_radix_cache
        feature_dim = build.snapshot_feature_dim if build is not None else 0
        target_specs = target_cache_specs(
            cache_config, self.dtype, indexer_dtype, feature_dim if prefix_cache else None
        )
        self.plan = MemoryPlan.from_budget(
            target_specs + (build.specs if build is not None else []),
            self.ranks.min_over_ranks(self._budget_bytes()),
            config.page_size, config.max_running_requests, self.context_len, scratch=decode_graphs,
            snapshot_share=PREFIX_SNAPSHOT_SHARE if prefix_cache else 0.0,
        )  # fmt: skip
        if prefix_cache and self.plan.num_snapshots == 0:
            logger.warning(
                "prefix cache: the memory budget holds no KDA state snapshot: nothing will be cached"
            )
        self.caches = CacheManager(
            cache_config, self.plan, self.dtype, self.device, indexer_dtype,
            config.prefix_snapshot_interval if prefix_cache else None, feature_dim,
        )  # fmt: skip
        self.proposer = None
        if build is not None:
            table = self.caches.table.table
            drafts = torch.zeros(
                table.shape[0], build.verify_shape.drafts, dtype=torch.long, device=self.device
            )
            pools = [spec.allocate(self.caches.num_token_slots, self.device) for spec in build.specs]
            self.proposer = build.build(ProposerCaches(table, drafts, pools))
        verify_shape = None if self.proposer is None else self.proposer.verify_shape
        # a proposer observes every forward's features: plain decode graphs don't make them, so with
        # one the fixed-shape steps are verify steps, and only for a proposer that drafts on the device
        verify_graphs = decode_graphs and self.proposer is not None and not self.proposer.needs_host
        self.scheduler = Scheduler(
            self.caches, self.plan.num_slots, config.chunked_prefill_size, verify_shape, self.proposer
        )
        self.requests: dict[str, Request] = {}
        graphs = verifying = None
        max_bs = min(config.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, self.plan.num_slots)
        capture = self.device.type == "cuda"
        if decode_graphs:
            graphs = DecodeGraphs(self.model, self.caches, max_bs, capture, self.proposer)
        if verify_graphs:
            pool = graphs.bank.pool  # the verify and decode graphs never replay at once
            verifying = VerifyGraphs(self.model, self.caches, self.proposer, max_bs, capture, pool)
        prefilling = None
        if decode_graphs and config.cuda_graph_max_prefill_tokens:
            refusal = prefill_graph_refusal(self.model, self.proposer)
            if refusal is None:
                prefilling = PrefillGraphs(
                    self.model, self.caches, min(config.cuda_graph_max_prefill_tokens, self.context_len),
                    capture, self.proposer, graphs.bank.pool,
                )  # fmt: skip
            else:
                logger.info("prefill chunks run eagerly: %s", refusal)
        self.policy = None  # rank 0's alone: the other ranks step by the plan it publishes
        if self.proposer is not None and config.speculative_adaptive and self.ranks.leader:
            self.policy = DraftLengthPolicy(verify_shape)
        self.runner = ModelRunner(
            self.model, self.caches, config.seed, self.proposer, graphs, verifying, prefilling
        )
        # overlapped steps are the steps of one rank that are device work to their read: plain decode
        # steps that draft nothing, and verify steps the verify graphs take whose rows need nothing the
        # read brings (the plain steps drafting for a verify step and the ranks of a tensor-parallel
        # engine, which step by rank 0's published plans, read every step's tokens)
        self.overlap = not config.disable_overlap_schedule and parallel.size == 1
        self.in_flight: LaunchedStep | None = None
        self._held_plan: StepPlan | None = None  # made for a step ahead that was not launched
        self.buckets = batch_size_buckets(max_bs)
        # taken last: the allocator's figures include the caches and the captured graphs' pools
        report = memory_report(self.model, self.plan, self.device, load_peak.bytes)
        report["weights_shard"] = shard_digest(self.model)  # which part of the checkpoint this rank holds
        rank = f" (rank {parallel.rank} of {parallel.size})" if parallel.size > 1 else ""
        logger.info("memory%s: %s", rank, format_memory_report(report))
        if parallel.size > 1:  # what every rank holds, in rank 0's report too
            report["ranks"] = self.ranks.gather(dict(report))
        self.memory_report = report
        if self.ranks.publisher is not None:
            self.ranks.publisher.start()

    def _build_proposer(self, model_path: Path, indexer_dtype: torch.dtype | None) -> ProposerBuild | None:
        if self.config.speculative_algorithm is None:
            return None
        token_map = None
        if self.config.speculative_token_map is not None:
            token_map = load_token_map(self.config.speculative_token_map, self.model.config.vocab_size)
        if self.config.speculative_algorithm == "MTP":
            from hylo.speculative.mtp import MTPProposer

            return MTPProposer.load(
                model_path, self.model, self.config.speculative_num_steps or 1, indexer_dtype,
                random_weights=self.config.load_format == "dummy", token_map=token_map,
            )  # fmt: skip
        from hylo.speculative.dflash import DFlashProposer

        return DFlashProposer.load(
            self.config.speculative_draft_model_path, self.model, self.config.speculative_num_draft_tokens,
            token_map,
        )  # fmt: skip

    def _budget_bytes(self) -> int:
        """The caches' bytes: on CUDA what `mem_fraction_static` of the GPU leaves beside everything in
        use now (weights, CUDA context, other processes)."""
        if self.device.type == "cuda":
            # blocks the loading freed stay reserved by PyTorch's cache, and would count as in use
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - self.config.mem_fraction_static))
            if budget <= 0:
                raise ValueError(
                    f"mem_fraction_static={self.config.mem_fraction_static} leaves no memory for caches "
                    f"after the weights ({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB, "
                    f"{torch.cuda.memory_allocated(self.device) / 2**30:.1f} GiB of it PyTorch tensors)"
                )
            return budget
        return int(self.config.max_memory_gb * 2**30)

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


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested but CUDA is not available")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


def _demo_model() -> Path:
    from hylo.models.demo import default_model_dir

    path = default_model_dir()
    logger.warning(
        "no model given: using the embedded demo model at %s (a 7M-parameter GLM-5.3-Flash trained on "
        "ShareGPT, with DFlash, DFlash2 and MTP drafts; its README.md is the model card)",
        path,
    )
    return path
