"""Speculative decoding end to end on a real-size GLM-5.3-Flash slice: plain graph decode against DFlash
(block 8), DFlash2 (block 8) and MTP (3 steps) in one process, one target model shared by all engines,
runs interleaved.

    PYTHONPATH=src python3 benchmarks/device/spec_e2e.py [--layers 8] [--batches 1,8] [--out DIR]

The target is the slice `decode_e2e.py` builds (random weights, FP8 routed experts); the DFlash draft is
random in the z-lab format (2 layers, 32 heads, 8 kv heads, head dim 128, target layers 1, L/2, L-2).
"Forced" runs replace the greedy acceptance by "every draft accepted" (this script's hook: patched
into the verify graphs captured for them and into the eager acceptance while they run, never
reachable from the CLI or API), which is how the seed benchmarks report acceptance at the block size;
"forced_common" runs are forced runs whose drafts are replaced by one pseudo-random token stream (by
table row and position, the same for every algorithm: `common_drafting`), so that every algorithm's
verify reads the same experts and the runs compare the drafting itself; "natural" runs keep the
real acceptance (about 1 for a random draft), with the adaptive draft-length policy on ("adaptive")
and off ("static"); "sampled" runs are static ones at temperature 1 (rejection sampling between the verify
step's two graphs); "forced_reading" runs are forced runs with the overlap schedule off (each verify step
read before the next is scheduled, as every verify step was before session 22), against which "forced" shows
what launching greedy verify steps ahead of the read before them gains. Reports per (algorithm, batch):
decode tokens/s per user and the ratio to plain graph decode of the same repetition (median of `--reps`),
the wall time per engine step, the GPU time of one verify-graph replay (CUDA events), the kernels one replay
launches and the top kernels by GPU time (torch.profiler, `--out`/kernels_*.txt), the synchronising calls
per step (`torch.cuda.set_sync_debug_mode("warn")`), and the weight-read floor of the last verify step
(every module's weights once per call, routed experts only those the block's tokens route to, at the copy
bandwidth measured in the same run), the same floor of a plain decode step, and the forced ratio both floors
allow (tokens a block × plain floor / verify floor).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import warnings
from collections import defaultdict
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from safetensors.torch import save_file

import hylo.engine.verify_graph as verify_graph
import hylo.speculative.verify as verify
from hylo import LLM, SamplingParams
from hylo.engine.cuda_graph import DEFER, DRAFT, OBSERVE, DecodeGraphs
from hylo.engine.verify_graph import COMMIT, VERIFY, VerifyGraphs
from hylo.speculative.token_map import save_token_map

PROMPT_LEN = 64
VOCAB = 154880  # GLM-5.3-Flash's (the config's default)
# "sampled": always verify, at temperature 1 (the verify graphs with acceptance between their two replays)
MODES = ("forced", "forced_common", "adaptive", "static", "sampled", "forced_reading")
TEMPERATURE = {
    "plain": 0.0,
    "forced": 0.0,
    "forced_common": 0.0,
    "forced_reading": 0.0,
    "adaptive": 0.0,
    "static": 0.0,
    "sampled": 1.0,
}


def write_target(path: Path, layers: int) -> None:
    text = {"model_type": "glm5_next_text", "num_hidden_layers": layers}
    raw = {"model_type": "glm5_next", "text_config": text, "quantization_config": {"quant_method": "fp8"}}
    (path / "config.json").write_text(json.dumps(raw))


def write_slice_with_dflash(root: Path, layers: int, block: int = 8) -> tuple[Path, Path]:
    """The slice's config and a random DFlash draft of block `block` (target layers 1, L/2, L-2) under
    `root`: (target directory, draft directory)."""
    target, draft = root / "target", root / "dflash"
    target.mkdir()
    draft.mkdir()
    write_target(target, layers)
    write_dflash(draft, [1, layers // 2, layers - 2], block)
    return target, draft


DFLASH2 = {"conv_kernel_size": 4, "conv_group_size": 128, "selector_rank": 64, "selector_top_k": 8}


def write_dflash(
    path: Path,
    target_layers: list[int],
    block: int,
    dflash2: bool = False,
    hidden=4096,
    vocab=VOCAB,
    layers: int = 2,
    dflash2_config: dict | None = None,
) -> None:
    """A random z-lab-format draft of `layers` Qwen3 layers (32 heads, 8 kv heads, head dim 128) tapping
    `target_layers`; with `dflash2` the DFlash2 keys of `dflash2_config` (default `DFLASH2`)."""
    heads, kv_heads, head_dim, inter = 32, 8, 128, 12288
    extra = DFLASH2 | (dflash2_config or {})
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3", "hidden_size": hidden,
        "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "head_dim": head_dim, "intermediate_size": inter, "rms_norm_eps": 1e-6, "vocab_size": vocab,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
        "layer_types": ["full_attention"] * layers, "is_causal": False,
        "dflash_config": {"block_size": block, "mask_token_id": vocab - 1, "target_layer_ids": target_layers},
    }  # fmt: skip
    if dflash2:
        config["architectures"] = ["DFlash2DraftModel"]
        config["dflash_config"] |= extra
    (path / "config.json").write_text(json.dumps(config))
    gen = torch.Generator(device="cuda").manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=gen, device="cuda") * shape[-1] ** -0.5).bfloat16().cpu()

    def ones(n: int) -> torch.Tensor:
        return torch.ones(n, dtype=torch.bfloat16)

    tensors = {"fc.weight": w(hidden, len(target_layers) * hidden), "hidden_norm.weight": ones(hidden),
               "norm.weight": ones(hidden)}  # fmt: skip
    for i in range(layers):
        p = f"layers.{i}."
        tensors |= {
            p + "input_layernorm.weight": ones(hidden), p + "post_attention_layernorm.weight": ones(hidden),
            p + "self_attn.q_proj.weight": w(heads * head_dim, hidden),
            p + "self_attn.k_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.v_proj.weight": w(kv_heads * head_dim, hidden),
            p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
            p + "self_attn.q_norm.weight": ones(head_dim), p + "self_attn.k_norm.weight": ones(head_dim),
            p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
            p + "mlp.down_proj.weight": w(hidden, inter),
        }  # fmt: skip
    if dflash2:
        taps, groups, rank = (
            extra["conv_kernel_size"],
            hidden // extra["conv_group_size"],
            extra["selector_rank"],
        )
        for i in range(layers):
            for conv in ("attention_conv", "mlp_conv"):
                base = torch.zeros(2, taps, hidden, dtype=torch.bfloat16)
                base[:, 0] = 1
                tensors[f"layers.{i}.{conv}.base_kernel"] = base
                tensors[f"layers.{i}.{conv}.kernel_projection.weight"] = w(2 * taps * groups, hidden)
        tensors |= {"candidate_selector.hidden_projection.weight": w(rank, hidden),
                    "candidate_selector.predecessor_codebook": w(vocab, rank),
                    "candidate_selector.successor_codebook": w(vocab, rank)}  # fmt: skip
    save_file(tensors, str(path / "model.safetensors"))


def accept_everything(picks, drafts, num_drafts=None):
    """An acceptance hook (in place of `accepted_prefix`): every row keeps all of its drafts."""
    return accept_at_most(drafts.shape[1])(picks, drafts, num_drafts)


def accept_at_most(drafts_accepted: int):
    """An acceptance hook (in place of `accepted_prefix`): every row keeps `drafts_accepted` drafts
    (or all it has, if fewer)."""

    def accept(picks, drafts, num_drafts=None):
        every = torch.full((picks.shape[0],), drafts.shape[1], device=picks.device)
        accepted = (every if num_drafts is None else num_drafts.long()).clamp(max=drafts_accepted)
        return accepted, (accepted + 1).int(), picks.gather(1, accepted[:, None])[:, 0]

    return accept


GRAPH_SETS = ("natural", "forced", "forced_common")
ROW_STRIDE = 977  # stream positions between two request-table rows' common drafts


def common_drafting(proposer, stream: torch.Tensor) -> tuple:
    """The proposer's `propose` and `observe_and_propose`, each followed by overwriting the drafts
    it made with `stream`'s tokens at their positions: every algorithm then verifies the same
    tokens, whose blocks route to the same experts (a random draft's own drafts are near-identical
    tokens for DFlash and varied ones for DFlash2, which makes their verify forwards read different
    numbers of experts)."""
    propose, observe_and_propose = type(proposer).propose, type(proposer).observe_and_propose
    after_anchor = torch.arange(proposer.verify_shape.drafts, device=stream.device) + 1

    def overwrite(rows: torch.Tensor, lengths: torch.Tensor) -> None:
        # offset by the row: the batch's sequences (prompts of one length) verify different tokens
        start = lengths.long()[:, None] + after_anchor + ROW_STRIDE * rows[:, None]
        proposer.drafts[rows] = stream[start % stream.numel()]

    def common_propose(batch, commit):
        propose(proposer, batch, commit)
        seqs = commit.sampling
        overwrite(batch.state_slots[seqs], batch.positions[batch.pad_index[seqs, 0]] + commit.counts[seqs])

    def common_observe_and_propose(batch, commit):
        observe_and_propose(proposer, batch, commit)
        overwrite(batch.state_slots, batch.positions[batch.pad_index[:, 0]] + commit.counts)

    return common_propose, common_observe_and_propose


def use_drafting(proposer, drafting: tuple | None) -> None:
    """Install `common_drafting`'s methods on the proposer, or (None) its own again."""
    for name, method in zip(("propose", "observe_and_propose"), drafting or (None, None), strict=True):
        if method is not None:
            setattr(proposer, name, method)
        else:
            proposer.__dict__.pop(name, None)


def decode_rate(
    llm: LLM, prompts: list[list[int]], tokens: int, temperature: float = 0.0
) -> tuple[float, float, int]:
    """(tokens/s per user over the decode phase, wall ms per engine step, syncs per step)."""
    params = SamplingParams(temperature=temperature, max_tokens=tokens, ignore_eos=True)
    engine = llm.engine
    steps = {"n": 0}
    step = engine.step

    def counted():
        steps["n"] += 1
        return step()

    engine.step = counted
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        outs = llm.generate(prompt_token_ids=prompts, sampling_params=params, use_tqdm=False)
        torch.cuda.set_sync_debug_mode("default")
    del engine.step
    decode_s = max(o.metrics.finish_time for o in outs) - max(o.metrics.first_token_time for o in outs)
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    return (tokens - 1) / decode_s, 1000 * decode_s / max(1, steps["n"] - 1), syncs // max(1, steps["n"])


def replay_step(graphs: DecodeGraphs, bucket: int) -> None:
    """Replay what a step of `bucket` replays: the decode graph, or a verify step's two graphs."""
    for name in (VERIFY, COMMIT) if isinstance(graphs, VerifyGraphs) else (OBSERVE,):
        graphs.bank.graphs[name, bucket].graph.replay()


def replay_ms(graphs: DecodeGraphs, bucket: int, reps: int = 50) -> float:
    return timed_ms(lambda: replay_step(graphs, bucket), reps)


def graph_ms(graph: torch.cuda.CUDAGraph, reps: int = 50) -> float:
    return timed_ms(graph.replay, reps)


def timed_ms(replay, reps: int) -> float:
    """GPU ms per call of `replay` (CUDA events around `reps` calls, after one)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    replay()
    torch.cuda.synchronize()
    start.record()
    for _ in range(reps):
        replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def replay_kernels(graphs: VerifyGraphs, bucket: int, reps: int = 5) -> tuple[float, str]:
    """(kernels per replay, the top kernels by GPU time) of `bucket`'s graph, from torch.profiler."""
    from torch.profiler import ProfilerActivity, profile

    replay_step(graphs, bucket)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay_step(graphs, bucket)
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=30)
    return sum(e.count for e in kernels) / reps, table


def copy_bandwidth() -> float:
    """Bytes per second of a device-to-device copy of 2 GiB (read + write): the floor's rate."""
    from triton.testing import do_bench

    src = torch.empty(2**29, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src))
    return 2 * src.numel() * 4 / (ms / 1e3)


def folded_shared_bytes(kwargs: dict | None) -> int:
    """The bytes of the shared expert a routed-experts call reads in its own launches (its `shared`
    argument: its MLP is not called then), 0 when it runs apart."""
    shared = (kwargs or {}).get("shared")
    if shared is None:
        return 0
    return sum(t.numel() * t.element_size() for t in (shared.gate_up, shared.down, *(shared.scales or ())))


def weight_bytes_read(modules: list[torch.nn.Module], forward) -> tuple[float, list[int]]:
    """(Weight bytes one call of `forward` reads, distinct routed experts per experts call): the sum of
    `weight_bytes_by_kind`."""
    read, distinct = weight_bytes_by_kind(modules, forward)
    return sum(read.values()), distinct


def weight_bytes_by_kind(
    modules: list[torch.nn.Module],
    forward,
    kind_of: Callable[[torch.nn.Module, str], str] = lambda module, name: "weights",
    router_kind: str = "weights",
) -> tuple[dict[str, float], list[int]]:
    """(Weight bytes one call of `forward` reads by `kind_of(module, its name under its root)`, distinct
    routed experts per experts call): every call of a module reads its own parameters and buffers once (a
    vocabulary head's `argmax` too, which bypasses `forward`); an embedding reads only its looked-up rows,
    routed experts only the experts their tokens are routed to (`route` on the call's input; at expert
    parallelism those of the rank's own), plus the router's tensors they are given (as `router_kind`) and
    the shared expert's where it runs in their launches (`shared`: its MLP is not called then)."""
    from hylo.layers.moe import Experts, FP8Experts
    from hylo.layers.vocab import HotTokenHead, VocabHead
    from hylo.ops.moe.reference import route

    read: dict[str, float] = defaultdict(float)
    distinct, hooks = [], []

    def own_bytes(m: torch.nn.Module) -> int:
        tensors = [*m.parameters(recurse=False), *m.buffers(recurse=False)]
        return sum(t.numel() * t.element_size() for t in tensors)

    def on_call(kind: str, m: torch.nn.Module, args, kwargs=None) -> None:
        if isinstance(m, torch.nn.Embedding):
            read[kind] += args[0].numel() * m.weight.shape[1] * m.weight.element_size()
        elif isinstance(m, Experts | FP8Experts):
            routing = args[1]  # the router has no forward of its own: its tensors are read here
            read[router_kind] += sum(
                t.numel() * t.element_size() for t in (routing.weight, routing.correction_bias)
            )
            ids = route(args[0], routing).ids.unique()
            first = getattr(m, "first_expert", None)  # a rank at EP reads only its own experts
            if first is not None:
                ids = ids[(ids >= first) & (ids < first + m.gate_up_proj.shape[0])]
            count = int(ids.numel())
            distinct.append(count)
            read[kind] += own_bytes(m) * count / m.gate_up_proj.shape[0]
            read[kind] += folded_shared_bytes(kwargs)
        else:
            read[kind] += own_bytes(m)

    def counting_argmax(head: VocabHead | HotTokenHead, kind: str):
        def argmax(hidden: torch.Tensor) -> torch.Tensor:
            on_call(kind, head, (hidden,))
            return type(head).argmax(head, hidden)

        return argmax

    seen, heads = set(), []
    for root in modules:
        for name, m in root.named_modules():
            kind = kind_of(m, name)
            if id(m) not in seen and own_bytes(m):
                seen.add(id(m))
                hooks.append(m.register_forward_pre_hook(partial(on_call, kind), with_kwargs=True))
            if isinstance(m, VocabHead | HotTokenHead) and m not in heads:
                heads.append(m)
                m.argmax = counting_argmax(m, kind)
    try:
        forward()
    finally:
        for h in hooks:
            h.remove()
        for head in heads:
            del head.argmax
    return dict(read), distinct


def step_floor(graphs: DecodeGraphs, bucket: int, bandwidth: float) -> dict:
    """The weight-read floor of the last step through `bucket`'s graphs (a verify step, or a plain
    decode step), rerun eagerly with counting hooks (the target, and the draft model or the MTP
    layer): bytes, distinct experts per experts call, and the floor in ms at `bandwidth`."""
    proposer = graphs.proposer
    draft = getattr(proposer, "draft", None) or getattr(proposer, "layer", None)
    from hylo.layers.vocab import HotTokenHead

    # a token map's head is the draft's own (its rows of the target's head); otherwise the target's
    head = getattr(proposer, "head", None)
    own_head = [head] if isinstance(head, HotTokenHead) else []
    modules = [graphs.model] + ([draft] if draft is not None else []) + own_head
    with torch.inference_mode():
        read, distinct = weight_bytes_read(modules, lambda: graphs.bank.warm(bucket))
    torch.cuda.synchronize()
    return {
        "weight_gb": round(read / 1e9, 3),
        "distinct_experts_per_call": round(statistics.mean(distinct), 1) if distinct else 0,
        "floor_ms": round(1e3 * read / bandwidth, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="1,8")
    parser.add_argument("--tokens", type=int, default=65)  # 1 + 8 forced blocks of 8
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--mtp-steps", type=int, default=3)
    # NAME_map: NAME drafting from a token map of --token-map-size ids (SGLang's speculative token map)
    parser.add_argument("--algorithms", default="dflash,dflash2,mtp")
    parser.add_argument("--token-map-size", type=int, default=32768)
    parser.add_argument("--modes", default=",".join(MODES))
    # the plain engine's share of the GPU: its weights (the shared target) and its caches
    parser.add_argument("--plain-mem-fraction", type=float, default=0.35)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp())
    target_layers = [1, args.layers // 2, args.layers - 2]
    for name in ("target", "dflash", "dflash2"):
        (root / name).mkdir()
    write_target(root / "target", args.layers)
    algorithms = args.algorithms.split(",")
    for name in ("dflash", "dflash2"):
        if name in algorithms or f"{name}_map" in algorithms:
            write_dflash(root / name, target_layers, args.block, dflash2=name == "dflash2")
    # any ids serve forced acceptance; natural acceptance of a random draft is about 1 either way
    token_map = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(2))[: args.token_map_size]
    save_token_map(token_map, root / "token_map.pt")
    report: dict = {"layers": args.layers, "gpu": torch.cuda.get_device_name(), "block": args.block}
    max_bs = max(map(int, args.batches.split(",")))
    common = dict(skip_warmup=True, load_format="dummy", device="cuda", dtype="bfloat16", context_length=4096,
                  max_running_requests=32, cuda_graph_max_bs=max_bs)  # fmt: skip
    start = time.perf_counter()
    plain = LLM(str(root / "target"), mem_fraction_static=args.plain_mem_fraction, **common)
    target = plain.engine.model
    engines = {}
    for name in algorithms:
        # each engine's caches get about 6 GiB above what is in use once its own weights are loaded
        free, total = torch.cuda.mem_get_info()
        # the MTP layer: FP8 experts, as the target's
        own_weights = (8 if name.startswith("mtp") else 1.5) * 2**30
        fraction = min(0.95, (total - free + own_weights + 6 * 2**30) / total)
        base = name.removesuffix("_map")
        if base == "mtp":
            flags = dict(speculative_algorithm="MTP", speculative_num_steps=args.mtp_steps)
        else:
            flags = dict(
                speculative_algorithm="DFLASH",
                speculative_draft_model_path=str(root / base),
                speculative_num_draft_tokens=args.block,
            )
        if name != base:
            flags["speculative_token_map"] = str(root / "token_map.pt")
        engines[name] = LLM(
            str(root / "target"), target=target, mem_fraction_static=fraction, **flags, **common
        )
    report["engines_start_s"] = round(time.perf_counter() - start, 1)
    real_accept = verify_graph.accepted_prefix
    stream = torch.randint(
        0, 150000, (4096 + 64,), device="cuda", generator=torch.Generator("cuda").manual_seed(1)
    )
    drafting = {name: common_drafting(llm.engine.proposer, stream) for name, llm in engines.items()}
    graphs = {}
    for name, llm in engines.items():
        natural = llm.engine.runner.verify_graphs
        if natural is None:
            continue
        verify_graph.accepted_prefix = accept_everything  # the forced graphs see this at capture
        e = llm.engine
        pool = natural.bank.pool
        forced = VerifyGraphs(e.model, e.caches, e.proposer, natural.buckets[-1], True, pool)
        use_drafting(e.proposer, drafting[name])  # and the common-stream graphs this
        forced_common = VerifyGraphs(e.model, e.caches, e.proposer, natural.buckets[-1], True, pool)
        use_drafting(e.proposer, None)
        graphs[name] = (natural, forced, forced_common)
        verify_graph.accepted_prefix = real_accept
        report[f"{name}_verify_graph_memory_gib"] = round(natural.bank.memory_bytes / 2**30, 2)

    def setup(name: str, mode: str) -> LLM:
        """The engine of `name` in `mode` (forced / adaptive / static): graphs, acceptance, policy."""
        if name == "plain":
            return plain
        llm = engines[name]
        runner, engine = llm.engine.runner, llm.engine
        forced = mode in ("forced", "forced_common", "forced_reading")
        if name in graphs:
            kind = "forced" if mode == "forced_reading" else mode
            runner.verify_graphs = graphs[name][GRAPH_SETS.index(kind) if forced else 0]
        engine.ledger.overlap = mode != "forced_reading"
        verify.accepted_prefix = accept_everything if forced else real_accept
        use_drafting(llm.engine.proposer, drafting[name] if mode == "forced_common" else None)
        if not hasattr(engine, "adaptive_policy"):
            engine.adaptive_policy = engine.policy
        engine.policy = engine.adaptive_policy if mode == "adaptive" else None  # sampled: always verify
        return llm

    modes = [("plain", "plain")] + [(n, m) for n in algorithms for m in args.modes.split(",")]
    gen = torch.Generator().manual_seed(0)
    for bsz in map(int, args.batches.split(",")):
        prompts = [torch.randint(0, 150000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(bsz)]
        runs: dict[str, list[tuple[float, float, int]]] = {f"{n}_{m}": [] for n, m in modes}
        for name, mode in modes:
            # warm-up: prefill and eager kernels
            decode_rate(setup(name, mode), prompts, args.tokens, TEMPERATURE[mode])
        for _ in range(args.reps):
            for name, mode in modes:
                rate = decode_rate(setup(name, mode), prompts, args.tokens, TEMPERATURE[mode])
                runs[f"{name}_{mode}"].append(rate)
        verify.accepted_prefix = real_accept
        row = {}
        for key, values in runs.items():
            row[f"{key}_tok_s_per_user"] = round(statistics.median(v[0] for v in values), 1)
            row[f"{key}_step_ms"] = round(statistics.median(v[1] for v in values), 2)
            row[f"{key}_syncs_per_step"] = statistics.median(v[2] for v in values)
            if key != "plain_plain":
                ratios = [d[0] / p[0] for d, p in zip(values, runs["plain_plain"], strict=True)]
                row[f"{key}_vs_plain"] = round(statistics.median(ratios), 2)
        for name, sets in graphs.items():
            bucket = next(b for b in sets[0].buckets if b >= bsz)
            for kind, g in zip(GRAPH_SETS, sets, strict=True):
                row[f"{name}_verify_replay_ms_{kind}"] = round(replay_ms(g, bucket), 3)
        for name, (natural, *_) in graphs.items():
            bucket = next(b for b in natural.buckets if b >= bsz)
            count, table = replay_kernels(natural, bucket)
            row[f"{name}_verify_kernels_per_replay"] = count
            if args.out:
                Path(args.out).mkdir(parents=True, exist_ok=True)
                (Path(args.out) / f"kernels_{name}_B{bsz}.txt").write_text(table)
        bandwidth = copy_bandwidth()
        row["copy_bandwidth_tb_s"] = round(bandwidth / 1e12, 2)
        for name, sets in graphs.items():
            bucket = next(b for b in sets[0].buckets if b >= bsz)
            for kind, g in zip(GRAPH_SETS, sets, strict=True):
                # one replay first: the floor's rerun verifies the drafts of this kind's drafting
                use_drafting(g.proposer, drafting[name] if kind == "forced_common" else None)
                replay_step(g, bucket)
                row[f"{name}_verify_floor_{kind}"] = step_floor(g, bucket, bandwidth)
                use_drafting(g.proposer, None)
        plain_graphs = plain.engine.runner.graphs
        plain_bucket = next(b for b in plain_graphs.buckets if b >= bsz)
        row["plain_decode_replay_ms"] = round(replay_ms(plain_graphs, plain_bucket), 3)
        for name, llm in engines.items():  # a speculative engine's plain steps: deferring, drafting
            decode = llm.engine.runner.graphs
            for variant in (DEFER, DRAFT):
                if (variant, plain_bucket) in decode.bank.graphs:
                    graph = decode.bank.graphs[variant, plain_bucket].graph
                    row[f"{name}_plain_{variant}_replay_ms"] = round(graph_ms(graph), 3)
        row["plain_decode_floor"] = step_floor(plain_graphs, plain_bucket, bandwidth)
        for name, (_, forced, _) in graphs.items():
            # the forced ratio if both steps ran at their floors: tokens a block × plain floor / verify floor
            bound = forced.tokens_per_seq * row["plain_decode_floor"]["floor_ms"]
            for kind in GRAPH_SETS[1:]:
                floor = row[f"{name}_verify_floor_{kind}"]["floor_ms"]
                row[f"{name}_{kind}_ratio_at_floors"] = round(bound / floor, 2)
        for name, llm in engines.items():
            policy = getattr(llm.engine, "adaptive_policy", None)
            if policy is not None:
                row[f"{name}_adaptive_choices"] = dict(policy.choices)
                row[f"{name}_adaptive_mean_committed"] = policy.mean_committed
                row[f"{name}_adaptive_costs_ms"] = {
                    f"{b}/{'verify' if v else 'plain'}": round(1e3 * statistics.median(t), 2)
                    for (b, v), t in policy.times.items()
                }
        report[f"B{bsz}"] = row
        print(json.dumps({f"B{bsz}": row}), flush=True)
    print(json.dumps(report, indent=1))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "spec_e2e.json").write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
