"""Where a prefill step's time goes by kind of work, each kind against its own floor (issue 45 item 1):
one fresh prompt of each `--tokens` length prefilled eagerly on the 8-layer slice (`--tp 0`) or on rank 0
of a TP/EP deployment of the full model (`--tp 8`: `hylo.distributed.rank_engine`, collectives recorded,
not run, as in `rank_e2e.py`).

    PYTHONPATH=src python3 benchmarks/device/prefill_floors.py [--tp 0|4|8] [--layers 8] \
        [--tokens 1024,13312] [--chunked-prefill-size N] [--idle-prefill-sizes N,M] [--rounds R] \
        [--queue-ahead-ms MS] [--out DIR]

Every module call of the model's forward is timed between CUDA events (`ModuleClock`), each forward and
each of its decoder layers queued behind a GPU sleep so that the events time the GPU's work and not the
host's launches; a kind's time is its modules' own time, what their child modules take left out, so the
kinds add up to the forward. The floor of each kind comes from the work its calls did, counted from their
arguments (`work`):

- projections (`Linear`, `FusedLinear`; FP8 or bf16 by the weight) and routed experts (the (token,
  expert) pairs the rank holds, 2·(2I·D + I·D) FLOPs each, `work`): FLOPs at the matmul ceiling of their
  precision measured in the same run (`torch._scaled_mm` / `torch.matmul`, 8192³), or their weights'
  bytes at the copy rate where that is longer (`Kind.weight_bytes`: at 1K tokens the routed experts read
  all of a layer's experts for few FLOPs each; the experts' share a call reaches is the expected one,
  1 - (1 - k/E)^T of them for T tokens of k choices among E);
- sparse MLA's attention over the selected latents (`SparseMLA` less its projections and indexer: 4·R
  FLOPs a (token, head, selected row), the rows it returns) at the bf16 ceiling; the indexer's causal
  scoring (2·heads·dim a visible pool) at the FP8 ceiling;
- the KDA layer less its projections (conv, gates, chunked delta rule, gated norm) and the RMSNorms: their
  activations' bytes (read once, written once) at the copy rate;
- a decoder layer less its attention, MLP and norms (mHC's post, pre and the residual streams): three
  passes over the n residual streams and the block input written, twice a layer, at the copy rate;
- the rest (embedding, head, the forward's glue): no floor.

A first run of each length compiles its kernels; the next are timed: once without the clock (the host's
wall time to the first token, hooks off) and once by kind. `--idle-prefill-sizes` compares step budgets of
a lone prompt (the engine's `idle_prefill_size`: 13312 tokens in one step at 16384, in 8192 + 5120 at
8192) in one process, the engine built with the largest and each length run under each budget in turn,
`--rounds` times. Prints and writes `prefill_floors.json`: per length and budget, the wall time and each
kind's ms, calls, work, floor ms and floor / time.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from hylo.layers.indexer import Indexer
from hylo.layers.kda import KDAAttention
from hylo.layers.linear import Linear
from hylo.layers.moe import Experts, FP8Experts
from hylo.layers.norm import RMSNorm
from hylo.layers.sparse_mla import SparseMLA
from hylo.models.glm5_next import DecoderLayer

FP8_FLOPS, BF16_FLOPS, BYTES = "fp8 FLOPs", "bf16 FLOPs", "bytes"  # what a kind's work counts


@dataclass
class Kind:
    """One kind of work: own time (ms), calls, and the work its floor divides (`unit`)."""

    unit: str | None
    ms: float = 0.0
    calls: int = 0
    work: float | torch.Tensor = 0.0  # a tensor while counts computed on the GPU are pending
    weight_bytes: float = 0.0  # weights its calls read, whatever the work: the floor is the longer of both


@dataclass
class Stretch:
    """What the host queued behind one sleep of a `ModuleClock`: the sleep's markers, when the host began,
    the call that opened it, and once it ended the host's ms, the marker at its end and the call that spent
    the most host time of its own in it (name, ms: where a refused stretch's host waited)."""

    slept: object
    woke: object
    host_start: float
    opened: str
    host_ms: float | None = None
    ended: object = None
    slowest: tuple[str, float] = ("", 0.0)


@dataclass
class OpenCall:
    """A module call in progress: its start marker, its children's markers (and sleeps), when the host
    entered it and the host ms of its children and of the sleeps queued inside it."""

    module: torch.nn.Module
    start: object
    children: list = field(default_factory=list)
    host_start: float = 0.0
    children_host_ms: float = 0.0


@dataclass
class ModuleClock:
    """Times every module call of a forward between two markers (CUDA events, or the host clock on a
    CPU) and counts each call's work (`work`): `kinds` after `totals()`. Safe to use when the forward
    runs eagerly (a graph replay calls no module).

    Events time the stream between the markers, which includes the gaps where the GPU waits for the host:
    with a call's markers around every module, a forward of many small launches is host-bound and its
    gaps land on whichever kind is running (the TP8 rank's 13K table, S40-1). So on a GPU each forward (a
    call of the root module) is queued behind `queue_ahead_ms` of GPU sleep, and so is each call of a
    `queue_before` type inside it: the host queues the stretch up to the next sleep while the GPU sleeps,
    and the GPU then runs it without waiting. One sleep a forward is not enough where the forward has
    more launches and markers than the driver queues: the host then blocks until the GPU has drained the
    queue, so that it ends the sleep with the forward half queued (the TP8 rank's 45 layers: the host's
    time grew with the sleep, 420 ms to queue behind 283 ms of it, 979 behind 835, with no synchronising
    torch call; a forward queued behind one long sleep shows the profiler's "Command Buffer Full", S48-1).
    So before queueing a sleep the host also waits for the GPU to finish the stretch before it: the queue
    holds one stretch. A sleep inside a call is one of its children, out of its own time. `totals()`
    refuses a stretch that took the host longer to queue than its sleep lasted (its times would hold gaps
    again), naming the call that opened it and the call whose own host time in it was longest."""

    device: torch.device
    queue_ahead_ms: float = 0.0
    queue_before: tuple[type, ...] = ()  # module types whose calls are queued behind a sleep of their own
    kinds: dict[str, Kind] = field(default_factory=dict)
    _open: list[OpenCall] = field(default_factory=list)  # calls in progress, outermost first
    _done: list = field(default_factory=list)  # (kind, start, end, children's markers) to resolve
    _hooks: list = field(default_factory=list)
    _queued: list[Stretch] = field(default_factory=list)
    _names: dict[int, str] = field(default_factory=dict)  # id(module) -> its name under the root
    _cycles_per_ms: float = 0.0

    def attach(self, root: torch.nn.Module) -> None:
        self._names.update({id(m): name or type(m).__name__ for name, m in root.named_modules()})
        for module in root.modules():
            self._hooks.append(module.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._hooks.append(module.register_forward_hook(self._leave, with_kwargs=True))

    def detach(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _mark(self):
        if self.device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _sleep_cycles(self, ms: float) -> int:
        """GPU clock cycles of `ms` (`torch.cuda._sleep` spins on the SM clock), measured once, after a first
        sleep has raised the clock from idle (measured from idle, a 50 ms sleep took 12 ms at the clock the
        forward runs at: S47-7)."""
        if not self._cycles_per_ms:
            probe = 10**7
            torch.cuda._sleep(probe)
            start = self._mark()
            torch.cuda._sleep(probe)
            end = self._mark()
            torch.cuda.synchronize(self.device)
            self._cycles_per_ms = probe / start.elapsed_time(end)
        return int(ms * self._cycles_per_ms)

    def _enter(self, module, args, kwargs) -> None:
        if (
            self.queue_ahead_ms
            and self.device.type == "cuda"
            and (not self._open or isinstance(module, self.queue_before))
        ):
            began = time.perf_counter()
            self._queue_ahead(module)
            if self._open:  # the sleep and the wait before it are not the parent's own host time
                self._open[-1].children_host_ms += 1e3 * (time.perf_counter() - began)
        self._open.append(OpenCall(module, self._mark(), host_start=time.perf_counter()))

    def _queue_ahead(self, module) -> None:
        self._end_stretch()
        if self._queued:
            # Hold the host until the GPU has run the stretch just queued: the driver's queue then holds this
            # sleep and this stretch alone, and never fills (a full command buffer blocks the host until the
            # GPU drains it, through every sleep queued: S46-5, S47-7; holding two stretches, the TP8 rank's
            # fourth layer still waited through two sleeps, S48-1). The GPU idles between stretches, outside
            # every marker.
            self._queued[-1].ended.synchronize()
        cycles = self._sleep_cycles(self.queue_ahead_ms)
        slept = self._mark()
        torch.cuda._sleep(cycles)
        woke = self._mark()
        if self._open:
            self._open[-1].children.append((slept, woke))
        kind = type(module).__name__
        opened = f"{kind} call {sum(q.opened.startswith(kind + ' ') for q in self._queued)}"
        self._queued.append(Stretch(slept, woke, time.perf_counter(), opened))

    def _end_stretch(self) -> None:
        if self._queued and self._queued[-1].host_ms is None:
            self._queued[-1].host_ms = 1e3 * (time.perf_counter() - self._queued[-1].host_start)
            self._queued[-1].ended = self._mark()

    def _leave(self, module, args, kwargs, output) -> None:
        call = self._open.pop()
        assert call.module is module, "module calls must nest"
        end = self._mark()
        name, unit, amount = work(module, args, output)
        kind = self.kinds.setdefault(name, Kind(unit))
        kind.calls += 1
        kind.work += amount
        kind.weight_bytes += weight_bytes(module, args)
        self._done.append((name, call.start, end, call.children))
        host_ms = 1e3 * (time.perf_counter() - call.host_start)
        own = host_ms - call.children_host_ms
        if self._queued and self._queued[-1].host_ms is None and own > self._queued[-1].slowest[1]:
            self._queued[-1].slowest = (self._names.get(id(module), type(module).__name__), own)
        if self._open:
            self._open[-1].children.append((call.start, end))
            self._open[-1].children_host_ms += host_ms
        else:
            self._end_stretch()

    def totals(self) -> dict[str, Kind]:
        """Each kind's own time, once the forward's markers have completed."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        for stretch in self._queued:
            slept_ms = stretch.slept.elapsed_time(stretch.woke)
            if stretch.host_ms > slept_ms:
                slowest, own = stretch.slowest
                raise RuntimeError(
                    f"a stretch of a forward (from {stretch.opened}) took the host {stretch.host_ms:.1f} ms "
                    f"to queue, longer than the {slept_ms:.1f} ms the GPU slept before it: its calls' times "
                    "would hold the host's gaps (give a longer --queue-ahead-ms); its call with the longest "
                    f"host time of its own: {slowest}, {own:.1f} ms"
                )
        self._queued.clear()

        def ms(start, end) -> float:
            return start.elapsed_time(end) if self.device.type == "cuda" else 1e3 * (end - start)

        for name, start, end, children in self._done:
            self.kinds[name].ms += ms(start, end) - sum(ms(s, e) for s, e in children)
        self._done.clear()
        for kind in self.kinds.values():
            kind.work = float(kind.work)
        return self.kinds


def _projection(module: Linear, x: torch.Tensor) -> tuple[str, str, float]:
    rows = x.numel() // x.shape[-1]
    if module.fp8:  # the rows of its FP8 weight (an FP8 `FusedLinear`'s unquantised parts left out)
        return "FP8 projections", FP8_FLOPS, 2.0 * rows * module.weight.shape[0] * module.in_features
    return "bf16 projections", BF16_FLOPS, 2.0 * rows * module.out_features * module.in_features


def work(module: torch.nn.Module, args: tuple, output: object) -> tuple[str, str | None, float]:
    """(kind, unit, amount) of one call of `module` with these arguments and this output (see the module
    docstring). Counts that need the GPU (the attention's selected rows, the indexer's pools) stay
    tensors until `ModuleClock.totals` (no synchronising read inside the forward); their small
    reductions run after the call's end marker, in its parent's own time. Routed experts:
    every token's top-k pairs, of which a rank holding E_local of the E experts takes the share E_local /
    E (expected, not routed)."""
    if isinstance(module, Linear):
        return _projection(module, args[0])
    if isinstance(module, Experts | FP8Experts):
        x, routing = args[0], args[1]
        local, two_i, hidden = module.gate_up_proj.shape
        pairs = x.shape[0] * routing.top_k * local / routing.weight.shape[0]
        flops = 2.0 * pairs * (two_i * hidden + hidden * two_i // 2)
        return "routed experts", FP8_FLOPS if isinstance(module, FP8Experts) else BF16_FLOPS, flops
    if isinstance(module, SparseMLA):
        rows = output[1]  # the selected latent rows of each token, -1 for none
        return (
            "sparse MLA attention",
            BF16_FLOPS,
            4.0 * module.num_heads * module.rank * (rows >= 0).sum(),
        )
    if isinstance(module, Indexer):
        pools = _visible_pools(args, module.selection.kpool)
        return "indexer", FP8_FLOPS, 2.0 * module.num_heads * module.head_dim * pools
    if isinstance(module, KDAAttention):
        tokens, width = args[0].shape[0], module.num_heads * module.head_dim
        # q, k, v and the two gates' products read, o written, bf16
        return "KDA (less projections)", BYTES, 2.0 * tokens * width * 6
    if isinstance(module, RMSNorm):
        x = args[0]
        return "RMSNorm", BYTES, 2.0 * x.numel() * x.element_size()
    if isinstance(module, DecoderLayer):
        streams = args[0]  # [T, n, D]
        tokens, n, hidden = streams.shape
        return "mHC and the layer's glue", BYTES, 2 * (3 * n + 1) * hidden * tokens * streams.element_size()
    return "other", None, 0.0


def _tensor_bytes(*tensors) -> float:
    return float(sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor)))


def weight_bytes(module: torch.nn.Module, args: tuple) -> float:
    """Bytes of weights one call of `module` must read: a projection's weight (and FP8 scales), the
    routed experts' tensors in the expected share of the experts the call's tokens reach (see the module
    docstring); 0 for every other kind, whose floors count activations only."""
    if isinstance(module, Linear):
        return _tensor_bytes(*module.parameters(recurse=False), *module.buffers(recurse=False))
    if isinstance(module, Experts | FP8Experts):
        tokens, routing = args[0].shape[0], args[1]
        reached = 1.0 - (1.0 - routing.top_k / routing.weight.shape[0]) ** tokens
        return reached * _tensor_bytes(*module.parameters(recurse=False), *module.buffers(recurse=False))
    return 0.0


def _visible_pools(args, kpool: int) -> torch.Tensor:
    """Σ over the step's tokens of the k-pools each scores (causal: position // kpool + 1)."""
    batch = next(a for a in args if hasattr(a, "positions"))
    positions = batch.positions[: args[0].shape[0]]
    return (positions // kpool + 1).sum()


def ceilings(device: torch.device) -> dict[str, float]:
    """Matmul ceilings (FLOP/s, bf16 and FP8 per-tensor 8192³) and the copy rate (bytes/s, read + write:
    `spec_e2e.copy_bandwidth`) measured here."""
    from spec_e2e import copy_bandwidth
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    bf16 = 2 * n**3 / (do_bench(lambda: a @ b) * 1e-3)
    fa, fb = a.to(torch.float8_e4m3fn), b.to(torch.float8_e4m3fn).t()
    one = torch.ones((), device=device)
    fp8 = 2 * n**3 / (do_bench(lambda: torch._scaled_mm(fa, fb, one, one, out_dtype=torch.bfloat16)) * 1e-3)
    return {BF16_FLOPS: bf16, FP8_FLOPS: fp8, BYTES: copy_bandwidth()}


def table(kinds: dict[str, Kind], rates: dict[str, float]) -> list[dict]:
    """Rows by time: kind, ms, calls, work, weight bytes, floor ms at `rates` (the longer of the work's
    and the weights') and floor / time."""
    rows = []
    for name, kind in sorted(kinds.items(), key=lambda kv: -kv[1].ms):
        floor = None
        if kind.unit:
            floor = 1e3 * max(kind.work / rates[kind.unit], kind.weight_bytes / rates[BYTES])
        rows.append({
            "kind": name, "ms": round(kind.ms, 3), "calls": kind.calls, "unit": kind.unit,
            "work": kind.work, "weight_bytes": kind.weight_bytes,
            "floor_ms": None if floor is None else round(floor, 3),
            "of_floor": None if floor is None or not kind.ms else round(floor / kind.ms, 3),
        })  # fmt: skip
    return rows


def prefill(engine, tokens: int, seed: int) -> None:
    """One fresh prompt of `tokens` tokens through the engine's steps to its first token."""
    from hylo.sampling import SamplingParams

    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, 150000, (tokens,), generator=gen).tolist()
    engine.add_request(f"floors-{tokens}-{seed}", prompt, SamplingParams(max_tokens=1, temperature=0))
    while engine.has_unfinished():
        engine.step()


def build(args) -> object:
    """The slice's eager engine (`--tp 0`) or rank 0 of a TP/EP deployment."""
    from spec_e2e import write_target

    from hylo.config import EngineConfig

    root = Path(tempfile.mkdtemp())
    write_target(root, args.layers)
    longest = max(map(int, args.tokens.split(",")))
    # prefill eager (a prefill graph's replay calls no module), decode graphs of one row only
    common = dict(
        load_format="dummy", device="cuda", dtype="bfloat16", skip_warmup=True,
        context_length=max(4096, longest + 64), max_running_requests=4, cuda_graph_max_prefill_tokens=0,
        cuda_graph_max_bs=1, mem_fraction_static=0.85,
    )  # fmt: skip
    if args.chunked_prefill_size is not None:
        common["chunked_prefill_size"] = args.chunked_prefill_size
    if args.idle_prefill_sizes:
        common["idle_prefill_size"] = max(args.idle_prefill_sizes)
    if args.sequence_parallel_tokens is not None:
        common["sequence_parallel_tokens"] = args.sequence_parallel_tokens
    if args.tp == 0:
        from hylo import LLM

        return LLM(str(root), **common).engine
    from hylo.distributed.rank_engine import rank_engine

    return rank_engine(EngineConfig.from_kwargs(model=str(root), tp_size=args.tp, **common), 0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tp", type=int, default=0, help="0: the slice; 4 or 8: rank 0 of that deployment")
    parser.add_argument("--layers", type=int, default=8, help="target layers (45: the full model)")
    parser.add_argument("--tokens", default="1024,13312", help="prompt lengths")
    parser.add_argument(
        "--chunked-prefill-size", type=int, default=None,
        help="prompt tokens a step prefills while a request decodes (default: the engine's, 8192)",
    )  # fmt: skip
    parser.add_argument(
        "--idle-prefill-sizes", default=None, type=lambda text: [int(b) for b in text.split(",")],
        help="step budgets of a lone prompt to compare (e.g. 16384,8192; default: the engine's)",
    )  # fmt: skip
    parser.add_argument("--rounds", type=int, default=1, help="timed runs of each length and budget")
    parser.add_argument(
        "--sequence-parallel-tokens", type=int, default=None,
        help="a rank's steps of at least this many tokens split the streams by token (0: off)",
    )  # fmt: skip
    parser.add_argument(
        "--queue-ahead-ms", type=float, default=50.0,
        help="ms of GPU sleep queued before each forward and each decoder layer: the host queues the stretch "
        "up to the next sleep before the GPU starts it",
    )  # fmt: skip
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    engine = build(args)
    if args.idle_prefill_sizes and min(args.idle_prefill_sizes) < engine.config.chunked_prefill_size:
        parser.error(
            f"--idle-prefill-sizes: each at least the chunk size, {engine.config.chunked_prefill_size}"
        )
    device = torch.device("cuda", torch.cuda.current_device())
    report: dict = {
        "gpu": torch.cuda.get_device_name(), "tp": args.tp, "layers": args.layers,
        "chunked_prefill_size": engine.config.chunked_prefill_size,
        "idle_prefill_size": engine.config.idle_prefill_size,
        "sequence_parallel_tokens": engine.config.sequence_parallel_tokens,
    }  # fmt: skip
    rates = ceilings(device)
    report["rates"] = {k: round(v / 1e12, 1) for k, v in rates.items()}
    model = engine.model
    scheduler = engine.scheduler
    seed = 1
    for tokens in map(int, args.tokens.split(",")):
        budgets = args.idle_prefill_sizes or [scheduler.idle_prefill_budget]
        for budget in budgets:  # compiles this length's kernels under every budget
            scheduler.idle_prefill_budget = budget
            prefill(engine, tokens, seed)
            seed += 1
        for round_ in range(args.rounds):
            for budget in budgets:
                scheduler.idle_prefill_budget = budget
                torch.cuda.synchronize()
                start = time.perf_counter()
                prefill(engine, tokens, seed)
                torch.cuda.synchronize()
                wall = 1e3 * (time.perf_counter() - start)
                clock = ModuleClock(device, queue_ahead_ms=args.queue_ahead_ms, queue_before=(DecoderLayer,))
                clock.attach(model)
                try:
                    prefill(engine, tokens, seed + 1)
                finally:
                    clock.detach()
                seed += 2
                rows = table(clock.totals(), rates)
                report[f"T{tokens}_step{budget}_r{round_}"] = {"wall_ms": round(wall, 2), "kinds": rows}
                sum_ms = sum(r["ms"] for r in rows)
                print(
                    f"\n{tokens} tokens in steps of at most {budget} (round {round_}): wall {wall:.1f} ms "
                    f"(no hooks); by kind {sum_ms:.1f} ms of GPU time (each forward and layer "
                    f"queued behind {args.queue_ahead_ms:g} ms of GPU sleep)"
                )
                print("| kind | ms | calls | floor ms | floor / time |\n|---|---|---|---|---|")
                for r in rows:
                    print(f"| {r['kind']} | {r['ms']} | {r['calls']} | {r['floor_ms']} | {r['of_floor']} |")
    text = json.dumps(report, indent=1)
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        (Path(args.out) / "prefill_floors.json").write_text(text)


if __name__ == "__main__":
    main()
