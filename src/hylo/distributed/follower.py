"""A rank other than 0: apply what rank 0 publishes, step when it steps, stop when it says so."""

from __future__ import annotations

from hylo.engine.engine import Engine
from hylo.parallel.control import Abort, AddRequest, Kind, receive
from hylo.speculative.adaptive import StepPlan


def follow(engine: Engine) -> None:
    """Run `engine` (built on a follower rank) in step with rank 0 until it shuts down. Outputs are
    dropped: only rank 0 answers clients."""
    group = engine.ranks.control
    while True:
        message = receive(group)
        for op in message.ops:
            if isinstance(op, AddRequest):
                engine.add_request(op.request_id, op.prompt_ids, op.params)
            elif isinstance(op, Abort):
                engine.abort(op.request_id)
        if message.kind is Kind.SHUTDOWN:
            return
        if message.kind is Kind.STEP:
            engine.step(StepPlan(message.verify, message.draft))
