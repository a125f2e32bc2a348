"""The replicas of one model: health checks, and for local replicas the
processes and the autoscaler.

A supervisor task per pool ticks every ``_TICK_S``: it polls starting
replicas until healthy, checks ready ones every ``health.interval_s`` (and
reads their queue from ``/metrics``), removes local processes that exited,
and scales:

- up by one when in-flight requests per ready replica have stayed above
  ``target_concurrency`` for ``scale_up_after_s`` (one start at a time, up
  to ``max_replicas``), and at once when a request finds no replica at all
  (scale from zero: the request waits, bounded, and the start is a cold start);
- down by one replica idle for ``idle_timeout_s``, to ``min_replicas``
  (zero allowed). A stopping replica takes nothing new, finishes what it
  has, then gets SIGTERM (inferd serve drains on it) and SIGKILL if it
  lingers.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import signal
import socket
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx

from inferd.gateway.config import PORT_PLACEHOLDER, HealthConfig, ModelConfig
from inferd.gateway.metrics import GatewayMetrics
from inferd.gateway.replica import STATES, Replica

logger = logging.getLogger("inferd.gateway")

_TICK_S = 0.25
_STOP_TIMEOUT_S = 30.0
_QUEUE_METRICS = re.compile(rb"^inferd:num_requests_(?:running|waiting)\{[^}]*\} ([0-9.eE+]+)$", re.M)


class NoReplicaError(Exception):
    """No replica can take the request (none healthy, or none started in time)."""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _die_with_parent() -> None:
    # Linux: the replica gets SIGTERM if the gateway dies without stopping it.
    with contextlib.suppress(Exception):
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def replica_argv(command: list[str], port: int) -> list[str]:
    """The command with its port; ``inferd`` runs as this Python's module so
    replicas use the gateway's own installation whatever PATH says."""
    argv = [arg.replace(PORT_PLACEHOLDER, str(port)) for arg in command]
    if argv[0] == "inferd":
        argv = [sys.executable, "-m", "inferd.cli", *argv[1:]]
    return argv


class ReplicaPool:
    def __init__(
        self,
        model: ModelConfig,
        health: HealthConfig,
        client: httpx.AsyncClient,
        metrics: GatewayMetrics,
        log_dir: Path,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.model = model
        self.health = health
        self.client = client
        self.metrics = metrics
        self.log_dir = log_dir
        self.clock = clock
        self.replicas: list[Replica] = []
        self.waiting = 0  # requests waiting for a replica (model at zero)
        self._changed = asyncio.Event()  # a replica became ready, or failed
        self._high_since: float | None = None
        self._next_check: dict[str, float] = {}
        self._task: asyncio.Task | None = None
        self._launching: set[asyncio.Task] = set()
        self._stopping: set[asyncio.Task] = set()
        self._wake = asyncio.Event()
        if not model.local:
            now = clock()
            for i, url in enumerate(model.upstreams):
                self.replicas.append(Replica(id=f"{model.name}-{i}", url=url, model=model.name, started_at=now))

    # Routing side -----------------------------------------------------------------

    def routable(self) -> list[Replica]:
        now = self.clock()
        return [r for r in self.replicas if r.routable(now)]

    async def wait_routable(self, timeout: float) -> list[Replica]:
        """Routable replicas, waiting up to ``timeout`` while one starts (a
        model at zero starts one now); NoReplicaError when none comes."""
        ready = self.routable()
        if ready:
            return ready
        if not any(r.state == "starting" for r in self.replicas) and not self.model.local:
            raise NoReplicaError(f"no healthy replica of {self.model.name!r}")
        start = self.clock()
        cold = not any(r.state in ("starting", "ready", "unhealthy") for r in self.replicas)
        self.waiting += 1
        self._wake.set()
        try:
            deadline = start + timeout
            while not (ready := self.routable()):
                remaining = deadline - self.clock()
                if remaining <= 0:
                    raise NoReplicaError(f"no replica of {self.model.name!r} became healthy within {timeout:g}s")
                self._changed.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), min(remaining, 1.0))
        finally:
            self.waiting -= 1
        if cold:
            self.metrics.cold_start_wait.labels(self.model.name).observe(self.clock() - start)
        return ready

    def connection_failed(self, replica: Replica) -> None:
        """A request could not reach the replica: out of routing until a health check passes."""
        if replica.state == "ready":
            replica.state = "unhealthy"
            self._next_check[replica.id] = self.clock()  # check it at the next tick
            logger.warning("replica %s (%s) unreachable: taken out of routing", replica.id, replica.url)

    # Supervision ---------------------------------------------------------------------

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._supervise())

    async def _supervise(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:  # noqa: BLE001 - the supervisor must outlive any one failure
                logger.exception("supervising %s", self.model.name)
            self._wake.clear()
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._wake.wait(), _TICK_S)

    async def tick(self) -> None:
        now = self.clock()
        checks = [self._check(r, now) for r in list(self.replicas) if r.state != "stopping" and now >= self._next_check.get(r.id, 0.0)]
        if checks:
            await asyncio.gather(*checks)
        if self.model.local:
            self._autoscale(self.clock())

    async def _check(self, replica: Replica, now: float) -> None:
        if replica.process is not None and replica.process.returncode is not None:
            self._exited(replica)
            return
        interval = _TICK_S if replica.state == "starting" else self.health.interval_s
        self._next_check[replica.id] = now + interval
        timed_out = False
        try:
            res = await self.client.get(replica.url + self.model.health_path, timeout=self.health.timeout_s)
            ok = res.status_code == 200
        except httpx.TimeoutException:
            ok, timed_out = False, True
        except httpx.HTTPError:
            ok = False
        now = self.clock()
        if ok:
            replica.failed_checks = 0
            if replica.state == "starting" and replica.process is not None:
                self.metrics.startup.labels(self.model.name).observe(now - replica.started_at)
                logger.info("replica %s ready at %s after %.1fs", replica.id, replica.url, now - replica.started_at)
            if replica.state in ("starting", "unhealthy"):
                replica.state = "ready"
                replica.last_active = now
                self._changed.set()
            if replica.open_until is not None and now >= replica.open_until:
                replica.succeeded()  # half-open and healthy: close the circuit
            await self._read_queue(replica)
            return
        if replica.state == "starting":
            if replica.process is not None and now - replica.started_at > self.model.startup_timeout_s:
                logger.error("replica %s not healthy after %.0fs: stopping it", replica.id, self.model.startup_timeout_s)
                self._retire(replica)
            return
        replica.failed_checks += 1
        # A refused connection or a "not ready" answer counts at once; a slow
        # answer (a replica busy on a small machine) only when it keeps happening.
        if replica.state == "ready" and (not timed_out or replica.failed_checks >= self.health.failure_threshold):
            logger.warning("replica %s failed its health check (%s)", replica.id, "timeout" if timed_out else "refused or not ready")
            replica.state = "unhealthy"
            self._changed.set()
        if not timed_out:
            replica.failed(now, self.health)

    async def _read_queue(self, replica: Replica) -> None:
        try:
            res = await self.client.get(replica.url + "/metrics", timeout=self.health.timeout_s)
        except httpx.HTTPError:
            return
        if res.status_code == 200:
            replica.upstream_load = int(sum(float(v) for v in _QUEUE_METRICS.findall(res.content)))

    def _exited(self, replica: Replica) -> None:
        code = replica.process.returncode if replica.process else None
        logger.error("replica %s exited with code %s (log: %s)", replica.id, code, replica.log_path)
        self.metrics.upstream_errors.labels(self.model.name, replica.id, "exited").inc()
        self.replicas.remove(replica)
        self._changed.set()

    def _autoscale(self, now: float) -> None:
        m = self.model
        live = [r for r in self.replicas if r.state != "stopping"]
        ready = [r for r in live if r.state == "ready"]
        starting = [r for r in live if r.state == "starting"]
        if not live and self.waiting:
            self.metrics.cold_starts.labels(m.name).inc()
            self._spawn("a request arrived at zero replicas")
            return
        if len(live) < m.min_replicas:
            self._spawn(f"below min_replicas={m.min_replicas}")
            return
        serving = [r for r in live if r.state in ("ready", "unhealthy")]
        busy = sum(r.in_flight for r in serving) + self.waiting
        if ready and busy / len(serving) > m.target_concurrency and len(live) < m.max_replicas and not starting:
            if self._high_since is None:
                self._high_since = now
            elif now - self._high_since >= m.scale_up_after_s:
                self._high_since = None
                self._spawn(f"{busy / len(ready):.1f} in flight per replica > target {m.target_concurrency}")
            return
        self._high_since = None
        # Not while one starts: it was started for load that may come back.
        if len(live) > m.min_replicas and not self.waiting and not starting:
            idle = [r for r in ready if r.idle_for(now) >= m.idle_timeout_s]
            if idle:
                replica = min(idle, key=lambda r: r.last_active)
                logger.info("replica %s idle for %.0fs: stopping it", replica.id, replica.idle_for(now))
                self.metrics.scaling.labels(m.name, "down").inc()
                self._retire(replica)

    def _spawn(self, why: str) -> None:
        taken = {r.id for r in self.replicas}
        slot = next(i for i in range(len(taken) + 1) if f"{self.model.name}-{i}" not in taken)
        replica_id = f"{self.model.name}-{slot}"
        port = _free_port()
        argv = replica_argv(self.model.command, port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{replica_id}.log"
        replica = Replica(
            id=replica_id, url=f"http://127.0.0.1:{port}", model=self.model.name,
            log_path=str(log_path), started_at=self.clock(),
        )
        self.replicas.append(replica)
        self.metrics.scaling.labels(self.model.name, "up").inc()
        logger.info("starting replica %s on port %d (%s): %s", replica_id, port, why, " ".join(argv))
        task = asyncio.ensure_future(self._launch(replica, argv, log_path))
        self._launching.add(task)
        task.add_done_callback(self._launching.discard)

    async def _launch(self, replica: Replica, argv: list[str], log_path: Path) -> None:
        env = {**os.environ, **self.model.env}
        try:
            with open(log_path, "ab") as log:
                replica.process = await asyncio.create_subprocess_exec(
                    *argv, stdout=log, stderr=asyncio.subprocess.STDOUT, stdin=asyncio.subprocess.DEVNULL,
                    env=env, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
                )
        except OSError as e:
            logger.error("replica %s could not start: %s", replica.id, e)
            if replica in self.replicas:
                self.replicas.remove(replica)
            self._changed.set()

    def _retire(self, replica: Replica) -> None:
        replica.state = "stopping"
        task = asyncio.ensure_future(self._stop(replica, _STOP_TIMEOUT_S))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def _stop(self, replica: Replica, drain_s: float) -> None:
        """Let the replica finish its requests, then end its process."""
        deadline = self.clock() + drain_s
        while replica.in_flight and self.clock() < deadline:
            await asyncio.sleep(0.05)
        proc = replica.process
        if proc is not None and proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), _STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                logger.warning("replica %s ignored SIGTERM for %.0fs: killing it", replica.id, _STOP_TIMEOUT_S)
                proc.kill()
                await proc.wait()
        if replica in self.replicas:
            self.replicas.remove(replica)
        self._changed.set()

    async def shutdown(self, drain_s: float) -> None:
        """Stop supervising; local replicas finish their requests (up to
        ``drain_s``) and stop."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._launching:  # a process being started: let it start, then stop it
            await asyncio.gather(*list(self._launching), return_exceptions=True)
        for replica in list(self.replicas):
            if replica.process is not None and replica.state != "stopping":
                replica.state = "stopping"
                self._stopping.add(asyncio.ensure_future(self._stop(replica, drain_s)))
        if self._stopping:
            await asyncio.gather(*list(self._stopping), return_exceptions=True)

    def counts(self) -> dict[str, int]:
        out = dict.fromkeys(STATES, 0)
        for r in self.replicas:
            out[r.state] += 1
        return out
