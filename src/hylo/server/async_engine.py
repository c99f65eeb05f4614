"""The engine on its own thread, with an asyncio front: submit, stream deltas, abort.

Failure containment: an exception while serving one request (adding it, its output bookkeeping,
publishing it) fails that request alone, with finish reason `error`, and frees its pages and slot.
An exception from the step itself (the model forward, the sampler) leaves the batch's state unknown:
the engine stops, every open request fails with an error, and `on_fatal` tells the server to exit.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

from hylo.engine.engine import CheckedPrompt, Engine, StepOutput
from hylo.engine.request import Request, Status
from hylo.sampling import SamplingParams
from hylo.server.metrics import ServerMetrics

logger = logging.getLogger("hylo")


class QueueFull(Exception):
    """The waiting queue holds `max_queued_requests` requests already."""


class EngineUnavailable(Exception):
    """The engine has stopped (shut down, or failed) and takes no more requests."""


@dataclass(frozen=True)
class Delta:
    """What one step added to one sequence (`index` among the request's n), immutable so the event
    loop can read it while the engine thread moves on. A finish reason of `error` carries `error`."""

    index: int
    text: str
    token_ids: tuple[int, ...]
    logprobs: tuple[dict[int, float], ...]
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    error: str | None = None
    # with prompt logprobs, on a sequence's first delta: entries of prompt positions 1 ..
    prompt_logprobs: tuple[dict[int, float], ...] | None = None


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue[Delta]
    prompt_tokens: int
    open: set[int]  # indices that have not received their finishing delta
    indices: dict[str, int] = field(default_factory=dict)  # engine request id -> index


@dataclass
class Handle:
    """A submitted request: its id, and how many of its sequences have not finished yet."""

    request_id: str
    unfinished: int
    stream: _Stream


class AsyncEngine:
    """Owns the `Engine`; only the engine thread touches it after `start`, except for read-only
    validation. Every submitted request ends with a delta carrying a finish reason, whatever fails."""

    def __init__(
        self,
        engine: Engine,
        max_queued_requests: int | None = None,
        on_fatal: Callable[[], None] | None = None,
    ):
        self.engine = engine
        self.max_queued = max_queued_requests
        self.metrics = ServerMetrics(engine)
        self.failure: str | None = None
        self._on_fatal = on_fatal
        # called on the engine thread after each step, and after commands run while idle (what they
        # changed is then whole), e.g. KVEventPublisher.publish; what it raises is logged, not fatal
        self.between_steps: Callable[[], None] | None = None
        self._commands: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        # Guards `_streams` against the engine thread closing it while the event loop submits.
        self._lock = threading.Lock()
        self._closed = False
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="hylo-engine", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def shutdown(self, timeout: float = 10) -> bool:
        """Stop the engine thread; requests still in it are aborted. False if it did not stop in
        `timeout` seconds (a step that never returns)."""
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout=timeout)
        return not self._thread.is_alive()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and self.failure is None and self.engine.failure is None

    @property
    def num_waiting(self) -> int:
        return len(self.engine.scheduler.waiting) + self._commands.qsize()

    @property
    def num_open(self) -> int:
        return len(self._streams)

    def validate(self, prompt_ids: Sequence[int] | CheckedPrompt, params: SamplingParams) -> CheckedPrompt:
        """The prompt checked for `params` (`Engine.validate_prompt`: from any thread, the engine's
        limits being fixed), which `submit` takes without checking it again."""
        return self.engine.validate_prompt(prompt_ids, params)

    def compile_constraint(self, params: SamplingParams) -> None:
        """ValueError if the structured-output constraint does not compile (from any thread; the
        engine keeps the compiled grammar for the request's own add)."""
        self.engine.compile_constraint(params)

    def check_capacity(self, num_requests: int) -> None:
        """QueueFull if `num_requests` more would overfill the waiting queue."""
        if self.max_queued is not None and self.num_waiting + num_requests > self.max_queued:
            raise QueueFull(f"the waiting queue is full ({self.max_queued} requests); retry later")

    def submit(self, prompt_ids: Sequence[int] | CheckedPrompt, params: SamplingParams) -> Handle:
        """Queue a request now (from the event loop), so queue-capacity checks see it at once.
        Raises ValueError for a bad prompt before anything is queued (a `validate`d one is not checked
        again, here or on the engine thread)."""
        prompt = self.validate(prompt_ids, params)
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), len(prompt), set(range(params.n)))
        handle = Handle(f"req-{next(self._ids)}", params.n, stream)
        with self._lock:
            if self._closed:
                raise EngineUnavailable(self.failure or "the server is shutting down")
            self._streams[handle.request_id] = stream
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

    async def call(self, fn: Callable[[Engine], object]) -> object:
        """`fn(engine)` run on the engine thread between steps (where touching the engine is safe);
        its result, or what it raised."""
        future: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise EngineUnavailable(self.failure or "the server is shutting down")
        self._send(("call", fn, future))
        return await asyncio.wrap_future(future)

    def abort(self, handle: Handle) -> None:
        self._send(("abort", handle.request_id))

    def abort_all(self) -> None:
        """Abort every open request (they finish with reason `abort`)."""
        self._send(("abort_all",))

    def _send(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.set()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                self.engine.check_alive()  # a rank is lost: also while nothing runs
                self._drain_commands()
                stepping = self.engine.has_unfinished()
                if stepping:
                    self._publish_step(self.engine.step())
                if self.between_steps is not None:
                    self._between_steps()
                if not stepping:
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
        except Exception as e:
            logger.exception("the engine failed; failing every open request")
            self.failure = f"the engine failed ({type(e).__name__}) and stopped; the server is exiting"
            self._close(self.failure)
            if self._on_fatal is not None:
                self._on_fatal()
            return
        self._drain_commands()
        for request_id in list(self._streams):
            self._abort(request_id)
        self._close("the server is shutting down")

    def _between_steps(self) -> None:
        try:
            self.between_steps()
        except Exception:
            logger.exception("between steps: %s failed", self.between_steps)

    def _drain_commands(self) -> None:
        while True:
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return
            if command[0] == "add":
                self._add(*command[1:])
            elif command[0] == "abort":
                self._abort(command[1])
            elif command[0] == "call":
                _, fn, future = command
                try:
                    future.set_result(fn(self.engine))
                except Exception as e:
                    future.set_exception(e)
            else:
                for request_id in list(self._streams):
                    self._abort(request_id)

    def _add(self, request_id: str, prompt: CheckedPrompt, params: SamplingParams) -> None:
        stream = self._streams[request_id]
        try:
            for i, request in enumerate(self.engine.add_request(request_id, prompt, params)):
                stream.indices[request.request_id] = i
            self.metrics.on_arrival(len(prompt) * params.n)
        except Exception:
            logger.exception("request %s could not be added", request_id)
            # add_request may have queued some of the n sequences before it raised
            for i in range(params.n):
                self.engine.abort(request_id if params.n == 1 else f"{request_id}-{i}")
            stream.indices.clear()
            self._fail_stream(request_id, "the engine could not start this request")

    def _publish_step(self, outputs: list[StepOutput]) -> None:
        try:
            self.metrics.on_step(outputs)
        except Exception:
            logger.exception("step metrics failed")
        for out in outputs:
            try:
                if out.request.finish_reason == "error":
                    self._fail_sequence(out.request, "the engine failed while serving this request")
                else:
                    self._publish(out.request, out.new_text, out.new_token_ids)
            except Exception:
                logger.exception("publishing request %s failed", out.request.request_id)
                self.engine.abort(out.request.request_id)
                self._fail_sequence(out.request, "the engine failed while serving this request")

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return
        for sub_id in list(stream.indices):
            request = self.engine.abort(sub_id)
            if request is not None:
                self._publish(request, "", [])

    def _parent(self, request: Request) -> str:
        return request.request_id if request.params.n == 1 else request.request_id.rsplit("-", 1)[0]

    def _publish(self, request: Request, text: str, token_ids: list[int]) -> None:
        parent = self._parent(request)
        stream = self._streams.get(parent)
        if stream is None:
            return
        index = stream.indices[request.request_id]
        finished = request.status is Status.FINISHED
        logprobs = (
            tuple(request.logprobs[len(request.logprobs) - len(token_ids) :]) if request.logprobs else ()
        )
        first = len(request.output_ids) == len(token_ids) and (token_ids or finished)
        scored = request.params.prompt_logprobs is not None and first
        delta = Delta(
            index,
            text,
            tuple(token_ids),
            logprobs,
            request.finish_reason if finished else None,
            len(request.prompt_ids),
            len(request.output_ids),
            prompt_logprobs=tuple(request.prompt_logprobs) if scored else None,
        )
        if finished:
            self.metrics.on_finish(request)
            del stream.indices[request.request_id]
            self._finish_index(parent, stream, index, delta)
        else:
            _put(stream, delta)

    def _fail_sequence(self, request: Request, message: str) -> None:
        parent = self._parent(request)
        stream = self._streams.get(parent)
        if stream is None:
            return
        index = stream.indices.pop(request.request_id, None)
        if index is not None:
            request.finish("error")
            self.metrics.on_finish(request)
            self._finish_index(parent, stream, index, self._error_delta(stream, index, message))

    def _fail_stream(self, request_id: str, message: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            for index in sorted(stream.open):
                self._finish_index(request_id, stream, index, self._error_delta(stream, index, message))

    @staticmethod
    def _error_delta(stream: _Stream, index: int, message: str) -> Delta:
        return Delta(index, "", (), (), "error", stream.prompt_tokens, 0, message)

    def _finish_index(self, request_id: str, stream: _Stream, index: int, delta: Delta) -> None:
        stream.open.discard(index)
        if not stream.open:
            self._streams.pop(request_id, None)
        _put(stream, delta)

    def _close(self, message: str) -> None:
        """No more submissions; every request still open ends with an error."""
        with self._lock:
            self._closed = True
            for request_id in list(self._streams):
                self._fail_stream(request_id, message)


def _put(stream: _Stream, delta: Delta) -> None:
    # RuntimeError: the event loop has closed, nobody is listening any more
    with contextlib.suppress(RuntimeError):
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
