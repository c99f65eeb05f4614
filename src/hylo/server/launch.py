"""`hylo serve`: the engine thread, the FastAPI app and uvicorn, with a graceful SIGTERM."""

from __future__ import annotations

import contextlib
import logging
import signal
from pathlib import Path

import uvicorn

from hylo.config import EngineConfig
from hylo.engine.engine import Engine
from hylo.server.api import build_app
from hylo.server.async_engine import AsyncEngine

logger = logging.getLogger("hylo")


class _Server(uvicorn.Server):
    """uvicorn, plus a ready line once the socket listens. On SIGTERM uvicorn stops accepting
    connections and waits for the open ones (streams included) before the app shuts down."""

    ready_line = ""

    def handle_exit(self, sig: int, frame) -> None:
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
) -> None:
    engine = Engine(config)
    name = served_model_name or (Path(config.model).name if config.model else "hylo-demo")
    async_engine = AsyncEngine(engine, max_queued_requests)
    app = build_app(async_engine, name, api_key)

    @contextlib.asynccontextmanager
    async def lifespan(_):
        async_engine.start()
        yield
        async_engine.wait_idle(timeout=60)
        async_engine.shutdown()
        logger.info("engine stopped")

    app.router.lifespan_context = lifespan
    server = _Server(uvicorn.Config(app, host=host, port=port, log_level="warning", lifespan="on"))
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    server.ready_line = (
        f"hylo: ready, serving {name!r} on http://{host}:{port}\n"
        f"  curl http://{host}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
        f"""-d '{{"model": "{name}", "prompt": "Hello", "max_tokens": 16}}'"""
    )
    server.run()
