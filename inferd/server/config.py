"""``ServerConfig``: what ``inferd serve`` takes (no FastAPI import, so the
CLI stays quick to start)."""

from __future__ import annotations

from dataclasses import dataclass, field

from inferd.config import EngineConfig


@dataclass
class ServerConfig:
    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    # The name clients pass as `model`; None takes the model file's stem.
    served_model_name: str | None = None
    max_body_bytes: int = 2 * 1024 * 1024
    # More requests than this waiting for the engine: new ones get 503.
    max_waiting_requests: int = 256
    # On SIGTERM: how long in-flight requests may take before they are aborted.
    shutdown_grace_s: float = 30.0
    # OTLP/HTTP collector base URL (e.g. http://127.0.0.1:4318) for traces
    # and GenAI metrics; None leaves tracing off.
    otlp_endpoint: str | None = None
    log_format: str = "plain"  # or "json"
    log_level: str = "info"
    # The Batch API's files and jobs (<data_dir>/batch); None: $INFERD_HOME, else ~/.inferd.
    data_dir: str | None = None
    # Larger uploads to POST /v1/files get 413 (OpenAI's limit: 200 MB).
    max_file_bytes: int = 200 * 1024 * 1024

    def __post_init__(self) -> None:
        if self.log_format not in ("plain", "json"):
            raise ValueError(f"log_format must be plain or json, got {self.log_format!r}")
        for name in ("max_body_bytes", "max_waiting_requests", "max_file_bytes"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not self.shutdown_grace_s >= 0:
            raise ValueError(f"shutdown_grace_s must be >= 0, got {self.shutdown_grace_s}")
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
