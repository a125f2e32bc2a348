"""``inferd gateway``: uvicorn around the gateway app, TLS when configured.

On SIGTERM (or Ctrl-C) the gateway stops accepting connections, gives open
requests (streams included) ``drain_timeout_s`` to finish, then stops its
local replicas (each drains on its own SIGTERM) and exits 0. A second signal
exits at once.
"""

from __future__ import annotations

import logging
import signal
from types import FrameType

import uvicorn

from inferd.gateway.app import create_app
from inferd.gateway.config import GatewayConfig
from inferd.obs.logs import configure_logging

logger = logging.getLogger("inferd.gateway")


class _Server(uvicorn.Server):
    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Unlike uvicorn's own, this does not re-raise the signal after the
        # graceful shutdown, so a drained gateway exits 0.
        if self.should_exit:
            self.force_exit = True
            return
        logger.info("received %s: draining", signal.Signals(sig).name)
        self.should_exit = True


def run_gateway(config: GatewayConfig, log_format: str = "plain", log_level: str = "info") -> int:
    configure_logging(log_format, log_level)
    app = create_app(config)
    uv_config = uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        log_config=None,
        log_level=log_level,
        access_log=False,  # one line per request comes from the gateway itself
        timeout_graceful_shutdown=max(1, round(config.drain_timeout_s)),
        ssl_certfile=config.tls_cert,
        ssl_keyfile=config.tls_key,
    )
    scheme = "https" if config.tls_cert else "http"
    logger.info("gateway for %s on %s://%s:%d", ", ".join(m.name for m in config.models), scheme, config.host, config.port)
    _Server(uv_config).run()
    return 0
