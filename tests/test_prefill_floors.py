"""`benchmarks/device/prefill_floors.py`'s clock and work counts, on the CPU: kinds' own times add up to
the forward's, and each kind's work is what its calls did."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "device"))

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


class FakeGPU:
    """A GPU clock for `ModuleClock` on the CPU: events read it, `torch.cuda._sleep` advances it (at
    CYCLES_PER_MS), and kernels take no time."""

    CYCLES_PER_MS = 1.5e6

    def __init__(self, monkeypatch):
        self.now, self.sleeps, self.waits = 0.0, [], []
        gpu = self

        class Event:
            def __init__(self, enable_timing=False):
                self.at = None

            def record(self):
                self.at = gpu.now

            def elapsed_time(self, other):
                return other.at - self.at

            def synchronize(self):
                gpu.waits.append(self)

        monkeypatch.setattr(torch.cuda, "Event", Event)
        monkeypatch.setattr(torch.cuda, "_sleep", self.sleep)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def sleep(self, cycles):
        self.sleeps.append(cycles)
        self.now += cycles / self.CYCLES_PER_MS


def test_each_forward_is_queued_behind_a_gpu_sleep(monkeypatch):
    """On a GPU one sleep of `queue_ahead_ms` is queued before each call of the root module (after one
    that measures the clock rate), none before the calls inside it, and outside every call's markers: the
    kinds' times hold none of it. A forward the host queued in less time than the sleep passes."""
    gpu = FakeGPU(monkeypatch)
    model = Outer()
    clock = ModuleClock(torch.device("cuda"), queue_ahead_ms=5000.0)
    clock.attach(model)
    with torch.inference_mode():
        model(torch.randn(5, 64))
        model(torch.randn(5, 64))
    clock.detach()
    warm, probe, *per_forward = gpu.sleeps  # the clock rate is measured after a sleep that raised it
    assert warm == probe == 10**7 and per_forward == [int(5000.0 * FakeGPU.CYCLES_PER_MS)] * 2
    kinds = clock.totals()
    assert sum(k.calls for k in kinds.values()) == 6
    assert all(
        k.ms == 0.0 for k in kinds.values()
    )  # the fake's kernels take no time, and the sleeps are outside


def test_a_forward_queued_slower_than_its_sleep_is_refused(monkeypatch):
    """A forward whose host time to queue it passes its sleep's length would have the GPU wait for the
    host inside it again: its times are refused."""
    FakeGPU(monkeypatch)
    model = Outer()
    clock = ModuleClock(torch.device("cuda"), queue_ahead_ms=1e-6)
    clock.attach(model)
    with torch.inference_mode():
        model(torch.randn(5, 64))
    clock.detach()
    with pytest.raises(
        RuntimeError,
        match=r"a stretch of a forward \(from Outer call 0\) took the host .* ms to queue, longer than",
    ):
        clock.totals()


class HostBound(torch.nn.Module):
    """A module whose call holds the host (as a launch into a full command buffer would)."""

    def forward(self, x):
        time.sleep(0.05)
        return x


class WithAHostWait(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first, self.waits, self.second = Linear(64, 32), HostBound(), Linear(32, 16)

    def forward(self, x):
        return self.second(self.waits(self.first(x)))


def test_a_refused_stretch_names_its_call_with_the_longest_own_host_time(monkeypatch):
    """The refusal names the call whose host time less its children's was longest in the stretch: the
    waiting module, not its parent (whose host time holds the wait too)."""
    FakeGPU(monkeypatch)
    model = WithAHostWait()
    clock = ModuleClock(torch.device("cuda"), queue_ahead_ms=20.0)
    clock.attach(model)
    with torch.inference_mode():
        model(torch.randn(5, 64))
    clock.detach()
    with pytest.raises(RuntimeError, match=r"longest host time of its own: waits, ") as refused:
        clock.totals()
    assert float(str(refused.value).rsplit(", ", 1)[1].removesuffix(" ms")) >= 45.0  # its 50 ms sleep


def test_calls_of_the_queue_before_types_get_a_sleep_of_their_own(monkeypatch):
    """With `queue_before`, each call of those types is queued behind a sleep too (a forward with more
    launches than the driver queues), and each sleep inside a call is left out of that call's own time:
    Outer's own time, the two projections' parent, holds none of their sleeps."""
    gpu = FakeGPU(monkeypatch)
    model = Outer()
    clock = ModuleClock(torch.device("cuda"), queue_ahead_ms=40.0, queue_before=(Linear,))
    clock.attach(model)
    with torch.inference_mode():
        model(torch.randn(5, 64))
    clock.detach()
    _warm, _probe, *sleeps = gpu.sleeps
    assert sleeps == [int(40.0 * FakeGPU.CYCLES_PER_MS)] * 3  # the forward and each of its two projections
    assert len(clock._queued) == 3 and all(stretch.host_ms is not None for stretch in clock._queued)
    assert [stretch.opened for stretch in clock._queued] == ["Outer call 0", "Linear call 0", "Linear call 1"]
    # before each sleep after the first the host waited for the GPU to finish the stretch before it: the
    # driver's queue holds one stretch
    assert gpu.waits == [stretch.ended for stretch in clock._queued[:2]]
    assert all(stretch.ended not in (None, stretch.slept, stretch.woke) for stretch in clock._queued)
    kinds = clock.totals()
    assert kinds["other"].calls == 1 and kinds["other"].ms == 0.0
    assert kinds["bf16 projections"].calls == 2 and kinds["bf16 projections"].ms == 0.0


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
