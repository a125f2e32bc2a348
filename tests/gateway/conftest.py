"""Real things on loopback for the gateway tests: ``inferd serve`` replica
processes of the default model, and gateways run in-process by uvicorn over
a config built here."""

from __future__ import annotations

import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn

from inferd.gateway.app import create_app
from inferd.gateway.config import GatewayConfig, ModelConfig
from inferd.gateway.keys import KeyStore

REPLICA_ARGS = ["--kv-cache-memory-gb", "0.2", "--max-model-len", "1024", "--served-model-name", "smol", "--threads", "1"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(url: str, timeout: float, proc: subprocess.Popen | None = None, log: Path | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with {proc.returncode}: {log.read_text()[-3000:] if log else ''}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{url} not healthy after {timeout}s")


class ReplicaProcess:
    """``inferd serve`` on the default model, as its own process."""

    def __init__(self, log: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        self._log_file = open(log, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "inferd.cli", "serve", "--port", str(self.port), *REPLICA_ARGS],
            stdout=self._log_file, stderr=subprocess.STDOUT,
        )

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        self._log_file.close()


@pytest.fixture(scope="package")
def replicas(tmp_path_factory) -> Iterator[list[ReplicaProcess]]:
    """Two replicas of the default model, started side by side, shared by the package's tests."""
    logs = tmp_path_factory.mktemp("replicas")
    started = [ReplicaProcess(logs / f"replica-{i}.log") for i in range(2)]
    try:
        for r in started:
            wait_healthy(r.url, 180, r.proc, r.log)
        yield started
    finally:
        for r in started:
            r.stop()


class LiveGateway:
    def __init__(self, config: GatewayConfig) -> None:
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        scheme = "https" if config.tls_cert else "http"
        self.url = f"{scheme}://127.0.0.1:{self.port}"
        self.app = create_app(config)
        kwargs = {"ssl_certfile": config.tls_cert, "ssl_keyfile": config.tls_key} if config.tls_cert else {}
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_config=None, access_log=False, timeout_graceful_shutdown=5, **kwargs))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    @property
    def gateway(self):  # noqa: ANN201
        return self.app.state.gateway

    def start(self, timeout: float = 30.0) -> LiveGateway:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self._server.started and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise RuntimeError("gateway did not start")
        return self

    def wait_ready(self, model: str, n: int, timeout: float = 30.0) -> None:
        """Until ``n`` replicas of ``model`` pass their health checks."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.gateway.pools[model].counts()["ready"] >= n:
                return
            time.sleep(0.02)
        raise RuntimeError(f"{model}: {n} replicas not ready after {timeout}s: {self.gateway.pools[model].counts()}")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(60)
        self._sock.close()


@pytest.fixture
def gateway_factory(tmp_path) -> Iterator:
    """``start(models, **settings)`` -> a started LiveGateway whose data
    directory is this test's tmp_path; all are stopped after the test."""
    started: list[LiveGateway] = []

    def start(models: list[ModelConfig], **settings) -> LiveGateway:  # noqa: ANN003
        config = GatewayConfig(models=models, data_dir=str(tmp_path), **settings)
        live = LiveGateway(config).start()
        started.append(live)
        return live

    yield start
    for live in started:
        live.stop()


@pytest.fixture
def keys(tmp_path) -> Iterator[KeyStore]:
    """The key store the gateways of this test read (same SQLite file)."""
    store = KeyStore(tmp_path / "gateway.db")
    yield store
    store.close()


def smol(upstreams: list[str], **settings) -> ModelConfig:  # noqa: ANN003
    return ModelConfig(name="smol", upstreams=upstreams, **settings)
