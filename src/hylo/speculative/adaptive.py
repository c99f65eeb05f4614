"""Draft length that pays: per step, verify a full block of drafts or decode one token plainly.

A verify step of a batch bucket costs `c_verify` seconds and commits τ tokens per request on average;
a plain decode step costs `c_plain` and commits 1. Verifying pays while `τ · c_plain > c_verify`.
Both costs are measured per batch bucket (the median wall time of its last `COST_WINDOW` steps in
that mode: robust to a step that compiled a kernel), τ as a running mean over the verify steps. A
bucket whose cost in a mode is not yet known runs that mode once. While plain decoding wins, a
bucket verifies anyway after `probe_every` plain steps, so that τ follows a draft that becomes right
again (a request entering code, a repetition); each probe after which plain decoding still wins
doubles that interval, up to `max_probe_every` (a probe costs a verify step and the drafting before
it, for about one token), and verifying winning again resets it. A verify step whose blocks
committed enough to pay is followed by more verify steps even while the running mean, slow to move,
still says otherwise; only the mean paying starts the probe interval over, so that a random draft's
lucky block (two tokens where one is usual) costs one more verify step, not the back-off.

Drafts are made at the end of the step before the one that verifies them, so the policy plans one
step ahead: `plan` says whether this step verifies (decided a step ago) and whether it must draft
for the next one (decided now). Losslessness does not depend on any of it: a plain step and a verify
step commit tokens of the target's own distribution either way.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass, field

from hylo.speculative.verify import VerifyShape

# weight of the newest verify step in the running mean of tokens committed per block
SMOOTHING = 0.2
# step times kept per (bucket, mode)
COST_WINDOW = 8


@dataclass(frozen=True)
class StepPlan:
    """`verify`: this step's decoding requests verify their drafts; `draft`: they draft at its end
    for the next step."""

    verify: bool
    draft: bool


@dataclass
class DraftLengthPolicy:
    """Chooses between verifying blocks of `shape` and plain decoding, per batch bucket (see the module).

    Invariants: `choices` counts the steps planned in each mode (`verify`, `plain`) since start;
    `mean_committed` is the running mean of tokens committed per verify block (None before the first
    verify step: until then every bucket verifies), `last_committed` the last verify step's."""

    shape: VerifyShape
    probe_every: int = 32
    max_probe_every: int = 512
    mean_committed: float | None = None
    last_committed: float | None = None
    times: dict[tuple[int, bool], deque[float]] = field(default_factory=dict)
    choices: dict[str, int] = field(default_factory=lambda: {"verify": 0, "plain": 0})
    _next_verify: dict[int, bool] = field(default_factory=dict)
    _plain_run: dict[int, int] = field(default_factory=dict)
    _probe_interval: dict[int, int] = field(default_factory=dict)

    def plan(self, bucket: int) -> StepPlan:
        """The plan of the next step of `bucket` decoding requests."""
        verify = self._next_verify.get(bucket, True)
        upcoming = self._decide(bucket, verify)
        self._next_verify[bucket] = upcoming
        self.choices["verify" if verify else "plain"] += 1
        return StepPlan(verify, upcoming)

    def record(self, bucket: int, verify: bool, seconds: float, committed_per_block: float | None) -> None:
        """A finished step of `bucket`: its wall time and, for a verify step, the mean tokens its
        blocks committed."""
        self.times.setdefault((bucket, verify), deque(maxlen=COST_WINDOW)).append(seconds)
        if verify and committed_per_block is not None:
            self.last_committed = committed_per_block
            mean = self.mean_committed
            self.mean_committed = (
                committed_per_block if mean is None else mean + SMOOTHING * (committed_per_block - mean)
            )

    def cost(self, bucket: int, verify: bool) -> float | None:
        """Seconds a step of `bucket` takes in that mode (None before one was measured)."""
        times = self.times.get((bucket, verify))
        return statistics.median(times) if times else None

    def _decide(self, bucket: int, verifying_now: bool) -> bool:
        verify_cost, plain_cost = self.cost(bucket, True), self.cost(bucket, False)
        if verify_cost is None or self.mean_committed is None:
            return True
        if plain_cost is None:
            return False
        if self.mean_committed * plain_cost > verify_cost:
            self._plain_run[bucket] = 0
            self._probe_interval[bucket] = self.probe_every
            return True
        if (self.last_committed or 0.0) * plain_cost > verify_cost:
            return True  # a probe that paid verifies on; the back-off stands until the mean pays too
        run = self._plain_run.get(bucket, 0) + (not verifying_now)
        self._plain_run[bucket] = run
        interval = self._probe_interval.get(bucket, self.probe_every)
        if run >= interval:
            self._plain_run[bucket] = 0
            self._probe_interval[bucket] = min(2 * interval, self.max_probe_every)
            return True
        return False
