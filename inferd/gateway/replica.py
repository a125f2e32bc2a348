"""One upstream replica as the gateway sees it: address, state, load, and a
circuit breaker.

States: ``starting`` (a local process not yet healthy), ``ready``,
``unhealthy`` (a failed health check or connection; checks go on and bring
it back), ``stopping`` (scaled down or shutting down: finishes what it has,
takes nothing new).

The circuit breaker counts consecutive failures of requests and health
checks; at ``failure_threshold`` it opens and the replica takes no requests
for ``cooldown_s``; then it is half-open: one trial request (or a passing
health check) closes it, a failure opens it again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from inferd.gateway.config import HealthConfig

STATES = ("starting", "ready", "unhealthy", "stopping")


@dataclass
class Replica:
    id: str
    url: str
    model: str
    # Local replicas: the process the gateway started, and its log file.
    process: asyncio.subprocess.Process | None = None
    log_path: str | None = None
    state: str = "starting"
    started_at: float = 0.0
    # Requests the gateway has sent and not yet finished.
    in_flight: int = 0
    # running + waiting from the replica's own /metrics (other clients count too).
    upstream_load: int = 0
    last_active: float = 0.0
    consecutive_failures: int = 0
    failed_checks: int = 0  # consecutive failed health checks
    open_until: float | None = None
    trial_in_flight: bool = False
    served: int = 0

    @property
    def load(self) -> int:
        return max(self.in_flight, self.upstream_load)

    @property
    def circuit(self) -> str:
        return "closed" if self.open_until is None else "open"

    def routable(self, now: float) -> bool:
        if self.state != "ready":
            return False
        if self.open_until is None:
            return True
        return now >= self.open_until and not self.trial_in_flight  # half-open: one trial

    def begin(self, now: float) -> None:
        if self.open_until is not None:
            self.trial_in_flight = True
        self.in_flight += 1
        self.served += 1
        self.last_active = now

    def end(self, now: float, ok: bool, health: HealthConfig) -> None:
        self.in_flight = max(0, self.in_flight - 1)
        self.last_active = now
        self.trial_in_flight = False
        if ok:
            self.succeeded()
        else:
            self.failed(now, health)

    def succeeded(self) -> None:
        self.consecutive_failures = 0
        self.open_until = None

    def failed(self, now: float, health: HealthConfig) -> None:
        self.consecutive_failures += 1
        if self.consecutive_failures >= health.failure_threshold:
            self.open_until = now + health.cooldown_s

    def idle_for(self, now: float) -> float:
        return 0.0 if self.in_flight else now - self.last_active
