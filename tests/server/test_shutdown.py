"""``inferd serve`` as a process: SIGTERM drains in-flight streams, exits 0."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

INFERD = Path(sys.executable).parent / "inferd"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def serve(tmp_path) -> Iterator:  # noqa: ANN001
    procs = []

    def start(*args: str) -> tuple[subprocess.Popen, str]:
        port = _free_port()
        log = open(tmp_path / f"serve-{port}.log", "w")  # noqa: SIM115 - closed with the process
        proc = subprocess.Popen(
            [str(INFERD), "serve", "--port", str(port), "--kv-cache-memory-gb", "0.2", "--max-model-len", "1024",
             "--log-format", "json", *args],
            stdout=log, stderr=subprocess.STDOUT,
        )
        procs.append((proc, log))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / f"serve-{port}.log").read_text()
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    return proc, url
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise RuntimeError("inferd serve did not become healthy")

    yield start
    for proc, log in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        log.close()


def _events(lines) -> Iterator[str]:  # noqa: ANN001
    for line in lines:
        if line.startswith("data: "):
            yield line.removeprefix("data: ")


def test_sigterm_lets_the_stream_finish_then_exits_0(serve):
    proc, url = serve("--shutdown-grace", "60")
    body = {"prompt": "Count:", "max_tokens": 60, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as res:
        events = _events(res.iter_lines())
        seen = [next(events), next(events)]
        os.kill(proc.pid, signal.SIGTERM)
        # Draining: new work is refused while the stream goes on.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and httpx.get(f"{url}/health").status_code == 200:
            time.sleep(0.02)
        assert httpx.get(f"{url}/health").status_code == 503
        refused = httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2})
        assert refused.status_code == 503 and refused.json()["error"]["type"] == "service_unavailable"
        seen += list(events)
    assert seen[-1] == "[DONE]"
    chunks = [json.loads(e) for e in seen[:-1]]
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert proc.wait(30) == 0


def test_sigterm_aborts_what_outlives_the_grace_period(serve):
    proc, url = serve("--shutdown-grace", "0.5")
    body = {"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as res:
        events = _events(res.iter_lines())
        seen = [next(events)]
        os.kill(proc.pid, signal.SIGTERM)
        seen += list(events)
    assert seen[-1] == "[DONE]"
    error = json.loads(seen[-2])["error"]
    assert error["type"] == "service_unavailable" and "grace period" in error["message"]
    assert proc.wait(30) == 0
