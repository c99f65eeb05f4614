"""`hylo serve`: the engine thread, the FastAPI app and uvicorn, with a graceful SIGTERM."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import resource
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import uvicorn

from hylo.config import EngineConfig
from hylo.distributed.follower import follow
from hylo.distributed.launch import start
from hylo.engine.engine import Engine
from hylo.server.api import build_app
from hylo.server.async_engine import AsyncEngine
from hylo.server.guard import GuardedHTTP
from hylo.server.kv_events import KVEventPublisher
from hylo.server.responses_store import DEFAULT_MAX_AGE_S, DEFAULT_MAX_ENTRIES, ResponseStore

logger = logging.getLogger("hylo")


# Files the process keeps open besides its connections (checkpoint shards, logs, pipes, the listener).
_OTHER_FILES = 256


def _room_for_connections(connections: int | None) -> None:
    """The soft limit on open files raised, up to the hard one, so that `connections` sockets fit
    beside the process's other files; a warning where they cannot."""
    if connections is None:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = connections + _OTHER_FILES
    if soft == resource.RLIM_INFINITY or soft >= wanted:
        return
    raised = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    resource.setrlimit(resource.RLIMIT_NOFILE, (raised, hard))
    if raised < wanted:
        logger.warning(
            "--limit-concurrency %d: the process may open only %d files; connections beyond about %d "
            "wait until others close",
            connections,
            raised,
            raised - _OTHER_FILES,
        )


class _Server(uvicorn.Server):
    """uvicorn, plus a ready line once the socket listens. On SIGTERM uvicorn stops accepting
    connections and waits for the open ones (streams included); after `graceful_timeout` seconds
    every open request is aborted, so streams end with finish reason `abort` and `[DONE]`."""

    def __init__(self, config: uvicorn.Config, graceful_timeout: float, on_timeout: Callable[[], None]):
        super().__init__(config)
        self.ready_line = ""
        self.graceful_timeout, self.on_timeout = graceful_timeout, on_timeout
        self._timer: threading.Timer | None = None

    def handle_exit(self, sig: int, frame) -> None:
        if self._timer is None:
            self._timer = threading.Timer(self.graceful_timeout, self.on_timeout)
            self._timer.daemon = True
            self._timer.start()
        super().handle_exit(sig, frame)
        if sig == signal.SIGTERM:
            # uvicorn re-raises captured signals after its shutdown; a drained SIGTERM is a clean exit
            self._captured_signals.remove(sig)

    async def startup(self, sockets=None) -> None:
        await super().startup(sockets)
        if self.started:
            print(self.ready_line, flush=True)


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    max_queued_requests: int | None = None,
    graceful_shutdown_timeout: float = 30.0,
    max_request_bytes: int = 8 * 2**20,
    tool_call_parser: str | None = None,
    reasoning_parser: str | None = None,
    timeout_keep_alive: float = 5.0,
    timeout_request_header: float = 10.0,
    timeout_request_body: float = 30.0,
    limit_concurrency: int | None = 2048,
    load_format: str = "vllm",
    responses_store_size: int = DEFAULT_MAX_ENTRIES,
    responses_store_age: float = DEFAULT_MAX_AGE_S,
    kv_events_endpoint: str | None = None,
    abort_grace: float = 3.0,
) -> int:
    """Serve until SIGTERM/SIGINT (exit status 0) or until the engine fails (status 1). On a host
    other than node 0 (or a `torchrun` rank other than 0) this process's rank follows rank 0 instead.
    A connection idle between requests closes after `timeout_keep_alive` seconds; a request's
    headers must arrive within `timeout_request_header` seconds, its body within
    `timeout_request_body` more (else 408, closed); at most `limit_concurrency` connections are open
    (one more gets a 503). `/v1/responses` stores at most `responses_store_size` responses, each
    for `responses_store_age` seconds. With `kv_events_endpoint` the prefix cache's pages are published
    there as vLLM KV events (`hylo.server.kv_events`). After SIGTERM's `graceful_shutdown_timeout` has
    aborted the open requests, their connections get `abort_grace` seconds to send their last chunks,
    then the engine thread as long again to stop (a stuck one is left behind: exit status 1)."""
    if not 0 < abort_grace < math.inf:
        raise ValueError(f"--shutdown-abort-grace must be a positive number of seconds, not {abort_grace}")
    if kv_events_endpoint is not None and config.disable_radix_cache:
        raise ValueError(
            "--kv-events-endpoint publishes the prefix cache's pages: drop --disable-radix-cache"
        )
    engine = Engine(config, ranks=start(config))
    if not engine.ranks.leader:
        follow(engine)
        return 0
    try:
        kv_events = None if kv_events_endpoint is None else KVEventPublisher(kv_events_endpoint)
    except ValueError:
        engine.close()
        raise
    name = served_model_name or (Path(config.model).name if config.model else "hylo-demo")
    server: _Server | None = None

    def on_fatal() -> None:
        server.should_exit = True  # read by uvicorn's main loop, which then shuts down

    async_engine = AsyncEngine(engine, max_queued_requests, on_fatal)
    app = build_app(
        async_engine,
        name,
        api_key,
        max_request_bytes,
        tool_call_parser,
        reasoning_parser,
        body_timeout=timeout_request_body,
        responses_store=ResponseStore(responses_store_size, responses_store_age),
    )
    app.state.load_format = load_format  # GET /get_load's shape (hylo.server.worker_routes)
    app.state.kv_events = kv_events  # GET /kv_event_sources (hylo.server.worker_routes)
    if kv_events is not None:
        # vLLM's tier names: GPU is device memory; a CPU engine's pages are in host memory
        kv_events.attach(engine.caches.prefix, "GPU" if engine.device.type == "cuda" else "CPU")
        async_engine.between_steps = kv_events.publish
    stopped = True

    @contextlib.asynccontextmanager
    async def lifespan(_):
        nonlocal stopped
        async_engine.start()
        yield
        stopped = await asyncio.to_thread(async_engine.shutdown, abort_grace)
        if not stopped:
            logger.error("the engine thread did not stop (a step that never returns); exiting anyway")
        if kv_events is not None and stopped:  # a stuck engine thread may still use the socket
            kv_events.close()
        logger.info("engine stopped")

    app.router.lifespan_context = lifespan
    _room_for_connections(limit_concurrency)
    server = _Server(
        uvicorn.Config(
            app,
            host=host,
            port=port,
            log_level="warning",
            lifespan="on",
            timeout_graceful_shutdown=graceful_shutdown_timeout + abort_grace,
            http=GuardedHTTP.with_limits(timeout_request_header, limit_concurrency),
            timeout_keep_alive=timeout_keep_alive,
        ),
        graceful_shutdown_timeout,
        async_engine.abort_all,
    )
    # The key itself is never printed: ready lines end up in shared logs.
    auth = " -H 'Authorization: Bearer <your --api-key>'" if api_key else ""
    events = "" if kv_events is None else f", KV events on {kv_events.endpoint}"
    server.ready_line = (
        f"hylo: ready, serving {name!r} on http://{host}:{port}{events}\n"
        f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"""-d '{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}'"""
    )
    server.run()
    if async_engine.failure is not None:
        logger.error("exiting with status 1: %s", async_engine.failure)
        engine.ranks.abandon(1)  # a tensor-parallel engine's ranks go with it (this process exits)
        return 1
    engine.close()
    return 0 if stopped else 1
