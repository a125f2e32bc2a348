"""A real server on loopback: uvicorn in a thread, over its own engine."""

from __future__ import annotations

import socket
import tempfile
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn

from inferd.config import EngineConfig
from inferd.engine.engine import LLMEngine
from inferd.server.app import create_app
from inferd.server.config import ServerConfig

MAX_MODEL_LEN = 1024


class LiveServer:
    def __init__(self, app, engine: LLMEngine) -> None:  # noqa: ANN001
        self.app = app
        self.engine = engine
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._sock]}, daemon=True)

    def start(self, timeout: float = 60.0) -> LiveServer:
        self._thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"server at {self.url} not healthy after {timeout}s")

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(30)
        self._sock.close()

    @property
    def state(self):  # noqa: ANN201
        return self.app.state.server

    def wait_idle(self, timeout: float = 10.0) -> bool:
        """True once the engine runs nothing and every KV block is free."""
        deadline = time.monotonic() + timeout
        kv = self.engine.kv_cache
        while time.monotonic() < deadline:
            sched = self.engine.scheduler
            if not sched.running and not sched.waiting and kv.num_free_blocks == kv.num_blocks:
                return True
            time.sleep(0.02)
        return False


def engine_config(**overrides) -> EngineConfig:
    base = dict(dtype="float32", num_kv_blocks=1024, max_model_len=MAX_MODEL_LEN, max_num_seqs=32)
    return EngineConfig(**(base | overrides))


def live_server(engine: LLMEngine, **server_overrides) -> LiveServer:
    # Its own data directory, so no test resumes batch jobs left in ~/.inferd.
    server_overrides.setdefault("data_dir", tempfile.mkdtemp(prefix="inferd-test-"))
    app = create_app(ServerConfig(**server_overrides), engine=engine)
    return LiveServer(app, engine).start()


@pytest.fixture(scope="package")
def server_engine() -> LLMEngine:
    return LLMEngine(engine_config())


@pytest.fixture(scope="package")
def server(server_engine) -> Iterator[LiveServer]:
    live = live_server(server_engine, served_model_name="smol")
    yield live
    live.stop()


@pytest.fixture(scope="package")
def client(server):  # noqa: ANN201
    import openai

    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def http(server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as c:
        yield c
