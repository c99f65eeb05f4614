"""Prometheus metrics of one server (its own registry, so several servers can live in one process)."""

from __future__ import annotations

import time
from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from hylo.engine.engine import Engine, StepOutput
from hylo.engine.request import Request

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Gauges read the engine when scraped; histograms and counters are fed by the engine thread."""

    def __init__(self, engine: Engine):
        self.registry = CollectorRegistry()
        r = self.registry
        caches, scheduler = engine.caches, engine.scheduler
        Gauge("hylo_num_requests_running", "Requests holding a slot", registry=r).set_function(
            lambda: len(scheduler.running)
        )
        Gauge("hylo_num_requests_waiting", "Requests queued for a slot", registry=r).set_function(
            lambda: len(scheduler.waiting)
        )
        Gauge("hylo_token_usage", "Fraction of token-cache pages in use", registry=r).set_function(
            lambda: 1 - caches.num_available_pages / caches.pages.size
        )
        Gauge("hylo_state_slot_usage", "Fraction of KDA state slots in use", registry=r).set_function(
            lambda: 1 - caches.slots.num_free / caches.slots.size
        )
        Gauge("hylo_num_preemptions", "Requests preempted so far", registry=r).set_function(
            lambda: scheduler.num_preemptions
        )
        prefix = caches.prefix
        if prefix is not None:
            figures = {
                "hit_tokens": (
                    "Prompt tokens found in the prefix cache so far",
                    lambda: prefix.stats.hit_tokens,
                ),
                "query_tokens": (
                    "Prompt tokens of admitted requests so far",
                    lambda: prefix.stats.query_tokens,
                ),
                "hit_rate": ("Prefix-cache hit tokens / query tokens so far", lambda: prefix.stats.hit_rate),
                "snapshots": ("KDA state snapshots the prefix cache holds", lambda: prefix.num_snapshots),
                "pages": ("Token pages the prefix cache holds", lambda: prefix.num_nodes),
                "evicted_pages": ("Prefix-cache pages evicted so far", lambda: prefix.stats.evicted_pages),
                "evicted_snapshots": (
                    "Prefix-cache snapshots evicted so far",
                    lambda: prefix.stats.evicted_snapshots,
                ),
            }
            for name, (text, value) in figures.items():
                Gauge(f"hylo_prefix_cache_{name}", text, registry=r).set_function(value)
        self.ttft = Histogram(
            "hylo_time_to_first_token_seconds", "Arrival to first token", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.itl = Histogram(
            "hylo_inter_token_latency_seconds",
            "Gap between a request's tokens",
            registry=r,
            buckets=_LATENCY_BUCKETS,
        )
        self.e2e = Histogram(
            "hylo_e2e_request_latency_seconds", "Arrival to finish", registry=r, buckets=_LATENCY_BUCKETS
        )
        self.prompt_tokens = Counter("hylo_prompt_tokens", "Prompt tokens received", registry=r)
        self.generation_tokens = Counter("hylo_generation_tokens", "Tokens generated", registry=r)
        self.finished = Counter("hylo_request_success", "Requests finished", ["finish_reason"], registry=r)
        self.acceptance = Histogram(
            "hylo_spec_acceptance_length",
            "Tokens committed per verify step (tau)",
            registry=r,
            buckets=tuple(range(1, 33)),
        )
        # vLLM's spec-decode counters (their meanings; hylo_ names): verify steps with drafts, the
        # drafts they checked, the drafts accepted, and those accepted at each draft position
        self.spec_drafts = Counter(
            "hylo_spec_decode_num_drafts",
            "Verify steps that checked drafts (one per request per step)",
            registry=r,
        )
        self.spec_draft_tokens = Counter(
            "hylo_spec_decode_num_draft_tokens", "Draft tokens checked by verify steps", registry=r
        )
        self.spec_accepted_tokens = Counter(
            "hylo_spec_decode_num_accepted_tokens", "Draft tokens accepted by verify steps", registry=r
        )
        self.spec_accepted_per_pos = Counter(
            "hylo_spec_decode_num_accepted_tokens_per_pos",
            "Draft tokens accepted at each draft position (0: the first draft after the anchor)",
            ["position"],
            registry=r,
        )
        self.drafted_per_pos: list[int] = []  # verify steps whose drafts reached each position
        self.accepted_per_pos: list[int] = []
        Gauge(
            "hylo_spec_decode_mean_acceptance_length",
            "Tokens committed per verify step so far (accepted drafts + 1; NaN before the first)",
            registry=r,
        ).set_function(lambda: self.mean_acceptance_length or float("nan"))
        rate = Gauge(
            "hylo_spec_decode_acceptance_rate",
            "Accepted / checked drafts at each draft position so far",
            ["position"],
            registry=r,
        )
        self._rate = rate
        policy = self._policy = engine.policy
        if policy is not None:
            steps = Gauge(
                "hylo_spec_adaptive_steps",
                "Decode steps the adaptive draft-length policy planned, by mode (verify or plain)",
                ["mode"],
                registry=r,
            )
            for mode in ("verify", "plain"):
                steps.labels(mode).set_function(lambda mode=mode: policy.choices[mode])
        self.verify_steps = 0
        self.committed_by_verify = 0
        self._last_token: dict[str, float] = {}

    def on_arrival(self, prompt_tokens: int) -> None:
        self.prompt_tokens.inc(prompt_tokens)

    def on_step(self, outputs: Sequence[StepOutput]) -> None:
        now = time.time()
        for out in outputs:
            request = out.request
            self.generation_tokens.inc(len(out.new_token_ids))
            last = self._last_token.get(request.request_id)
            if last is None:
                self.ttft.observe(now - request.metrics.arrival_time)
            else:
                self.itl.observe(now - last)
            self._last_token[request.request_id] = now
            if out.accepted_drafts is not None:
                self.acceptance.observe(out.accepted_drafts + 1)
                self.verify_steps += 1
                self.committed_by_verify += out.accepted_drafts + 1
                if out.num_drafts is not None:
                    self._on_verify(out.num_drafts, out.accepted_drafts)

    def _on_verify(self, drafted: int, accepted: int) -> None:
        self.spec_drafts.inc()
        self.spec_draft_tokens.inc(drafted)
        self.spec_accepted_tokens.inc(accepted)
        for position in range(len(self.drafted_per_pos), drafted):
            self.drafted_per_pos.append(0)
            self.accepted_per_pos.append(0)
            self._rate.labels(str(position)).set_function(lambda p=position: self.acceptance_rate(p))
        for position in range(drafted):
            self.drafted_per_pos[position] += 1
        for position in range(accepted):
            self.accepted_per_pos[position] += 1
            self.spec_accepted_per_pos.labels(str(position)).inc()

    def acceptance_rate(self, position: int) -> float:
        """Accepted / checked drafts at draft `position` (0 is the first draft after the anchor)."""
        drafted = self.drafted_per_pos[position]
        return self.accepted_per_pos[position] / drafted if drafted else float("nan")

    @property
    def mean_acceptance_length(self) -> float | None:
        return self.committed_by_verify / self.verify_steps if self.verify_steps else None

    def speculative_info(self) -> dict:
        """The acceptance figures of /server_info, empty before the first verify step: SGLang's
        `avg_spec_accept_length`, the acceptance rate at each draft position (as /metrics'
        `hylo_spec_decode_acceptance_rate`) and, with the adaptive policy, its planned steps by mode."""
        tau = self.mean_acceptance_length
        if tau is None:
            return {}
        info = {
            "avg_spec_accept_length": tau,
            "spec_accept_rate_per_pos": [self.acceptance_rate(p) for p in range(len(self.drafted_per_pos))],
        }
        if self._policy is not None:
            info["spec_adaptive_steps"] = dict(self._policy.choices)
        return info

    def on_finish(self, request: Request) -> None:
        self._last_token.pop(request.request_id, None)
        self.finished.labels(request.finish_reason or "unknown").inc()
        if request.metrics.finish_time is not None:
            self.e2e.observe(request.metrics.finish_time - request.metrics.arrival_time)

    def render(self) -> bytes:
        return generate_latest(self.registry)
