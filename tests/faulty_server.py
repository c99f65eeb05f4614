"""`hylo serve` with faults planted, for the robustness tests: a prompt that starts with one of these
token sequences fails its output bookkeeping (the failure of one request), makes the engine step
raise (an engine that cannot continue), or makes the step hang (a stuck engine)."""

from __future__ import annotations

import sys
import time

from hylo.cli import main
from hylo.engine.request import Request
from hylo.engine.scheduler import Scheduler

POISON_OUTPUT = [300, 301, 302]
POISON_STEP = [310, 311, 312]
POISON_HANG = [320, 321, 322]


def _starts(ids: list[int], poison: list[int]) -> bool:
    return ids[: len(poison)] == poison


def _plant() -> None:
    append, schedule = Request.append, Scheduler.schedule

    def failing_append(self: Request, token, logprobs):
        if _starts(self.prompt_ids, POISON_OUTPUT):
            raise RuntimeError("planted fault in one request's output")
        return append(self, token, logprobs)

    def failing_schedule(self: Scheduler, *args, **kwargs):
        chunks = schedule(self, *args, **kwargs)
        if any(_starts(ch.request.prompt_ids, POISON_STEP) for ch in chunks):
            raise RuntimeError("planted fault in the engine step")
        if any(_starts(ch.request.prompt_ids, POISON_HANG) for ch in chunks):
            time.sleep(3600)
        return chunks

    Request.append = failing_append
    Scheduler.schedule = failing_schedule


if __name__ == "__main__":
    _plant()
    raise SystemExit(main(sys.argv[1:]))
