"""Building one engine's parts, in the order their memory is taken: the model, the proposer's weights,
the caches sized from one memory budget with the proposer's, the graphs, the runner and scheduler, the
warm-up of the eager paths (`engine/warmup.py`: kernels compiled before the engine is ready), and the
memory report (taken last, so the allocator's figures include caches, graph pools and the warm-up's
cached blocks; its line ends with the warm-up's seconds).

`build_engine` is called once, by `Engine.__init__`, which owns what it returns; nothing here runs a
request's step (the warm-up's steps are its own, in the scratch slot).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hylo.config import DEFAULT_CUDA_GRAPH_MAX_BS, EngineConfig
from hylo.engine.cuda_graph import DecodeGraphs, batch_size_buckets
from hylo.engine.prefill_graph import PrefillGraphs, prefill_graph_refusal
from hylo.engine.runner import ModelRunner
from hylo.engine.scheduler import Scheduler
from hylo.engine.verify_graph import VerifyGraphs
from hylo.engine.warmup import WarmupShapes, warm_up, warmup_refusal, warmup_steps
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
from hylo.parallel.ranks import Ranks
from hylo.speculative.adaptive import DraftLengthPolicy
from hylo.speculative.proposer import Proposer, ProposerBuild, ProposerCaches
from hylo.speculative.token_map import load_token_map
from hylo.tokenizer import Tokenizer

logger = logging.getLogger("hylo")
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class EngineParts:
    """What `build_engine` makes for one engine; `policy` is rank 0's alone (the other ranks step by
    the plans it publishes); `buckets` are the graphs' batch-size buckets."""

    device: torch.device
    dtype: torch.dtype
    model: Glm5NextForCausalLM
    tokenizer: Tokenizer | None
    context_len: int
    plan: MemoryPlan
    caches: CacheManager
    proposer: Proposer | None
    runner: ModelRunner
    scheduler: Scheduler
    policy: DraftLengthPolicy | None
    buckets: list[int]
    memory_report: dict[str, Any]


def build_engine(
    config: EngineConfig,
    ranks: Ranks,
    proposer: Proposer | ProposerBuild | None,
    decode_graphs: bool | None,
    target: Glm5NextForCausalLM | None,
) -> EngineParts:
    """Load the model (or serve `target`), build the proposer (`proposer`, or the one the config
    names), size and allocate the caches, capture the graphs (`decode_graphs`: see `Engine`), make
    the runner, the scheduler and the draft-length policy of this rank, and warm the eager paths up
    (`warmup_refusal` says when not)."""
    path = Path(config.model) if config.model is not None else _demo_model()
    device, dtype = resolve_device(config.device, config.dtype)
    device = ranks.device or device
    limit_host_threads(device)
    with LoadPeak(device) as load_peak:
        model = target or load_model(
            path, device, dtype, random_weights=config.load_format == "dummy", parallel=ranks.parallel,
            progress=None if ranks.leader else False,
            fp8_projections=False if config.fp8_projections == "dequantize" else None,
        )  # fmt: skip
    ranks.loaded()
    _warn_of_refusals(model, device)
    tok_path = Path(config.tokenizer) if config.tokenizer else path
    tokenizer = Tokenizer.from_dir(tok_path) if (tok_path / "tokenizer.json").is_file() else None
    context_len = config.context_length or model.config.max_position_embeddings
    indexer_dtype = torch.float8_e4m3fn if config.indexer_dtype == "fp8" else None
    build = _proposer_build(config, path, model, indexer_dtype) if proposer is None else proposer
    if isinstance(build, Proposer):
        build = ProposerBuild.of(build)
    if decode_graphs is None:
        decode_graphs = device.type == "cuda" and not config.disable_cuda_graph
    types = (device, dtype, indexer_dtype)
    no_warmup = warmup_refusal(config.skip_warmup, device)
    # the graphs' filler rows and the warm-up's sequences live in the scratch slot
    scratch = decode_graphs or no_warmup is None
    plan, caches = _caches(config, ranks, model, types, context_len, build, scratch)
    proposer = None if build is None else _attach(build, caches, device)
    max_bs = min(config.cuda_graph_max_bs or DEFAULT_CUDA_GRAPH_MAX_BS, plan.num_slots)
    graphs = _graphs(config, model, caches, proposer, max_bs, context_len, decode_graphs)
    runner = ModelRunner(model, caches, config.seed, proposer, *graphs)
    verify_shape = None if proposer is None else proposer.verify_shape
    # steps run ahead on one rank only: the ranks of a tensor-parallel engine step by rank 0's plans
    overlap = not config.disable_overlap_schedule and ranks.parallel.size == 1
    mixed = mixes_steps(config, proposer)
    scheduler = Scheduler(
        caches, plan.num_slots, config.chunked_prefill_size, config.longest_prefill_step, verify_shape,
        proposer, overlap, verify_graphs=runner.verify_graphs is not None, mixed_steps=mixed,
        prefill_graphs=runner.prefill_graphs is not None,
    )  # fmt: skip
    policy = None
    if proposer is not None and config.speculative_adaptive and ranks.leader:
        policy = DraftLengthPolicy(verify_shape)
    warmup = _warm_up(config, model, plan, caches, runner, mixed) if no_warmup is None else no_warmup
    report = _memory_report(model, plan, device, load_peak.bytes, ranks, warmup)
    return EngineParts(
        device, dtype, model, tokenizer, context_len, plan, caches, proposer, runner, scheduler, policy,
        batch_size_buckets(max_bs), report,
    )  # fmt: skip


def resolve_device(device: str, dtype: str) -> tuple[torch.device, torch.dtype]:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device: {device} requested but CUDA is not available")
    if dtype == "auto":
        return dev, torch.bfloat16 if dev.type == "cuda" else torch.float32
    return dev, DTYPES[dtype]


def budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """The caches' bytes: on CUDA what `mem_fraction_static` of the GPU leaves beside everything in
    use now (weights, CUDA context, other processes)."""
    if device.type == "cuda":
        # blocks the loading freed stay reserved by PyTorch's cache, and would count as in use
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(device)
        budget = int(free - total * (1 - config.mem_fraction_static))
        if budget <= 0:
            raise ValueError(
                f"mem_fraction_static={config.mem_fraction_static} leaves no memory for caches "
                f"after the weights ({(total - free) / 2**30:.1f} GiB in use of {total / 2**30:.1f} GiB, "
                f"{torch.cuda.memory_allocated(device) / 2**30:.1f} GiB of it PyTorch tensors)"
            )
        return budget
    return int(config.max_memory_gb * 2**30)


def _warn_of_refusals(model: Glm5NextForCausalLM, device: torch.device) -> None:
    """On CUDA, name each op whose Triton kernel refuses every call of this model."""
    if device.type != "cuda":
        return
    for op, reason in model_refusals(model.config).items():
        logger.warning(
            "%s: its Triton kernel cannot take this model (%s): it runs the torch reference", op, reason
        )


def _proposer_build(
    config: EngineConfig, model_path: Path, model: Glm5NextForCausalLM, indexer_dtype: torch.dtype | None
) -> ProposerBuild | None:
    """The proposer `config.speculative_algorithm` names (None without one), its weights loaded."""
    if config.speculative_algorithm is None:
        return None
    token_map = None
    if config.speculative_token_map is not None:
        token_map = load_token_map(config.speculative_token_map, model.config.vocab_size)
    if config.speculative_algorithm == "MTP":
        from hylo.speculative.mtp import MTPProposer

        return MTPProposer.load(
            model_path, model, config.speculative_num_steps or 1, indexer_dtype,
            random_weights=config.load_format == "dummy", token_map=token_map,
        )  # fmt: skip
    from hylo.speculative.dflash import DFlashProposer

    return DFlashProposer.load(
        config.speculative_draft_model_path, model, config.speculative_num_draft_tokens, token_map
    )


def _caches(
    config: EngineConfig,
    ranks: Ranks,
    model: Glm5NextForCausalLM,
    types: tuple[torch.device, torch.dtype, torch.dtype | None],
    context_len: int,
    build: ProposerBuild | None,
    scratch: bool,
) -> tuple[MemoryPlan, CacheManager]:
    """The memory plan of the target's caches and the proposer's from one budget (the smallest of
    the ranks'), and the target's caches (`types`: device, dtype, indexer dtype; with `scratch` a
    scratch slot for fixed-shape batches)."""
    device, dtype, indexer_dtype = types
    cache_config = ranks.parallel.local_config(model.config)  # KDA states hold this rank's heads
    prefix_cache = not config.disable_radix_cache
    feature_dim = build.snapshot_feature_dim if build is not None else 0
    target_specs = target_cache_specs(
        cache_config, dtype, indexer_dtype, feature_dim if prefix_cache else None
    )
    plan = MemoryPlan.from_budget(
        target_specs + (build.specs if build is not None else []),
        ranks.min_over_ranks(budget_bytes(config, device)),
        config.page_size, config.max_running_requests, context_len, scratch=scratch,
        snapshot_share=PREFIX_SNAPSHOT_SHARE if prefix_cache else 0.0,
    )  # fmt: skip
    if prefix_cache and plan.num_snapshots == 0:
        logger.warning("prefix cache: the memory budget holds no KDA state snapshot: nothing will be cached")
    caches = CacheManager(
        cache_config, plan, dtype, device, indexer_dtype,
        config.prefix_snapshot_interval if prefix_cache else None, feature_dim,
    )  # fmt: skip
    return plan, caches


def _attach(build: ProposerBuild, caches: CacheManager, device: torch.device) -> Proposer:
    """The proposer over its caches: its draft rows (one per request-table row) and its pools."""
    table = caches.table.table
    drafts = torch.zeros(table.shape[0], build.verify_shape.drafts, dtype=torch.long, device=device)
    pools = [spec.allocate(caches.num_token_slots, device) for spec in build.specs]
    return build.build(ProposerCaches(table, drafts, pools))


def _graphs(
    config: EngineConfig,
    model: Glm5NextForCausalLM,
    caches: CacheManager,
    proposer: Proposer | None,
    max_bs: int,
    context_len: int,
    decode_graphs: bool,
) -> tuple[DecodeGraphs | None, VerifyGraphs | None, PrefillGraphs | None]:
    """The fixed-shape steps, captured as CUDA graphs on CUDA: plain decode steps; with a proposer
    that drafts on the device, verify steps (a proposer observes every forward's features, which plain
    decode graphs make only when captured with it); one request's prefill chunks up to
    `config.cuda_graph_max_prefill_tokens`. None of them without `decode_graphs`."""
    if not decode_graphs:
        return None, None, None
    capture = caches.table.table.device.type == "cuda"
    graphs = DecodeGraphs(model, caches, max_bs, capture, proposer)
    verifying = prefilling = None
    if proposer is not None and not proposer.needs_host:
        pool = graphs.bank.pool  # the verify and decode graphs never replay at once
        verifying = VerifyGraphs(model, caches, proposer, max_bs, capture, pool)
    if config.cuda_graph_max_prefill_tokens:
        refusal = prefill_graph_refusal(model, proposer)
        if refusal is None:
            prefilling = PrefillGraphs(
                model, caches, min(config.cuda_graph_max_prefill_tokens, context_len), capture, proposer,
                graphs.bank.pool,
            )  # fmt: skip
        else:
            logger.info("prefill chunks run eagerly: %s", refusal)
    return graphs, verifying, prefilling


def limit_host_threads(device: torch.device) -> None:
    """A CUDA engine's host work (batch building, bookkeeping) is small CPU tensors, which torch's
    intra-op thread pool slows down: waking the pool costs more than the op (`repeat_interleave` of a
    64-sequence batch: 30 us on one thread, ~6 ms on two with the other core busy; 1.6 ms a call on a
    16-core H100 host, RESULTS S26-2). So a CUDA engine runs torch's CPU ops on one thread, as vLLM's
    workers do, unless `OMP_NUM_THREADS` says otherwise; a CPU engine computes on the CPU and keeps
    them all."""
    if device.type == "cuda" and "OMP_NUM_THREADS" not in os.environ and torch.get_num_threads() > 1:
        logger.info(
            "torch CPU ops on 1 thread (were %d): a CUDA engine's host work is small tensors; set "
            "OMP_NUM_THREADS to choose", torch.get_num_threads(),
        )  # fmt: skip
        torch.set_num_threads(1)


def mixes_steps(config: EngineConfig, proposer: Proposer | None) -> bool:
    """Whether the engine's steps mix prefill chunks with decoding rows (`config.mixed_steps`; auto:
    not with a proposer, whose mixed steps run the target, acceptance and drafting eagerly: at 16 and
    64 requests in flight speculation ran 0.65x and 0.60x plain decoding mixed, 0.82x and 0.90x
    unmixed, on the demo model on an H100, RESULTS S26-1)."""
    if config.mixed_steps == "auto":
        return proposer is None
    return config.mixed_steps == "on"


def _warm_up(
    config: EngineConfig,
    model: Glm5NextForCausalLM,
    plan: MemoryPlan,
    caches: CacheManager,
    runner: ModelRunner,
    mixed: bool,
) -> float:
    """The warm-up's seconds, its steps run (`engine/warmup.py`) and logged (`mixed`: the engine's
    steps mix prefill chunks with decoding rows)."""
    shapes = WarmupShapes.of(config.longest_prefill_step, plan, caches, runner.proposer, mixed=mixed)
    steps = warmup_steps(shapes)
    seconds = warm_up(runner, caches, steps, model.config.vocab_size)
    longest = max(c.prefix + c.tokens for step in steps for c in step.chunks)
    most = max(len(step.chunks) for step in steps)
    logger.info(
        "warm-up: %d eager steps (chunks up to %d tokens, contexts up to %d, up to %d sequences a step) "
        "in %.1f s", len(steps), shapes.longest_chunk, longest, most, seconds,
    )  # fmt: skip
    return seconds


def _memory_report(
    model: Glm5NextForCausalLM,
    plan: MemoryPlan,
    device: torch.device,
    load_peak: int,
    ranks: Ranks,
    warmup: float | str,
) -> dict[str, Any]:
    """The memory report, logged with the warm-up's seconds (`warmup`; why there was none when a
    string): where the weights, caches and graph pools went; on a tensor-parallel engine with every
    rank's report in rank 0's."""
    report = memory_report(model, plan, device, load_peak)
    report["weights_shard"] = shard_digest(model)  # which part of the checkpoint this rank holds
    parallel = ranks.parallel
    rank = f" (rank {parallel.rank} of {parallel.size})" if parallel.size > 1 else ""
    warmed = isinstance(warmup, float)
    line = f"warm-up {warmup:.1f} s" if warmed else f"warm-up skipped ({warmup})"
    logger.info("memory%s: %s; %s", rank, format_memory_report(report), line)
    report["warmup_seconds"] = warmup if warmed else None
    if parallel.size > 1:  # what every rank holds, in rank 0's report too
        report["ranks"] = ranks.gather(dict(report))
    return report


def _demo_model() -> Path:
    from hylo.models.demo import default_model_dir

    path = default_model_dir()
    logger.warning(
        "no model given: using the embedded demo model at %s (a 7M-parameter GLM-5.3-Flash trained on "
        "ShareGPT, with DFlash, DFlash2 and MTP drafts; its README.md is the model card)",
        path,
    )
    return path
