"""`benchmarks/device/prefill_floors.py`'s clock and work counts, on the CPU: kinds' own times add up to
the forward's, and each kind's work is what its calls did."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

import prefill_floors
from prefill_floors import BF16_FLOPS, BYTES, FP8_FLOPS, Kind, ModuleClock, table

from hylo.layers.linear import Linear


class Outer(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.second = Linear(64, 32), Linear(32, 16)

    def forward(self, x):
        return self.second(torch.relu(self.first(x)) @ torch.eye(32))


def test_own_times_add_up_and_projection_flops_are_counted():
    model = Outer()
    clock = ModuleClock(torch.device("cpu"))
    clock.attach(model)
    x = torch.randn(5, 64)
    with torch.inference_mode():
        start = time.perf_counter()
        model(x)
        wall_ms = 1e3 * (time.perf_counter() - start)
    clock.detach()
    kinds = clock.totals()
    own = [k.ms for k in kinds.values()]
    assert min(own) >= 0 and sum(own) <= wall_ms  # the children's time is not counted twice
    assert kinds["bf16 projections"].calls == 2
    assert kinds["bf16 projections"].work == 2 * 5 * (64 * 32 + 32 * 16)
    assert kinds["other"].calls == 1 and kinds["other"].ms > 0  # Outer's relu and eye product, its own
    with torch.inference_mode():
        model(x)  # hooks gone: nothing more is counted
    assert sum(k.calls for k in clock.kinds.values()) == 3


def test_a_profiled_clock_times_calls_by_their_ranges(monkeypatch):
    """The profiler's clock: each call a `record_function` range, its own time the range's less its child
    calls' (host time on a CPU), the same kinds and work as the events' clock."""
    model = Outer()
    clock = ModuleClock(torch.device("cpu"), profiled=True)
    clock.attach(model)
    x = torch.randn(5, 64)
    with (
        torch.inference_mode(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        start = time.perf_counter()
        model(x)
        wall_ms = 1e3 * (time.perf_counter() - start)
    clock.detach()
    kinds = clock.totals(prof)
    assert kinds["bf16 projections"].calls == 2 and kinds["bf16 projections"].ms > 0
    assert kinds["bf16 projections"].work == 2 * 5 * (64 * 32 + 32 * 16)
    assert kinds["other"].ms > 0 and sum(k.ms for k in kinds.values()) <= wall_ms
    # a trace without a clock's ranges is refused, not read as zero (a parent at 0 less its children)
    unseen = ModuleClock(torch.device("cpu"), profiled=True)
    unseen.attach(model)
    with torch.inference_mode():
        model(x)
    unseen.detach()
    with pytest.raises(RuntimeError, match=r"the profiler's trace lacks 3 of 3 call ranges"):
        unseen.totals(prof)
    # nor one whose range totals contradict each other (a call shorter than the calls inside it)
    inconsistent = ModuleClock(torch.device("cpu"), profiled=True)
    inconsistent.attach(model)
    with (
        torch.inference_mode(),
        torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof,
    ):
        model(x)
    inconsistent.detach()
    spans = prefill_floors._profiled_spans(prof, torch.device("cpu"))
    outer = min(spans, key=lambda label: int(label.rsplit(".", 1)[1]))  # the first call entered: the model
    monkeypatch.setattr(prefill_floors, "_profiled_spans", lambda *a: spans | {outer: 0.0})
    with pytest.raises(
        RuntimeError, match=r"the profiler's trace gives a other call 0.000 ms, less than its calls'"
    ):
        inconsistent.totals(prof)


def _event(name, start, end, kernels=(), thread=1, is_async=False):
    """A profiler event as `_own_kernel_ms` reads it (kernel durations in us)."""
    kernels = [SimpleNamespace(duration=us) for us in kernels]
    span = SimpleNamespace(start=start, end=end)
    return SimpleNamespace(name=name, time_range=span, thread=thread, kernels=kernels, is_async=is_async)


def test_each_kernel_goes_to_the_innermost_clock_range_open_at_its_launch():
    """On a GPU a call's own time is the kernels launched in it and not in its calls, nesting read from the
    ranges' starts: a child range whose recorded end passes its parent's still takes its launches (the
    profiler's tree dropped it, S43-2), a launch at a range's end is still the range's, and launches
    outside every range, on another thread or async are nobody's."""
    events = [
        _event("outer", 0, 100, kernels=[5]),  # a kernel the range itself launched
        _event("aten::mm", 1, 3, kernels=[20]),
        _event("child", 10, 101),  # ends after its parent in the trace
        _event("launch", 12, 13, kernels=[30, 7]),
        _event("grandchild", 20, 30),
        _event("at its start", 20, 21, kernels=[11]),
        _event("at its end", 30, 31, kernels=[2]),
        _event("after it", 31, 32, kernels=[4]),
        _event("record_function of no clock", 40, 50, kernels=[3]),
        _event("outside", 150, 151, kernels=[100]),
        _event("other thread", 12, 13, kernels=[1000], thread=2),
        _event("async", 12, 13, kernels=[500], is_async=True),
    ]
    profile = SimpleNamespace(events=lambda: events)
    own = prefill_floors._own_kernel_ms(profile, {"outer", "child", "grandchild"})
    assert own == pytest.approx({"outer": 25e-3, "child": 44e-3, "grandchild": 13e-3})


def test_a_profiled_clock_on_a_gpu_takes_each_call_s_own_kernels(monkeypatch):
    """The GPU's profiled totals add each call's own kernel time (`_own_kernel_ms`), nothing subtracted,
    and still refuse a trace that lacks a call's range."""
    model = Outer()

    def forward() -> ModuleClock:
        clock = ModuleClock(torch.device("cuda"), profiled=True)
        clock.attach(model)
        with torch.inference_mode():
            model(torch.randn(5, 64))
        clock.detach()
        return clock

    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(prefill_floors, "_own_kernel_ms", lambda profile, wanted: dict.fromkeys(wanted, 1.5))
    kinds = forward().totals(None)
    assert kinds["bf16 projections"].ms == 3.0 and kinds["other"].ms == 1.5
    monkeypatch.setattr(prefill_floors, "_own_kernel_ms", lambda profile, wanted: {min(wanted): 1.0})
    with pytest.raises(RuntimeError, match=r"lacks 2 of 3 call ranges"):
        forward().totals(None)


def test_a_prefill_of_the_random_model_counts_every_kind(shallow_model_dir):
    from hylo import LLM
    from hylo.sampling import SamplingParams

    llm = LLM(str(shallow_model_dir), device="cpu", dtype="float32", max_running_requests=2)
    clock = ModuleClock(torch.device("cpu"))
    clock.attach(llm.engine.model)
    tokens = 40
    llm.engine.add_request("p", list(range(3, 3 + tokens)), SamplingParams(max_tokens=1, temperature=0))
    with torch.inference_mode():
        while llm.engine.has_unfinished():
            llm.engine.step()
    clock.detach()
    kinds = clock.totals()
    config = llm.engine.model.config
    assert {"bf16 projections", "routed experts", "sparse MLA attention", "indexer", "KDA (less projections)",
            "mHC and the layer's glue", "other"} <= set(kinds)  # fmt: skip
    # one prefill step of 40 tokens: each token attends to every earlier latent (index_topk 64 > 40)
    # in each of the two DSA layers, over its heads and the latent rank on both products
    attention = kinds["sparse MLA attention"]
    assert attention.calls == 2
    heads, rank = config.num_attention_heads, config.kv_lora_rank
    assert attention.work == 2 * 4 * heads * rank * tokens * (tokens + 1) // 2
    experts = kinds["routed experts"]  # two MoE layers, every token's top-k pairs on the one rank
    two_i, hidden = 2 * config.moe_intermediate_size, config.hidden_size
    assert experts.work == 2 * 2 * tokens * config.num_experts_per_tok * (
        two_i * hidden + hidden * two_i // 2
    )
    # their weights: every expert tensor of both layers in the share 40 tokens of k choices reach
    reached = 1 - (1 - config.num_experts_per_tok / config.n_routed_experts) ** tokens
    layers = [m for m in llm.engine.model.modules() if type(m).__name__ in ("Experts", "FP8Experts")]
    stored = sum(t.numel() * t.element_size() for m in layers for t in (m.gate_up_proj, m.down_proj))
    assert experts.weight_bytes == pytest.approx(reached * stored, rel=1e-9)
    assert kinds["mHC and the layer's glue"].calls == 3
    rows = table(kinds, {BF16_FLOPS: 1e12, FP8_FLOPS: 2e12, BYTES: 1e12})
    assert [r["kind"] for r in rows] == sorted(kinds, key=lambda k: -kinds[k].ms)
    other = next(r for r in rows if r["kind"] == "other")
    assert other["floor_ms"] is None and other["of_floor"] is None
    first = next(r for r in rows if r["unit"] == BF16_FLOPS)
    assert first["floor_ms"] == pytest.approx(1e3 * kinds[first["kind"]].work / 1e12, abs=1e-3)


def test_the_table_divides_each_kind_by_its_own_rate():
    kinds = {"a": Kind(FP8_FLOPS, ms=2.0, calls=1, work=2e9), "b": Kind(BYTES, ms=1.0, calls=3, work=5e8)}
    rows = table(kinds, {FP8_FLOPS: 1e12, BF16_FLOPS: 5e11, BYTES: 1e12})
    assert rows[0] == {
        "kind": "a", "ms": 2.0, "calls": 1, "unit": FP8_FLOPS, "work": 2e9, "weight_bytes": 0.0,
        "floor_ms": 2.0, "of_floor": 1.0,
    }  # fmt: skip
    assert rows[1]["floor_ms"] == 0.5 and rows[1]["of_floor"] == 0.5


def test_a_kind_that_streams_its_weights_is_floored_by_their_bytes():
    """Few FLOPs over many weights (the routed experts of a 1K prefill): the bytes' floor, the longer."""
    streaming = Kind(FP8_FLOPS, ms=4.0, calls=1, work=1e9, weight_bytes=3e9)
    computing = Kind(FP8_FLOPS, ms=4.0, calls=1, work=4e12, weight_bytes=3e9)
    rates = {FP8_FLOPS: 1e15, BF16_FLOPS: 5e14, BYTES: 3e12}
    (row,) = table({"streaming": streaming}, rates)
    assert row["floor_ms"] == 1.0 and row["of_floor"] == 0.25  # 3 GB at 3 TB/s, not 1 GFLOP at 1 PFLOP/s
    (row,) = table({"computing": computing}, rates)
    assert row["floor_ms"] == 4.0


def test_a_rank_engine_counts_its_share_of_the_experts():
    """`--tp`: the clock on rank 1 of a TP2/EP2 engine (`rank_engine`, collectives a stand-in) counts the
    rank's half of every token's expert pairs, and the weight bytes of the rank's own experts."""
    from hylo.config import EngineConfig
    from hylo.distributed.rank_engine import rank_engine
    from hylo.models.demo import DEMO_DIR
    from hylo.sampling import SamplingParams

    config = EngineConfig.from_kwargs(
        model=str(DEMO_DIR), device="cpu", load_format="dummy", tp_size=2, max_running_requests=2,
        max_memory_gb=0.05,
    )  # fmt: skip
    engine = rank_engine(config, 1)
    clock = ModuleClock(torch.device("cpu"))
    clock.attach(engine.model)
    tokens = 24
    engine.add_request("p", list(range(5, 5 + tokens)), SamplingParams(max_tokens=1, temperature=0))
    with torch.inference_mode():
        while engine.has_unfinished():
            engine.step()
    clock.detach()
    experts = clock.totals()["routed experts"]
    layers = [m for m in engine.model.modules() if type(m).__name__ in ("Experts", "FP8Experts")]
    model = engine.model.config
    local, two_i, hidden = layers[0].gate_up_proj.shape
    assert local == model.n_routed_experts // 2 and experts.calls == len(layers)
    pairs = tokens * model.num_experts_per_tok / 2
    assert experts.work == pytest.approx(len(layers) * 2 * pairs * (two_i * hidden + hidden * two_i // 2))
    reached = 1 - (1 - model.num_experts_per_tok / model.n_routed_experts) ** tokens
    stored = sum(t.numel() * t.element_size() for m in layers for t in m.buffers() if t is not None)
    stored += sum(t.numel() * t.element_size() for m in layers for t in m.parameters(recurse=False))
    assert experts.weight_bytes == pytest.approx(reached * stored, rel=1e-9)
