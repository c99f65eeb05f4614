"""The engine on its own thread, with an asyncio front: submit, stream deltas, abort."""

from __future__ import annotations

import asyncio
import itertools
import queue
import threading
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from hylo.engine.engine import Engine
from hylo.engine.request import Request, Status
from hylo.sampling import SamplingParams
from hylo.server.metrics import ServerMetrics


class QueueFull(Exception):
    """The waiting queue holds `max_queued_requests` requests already."""


@dataclass(frozen=True)
class Delta:
    """What one step added to one sequence (`index` among the request's n), immutable so the event
    loop can read it while the engine thread moves on."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    indices: dict[str, int]


@dataclass
class Handle:
    """A submitted request: its id, and how many of its sequences have not finished yet."""

    request_id: str
    unfinished: int
    stream: _Stream


class AsyncEngine:
    """Owns the `Engine`; only the engine thread touches it after `start`, except for read-only
    validation. Every submitted request ends with a delta carrying a finish reason."""

    def __init__(self, engine: Engine, max_queued_requests: int | None = None):
        self.engine = engine
        self.max_queued = max_queued_requests
        self.metrics = ServerMetrics(engine)
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hylo-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the engine thread; requests still in it are aborted."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=30)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    def validate(self, prompt_ids: Sequence[int], params: SamplingParams) -> list[int]:
        return self.engine.validate_prompt(prompt_ids, params)

    def check_capacity(self, num_requests: int) -> None:
        """QueueFull if `num_requests` more would overfill the waiting queue."""
        if self.max_queued is not None and self.num_waiting + num_requests > self.max_queued:
            raise QueueFull(f"the waiting queue is full ({self.max_queued} requests); retry later")

    def submit(self, prompt_ids: Sequence[int], params: SamplingParams) -> Handle:
        """Queue a request now (from the event loop), so queue-capacity checks see it at once.
        Raises ValueError for a bad prompt before anything is queued."""
        prompt = self.validate(prompt_ids, params)
        handle = Handle(
            f"req-{next(self._ids)}", params.n, _Stream(asyncio.get_running_loop(), asyncio.Queue(), {})
        )
        self._streams[handle.request_id] = handle.stream
        self._send(("add", handle.request_id, prompt, params))
        return handle

    async def stream(self, handle: Handle) -> AsyncIterator[Delta]:
        """Deltas of all the request's sequences until each has finished. Leaving the iteration early
        (a client that went away) aborts the request."""
        try:
            while handle.unfinished:
                delta = await handle.stream.queue.get()
                handle.unfinished -= delta.finish_reason is not None
                yield delta
        finally:
            if handle.unfinished:
                self.abort(handle)

    def abort(self, handle: Handle) -> None:
        self._send(("abort", handle.request_id))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._drain_commands()
            if self.engine.has_unfinished():
                outputs = self.engine.step()
                self.metrics.on_step(outputs)
                for out in outputs:
                    self._publish(out.request, out.new_text, out.new_token_ids)
            else:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
        for request_id in list(self._streams):
            self._abort(request_id)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                _, request_id, prompt, params = command
                stream = self._streams[request_id]
                for i, request in enumerate(self.engine.add_request(request_id, prompt, params)):
                    stream.indices[request.request_id] = i
                self.metrics.on_arrival(len(prompt) * params.n)
            else:
                self._abort(command[1])

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        for sub_id in list(stream.indices):
            request = self.engine.abort(sub_id)
            if request is not None:
                self._publish(request, "", [])

    def _publish(self, request: Request, text: str, token_ids: list[int]) -> None:
        parent = request.request_id if request.params.n == 1 else request.request_id.rsplit("-", 1)[0]
        stream = self._streams.get(parent)
        if stream is None:
            return
        index = stream.indices[request.request_id]
        finished = request.status is Status.FINISHED
        logprobs = (
            tuple(request.logprobs[len(request.logprobs) - len(token_ids) :]) if request.logprobs else ()
        )
        delta = Delta(
            index,
            text,
            tuple(token_ids),
            logprobs,
            request.finish_reason if finished else None,
            len(request.prompt_ids),
            len(request.output_ids),
        )
        if finished:
            del stream.indices[request.request_id]
            if not stream.indices:
                del self._streams[parent]
            self.metrics.on_finish(request)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)

    def wait_idle(self, timeout: float) -> bool:
        """True once no request is queued or running (for a graceful shutdown)."""
        deadline = time.monotonic() + timeout
        while self._streams and time.monotonic() < deadline:
            time.sleep(0.05)
        return not self._streams
