"""``inferd serve``: uvicorn around the app, with a graceful SIGTERM.

On SIGTERM (or Ctrl-C) the server stops admitting (503, ``/health`` too),
gives in-flight requests ``shutdown_grace_s`` to finish, aborts what is left
(their streams end with an error event), then exits 0. A second signal
exits at once.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from types import FrameType

import uvicorn

from inferd.engine.async_engine import RequestAbortedError
from inferd.obs.logs import configure_logging
from inferd.server.app import ServerState, create_app
from inferd.server.config import ServerConfig

logger = logging.getLogger("inferd.server")

_DRAIN_POLL_S = 0.05


class _GracefulServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self._drain_task: asyncio.Task | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def startup(self, sockets=None) -> None:  # noqa: ANN001
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own, this does not re-raise the signal after
        # shutdown, so a drained server exits 0.
        if self.state.draining or self._loop is None:
            self.force_exit = self.state.draining
            self.should_exit = True
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.state.draining = True
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        grace = self.state.config.shutdown_grace_s
        engine = self.state.engine
        deadline = time.monotonic() + grace
        while engine is not None and engine.num_in_flight and time.monotonic() < deadline:
            await asyncio.sleep(_DRAIN_POLL_S)
        if engine is not None and engine.num_in_flight:
            logger.warning("grace period of %.1fs over: aborting %d requests", grace, engine.num_in_flight)
            engine.abort_all(RequestAbortedError(f"server shut down after a {grace:g}s grace period"))
            # Let the streams write their error events before connections close.
            for _ in range(100):
                if not engine.num_in_flight:
                    break
                await asyncio.sleep(_DRAIN_POLL_S)
        self.should_exit = True


def serve(config: ServerConfig) -> int:
    configure_logging(config.log_format, config.log_level)
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,  # ours, set above
        log_level=config.log_level,
        access_log=False,  # one line per finished request comes from the server itself
        timeout_graceful_shutdown=5,
    )
    server = _GracefulServer(uv_config, app.state.server)
    server.run()
    return 0
