"""How the ranks of one engine stay in step: rank 0 publishes each step's inputs, the others follow.

Every rank runs the whole engine (scheduler, caches' bookkeeping, sampler) over its shard of the
model, and they agree because they are given the same inputs in the same order: the requests that
arrived and were aborted since the last step, and the step plan rank 0's adaptive draft-length policy
chose (the one decision made from wall-clock timings). Everything else — which chunks run, which
pages they take, which tokens are sampled (from the same gathered logits with the same seeds) — is a
deterministic function of those. So no rank waits for another's batch, and the message of a step is
a fixed header of 4 integers; a request's parameters travel once, when it arrives.

Why every rank samples instead of rank 0 broadcasting its tokens: the tokens are needed on every rank
before the next step's batch (the KDA commit and the drafts read them on the device), and a broadcast
would add a device-to-host-to-device round trip per step; sampling is a few kernels on logits every
rank already holds.

Messages go over a gloo group of their own (host tensors), apart from the device collectives. When
no step has been published for a heartbeat interval (`HEARTBEAT_S`, or a quarter of the group's
timeout if that is shorter), rank 0 sends a heartbeat, so a follower that hears nothing for the
group's timeout knows rank 0 is gone and exits instead of waiting forever.
"""

from __future__ import annotations

import enum
import pickle
import threading
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from hylo.sampling import SamplingParams

HEARTBEAT_S = 5.0


class Kind(enum.IntEnum):
    STEP = 1
    HEARTBEAT = 2
    SHUTDOWN = 3


@dataclass(frozen=True)
class AddRequest:
    """`Engine.add_request` as rank 0 accepted it (validated: it succeeds on every rank)."""

    request_id: str
    prompt_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class Abort:
    request_id: str


Op = AddRequest | Abort


@dataclass(frozen=True)
class Message:
    """What a follower receives: the requests' arrivals and aborts to apply first, in order, then
    (for `Kind.STEP`) one step with the plan (verify, draft) rank 0 chose."""

    kind: Kind
    ops: list[Op]
    verify: bool = True
    draft: bool = True


class Publisher:
    """Rank 0's side. `record` the ops as the engine applies them; `step` sends them with the plan,
    before rank 0 runs that step itself. Safe to call from the engine's thread while the heartbeat
    thread runs. The heartbeats start with `start`, once the engine is built: the start-up exchanges
    on the same group (the cache budget, the memory reports) must not meet one."""

    def __init__(self, group: dist.ProcessGroup, timeout_s: float):
        self.group, self.interval = group, min(HEARTBEAT_S, timeout_s / 4)
        self._ops: list[Op] = []
        self._lock = threading.Lock()
        self._last = time.monotonic()
        self._closed = False

    def start(self) -> None:
        threading.Thread(target=self._heartbeat, name="hylo-heartbeat", daemon=True).start()

    def record(self, op: Op) -> None:
        with self._lock:
            self._ops.append(op)

    def step(self, verify: bool, draft: bool) -> None:
        with self._lock:
            ops, self._ops = self._ops, []
            self._send(Kind.STEP, ops, verify, draft)

    def close(self) -> None:
        """Tell the followers to exit (their engines stop after the ops recorded so far)."""
        with self._lock:
            if self._closed:
                return
            ops, self._ops = self._ops, []
            self._send(Kind.SHUTDOWN, ops, False, False)
            self._closed = True

    def _send(self, kind: Kind, ops: list[Op], verify: bool, draft: bool) -> None:
        payload = pickle.dumps(ops) if ops else b""
        header = torch.tensor([int(kind), len(payload), int(verify), int(draft)], dtype=torch.int64)
        dist.broadcast(header, src=0, group=self.group)
        if payload:
            dist.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), src=0, group=self.group)
        self._last = time.monotonic()

    def _heartbeat(self) -> None:
        while True:
            time.sleep(self.interval / 2)
            with self._lock:
                if self._closed:
                    return
                if time.monotonic() - self._last >= self.interval:
                    try:
                        self._send(Kind.HEARTBEAT, [], False, False)
                    except RuntimeError:  # the group is gone: the engine finds out on its next step
                        return


def receive(group: dist.ProcessGroup) -> Message:
    """A follower's next message (blocks; raises when rank 0 is gone or silent past the timeout)."""
    header = torch.empty(4, dtype=torch.int64)
    dist.broadcast(header, src=0, group=group)
    kind, size, verify, draft = header.tolist()
    ops: list[Op] = []
    if size:
        payload = torch.empty(size, dtype=torch.uint8)
        dist.broadcast(payload, src=0, group=group)
        ops = pickle.loads(payload.numpy().tobytes())
    return Message(Kind(kind), ops, bool(verify), bool(draft))
