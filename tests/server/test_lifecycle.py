"""Loading, overload and a dead engine loop, each on a server of its own."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from inferd.engine.engine import LLMEngine
from inferd.engine.scheduler import Scheduler
from inferd.server import app as app_module
from inferd.server.app import create_app
from inferd.server.config import ServerConfig
from tests.server.conftest import LiveServer, engine_config, live_server


@pytest.fixture(scope="module")
def one_seq_engine() -> LLMEngine:
    """Runs one request at a time, so the others wait."""
    return LLMEngine(engine_config(max_num_seqs=1, num_kv_blocks=256))


def _long_stream(url: str, results: list, started: threading.Event) -> None:
    body = {"prompt": "Count:", "max_tokens": 150, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as res:
        started.set()
        results.append((res.status_code, "".join(res.iter_text())))


def test_a_full_waiting_queue_answers_503_with_retry_after(one_seq_engine):
    live = live_server(one_seq_engine, max_waiting_requests=1)
    try:
        results: list = []
        threads = []
        for _ in range(2):  # one runs, one waits
            started = threading.Event()
            t = threading.Thread(target=_long_stream, args=(live.url, results, started))
            t.start()
            assert started.wait(30)
            threads.append(t)
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert res.status_code == 503
        assert int(res.headers["retry-after"]) >= 1
        assert res.json()["error"]["type"] == "service_unavailable" and "waiting" in res.json()["error"]["message"]
        for t in threads:
            t.join(120)
        assert [status for status, _ in results] == [200, 200]
        assert all(text.endswith("data: [DONE]\n\n") for _, text in results)
        ok = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert ok.status_code == 200
    finally:
        live.stop()


def test_a_dead_engine_loop_turns_health_503(one_seq_engine, monkeypatch):
    live = live_server(one_seq_engine)
    try:
        assert httpx.get(f"{live.url}/health").status_code == 200

        def broken(self):  # noqa: ANN001, ANN202
            raise RuntimeError("scheduler bug")

        monkeypatch.setattr(Scheduler, "schedule", broken)
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert res.status_code == 500 and "scheduler bug" in res.json()["error"]["message"]
        health = httpx.get(f"{live.url}/health")
        assert health.status_code == 503 and "engine loop died" in health.json()["error"]["message"]
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=30)
        assert res.status_code == 503
    finally:
        live.stop()


def test_health_is_503_until_the_model_has_loaded(monkeypatch):
    gate = threading.Event()
    real = app_module.LLMEngine

    def slow_engine(config):  # noqa: ANN001, ANN202
        assert gate.wait(60)
        return real(config)

    monkeypatch.setattr(app_module, "LLMEngine", slow_engine)
    app = create_app(ServerConfig(engine=engine_config(num_kv_blocks=64)))
    live = LiveServer(app, engine=None)
    live._thread.start()
    try:
        deadline = time.monotonic() + 30
        health = None
        while time.monotonic() < deadline:
            try:
                health = httpx.get(f"{live.url}/health", timeout=5)
                break
            except httpx.TransportError:
                time.sleep(0.05)
        assert health is not None and health.status_code == 503
        assert health.json()["error"]["message"] == "loading"
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=5)
        assert res.status_code == 503 and "loading" in res.json()["error"]["message"]

        gate.set()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and httpx.get(f"{live.url}/health").status_code != 200:
            time.sleep(0.05)
        assert httpx.get(f"{live.url}/health").status_code == 200
    finally:
        gate.set()
        live.stop()


def test_a_model_that_fails_to_load_is_reported(tmp_path):
    missing = tmp_path / "nope.gguf"
    app = create_app(ServerConfig(engine=engine_config(model=str(missing))))
    live = LiveServer(app, engine=None)
    live._thread.start()
    try:
        deadline = time.monotonic() + 30
        message = ""
        while time.monotonic() < deadline and "failed to load" not in message:
            try:
                res = httpx.get(f"{live.url}/health", timeout=5)
                message = res.json()["error"]["message"]
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        assert "failed to load" in message and "nope.gguf" in message
    finally:
        live.stop()
