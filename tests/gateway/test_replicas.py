"""Local replica processes: scale from zero and back after idle, a replica
killed under load, and the gateway's own SIGTERM — all real processes."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import yaml

from inferd.gateway.config import AuthConfig, ModelConfig
from tests.gateway.conftest import REPLICA_ARGS, free_port

COMMAND = ["inferd", "serve", "--port", "{port}", *REPLICA_ARGS]


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^{re.escape(name)}(?:\{{[^}}]*\}})? ([0-9.e+]+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


def test_scale_from_zero_up_under_load_then_back_to_zero_after_idle(gateway_factory):
    model = ModelConfig(name="smol", command=COMMAND, min_replicas=0, max_replicas=2, idle_timeout_s=2,
                        target_concurrency=2, scale_up_after_s=0.5)
    live = gateway_factory([model], auth=AuthConfig(enabled=False), cold_start_timeout_s=120)
    pool = live.gateway.pools["smol"]
    time.sleep(0.5)
    assert pool.replicas == []  # nothing runs until asked
    res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "Hello", "max_tokens": 2}, timeout=180)
    assert res.status_code == 200 and res.json()["usage"]["completion_tokens"] == 2
    metrics = httpx.get(f"{live.url}/metrics").text
    assert _metric(metrics, "inferd_gateway:cold_starts_total") == 1
    assert _metric(metrics, "inferd_gateway:replica_startup_seconds_count") == 1
    assert 1 < _metric(metrics, "inferd_gateway:replica_startup_seconds_sum") < 120
    assert _metric(metrics, "inferd_gateway:cold_start_wait_seconds_count") == 1

    # 6 in flight on one replica, target 2: a second replica starts.
    async def load() -> list[int]:
        body = {"prompt": "Count:", "max_tokens": 48, "ignore_eos": True}
        async with httpx.AsyncClient(base_url=live.url, timeout=180) as c:
            return [r.status_code for r in await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(6)))]

    assert asyncio.run(load()) == [200] * 6
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'inferd_gateway:scaling_events_total{direction="up",model="smol"} 2.0' in metrics
    processes = [r.process for r in pool.replicas]
    assert len(processes) == 2
    # The second replica comes up (nothing scales down while it starts), then both idle out.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        metrics = httpx.get(f"{live.url}/metrics").text
        if _metric(metrics, "inferd_gateway:replica_startup_seconds_count") == 2 and not pool.replicas:
            break
        time.sleep(0.1)
    assert _metric(metrics, "inferd_gateway:replica_startup_seconds_count") == 2
    assert pool.replicas == [] and all(p.returncode is not None for p in processes)
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'inferd_gateway:scaling_events_total{direction="down",model="smol"} 2.0' in metrics
    assert 'inferd_gateway:replicas{model="smol",state="ready"} 0.0' in metrics


def _gateway_process(tmp_path: Path, models: list[dict]) -> tuple[subprocess.Popen, str, Path]:
    port = free_port()
    config = {"port": port, "auth": {"enabled": False}, "health": {"interval_s": 0.5}, "models": models}
    (tmp_path / "gateway.yaml").write_text(yaml.safe_dump(config))
    log = tmp_path / "gateway.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "inferd.cli", "gateway", "-c", str(tmp_path / "gateway.yaml"), "--data-dir", str(tmp_path)],
        stdout=open(log, "w"), stderr=subprocess.STDOUT,  # noqa: SIM115 - the child keeps it
    )
    return proc, f"http://127.0.0.1:{port}", log


def _wait_ready(url: str, n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=2).json()["models"]["smol"]["ready"] >= n:
                return
        except (httpx.TransportError, ValueError, KeyError):
            pass
        time.sleep(0.1)
    raise RuntimeError(f"{n} replicas not ready after {timeout}s")


async def _stream(client: httpx.AsyncClient, i: int, started: asyncio.Event) -> dict:
    body = {"model": "smol", "prompt": f"Count to fifty: {i},", "max_tokens": 40, "ignore_eos": True, "stream": True}
    events = []
    async with client.stream("POST", "/v1/completions", json=body) as res:
        replica = res.headers.get("x-inferd-replica")
        async for line in res.aiter_lines():
            if line.startswith("data: "):
                events.append(line.removeprefix("data: "))
                started.set()
    return {"status": res.status_code, "replica": replica, "events": events}


async def _plain(client: httpx.AsyncClient, i: int) -> int:
    res = await client.post("/v1/completions", json={"model": "smol", "prompt": f"Q{i}:", "max_tokens": 8, "ignore_eos": True})
    return res.status_code


def test_a_replica_killed_under_load_fails_no_unstarted_request_then_sigterm_stops_everything(tmp_path):
    model = {"name": "smol", "command": COMMAND, "min_replicas": 2, "max_replicas": 2, "tokenizer": "default"}
    proc, url, log = _gateway_process(tmp_path, [model])
    try:
        _wait_ready(url, 2, 180)
        ports = dict(re.findall(r"starting replica (smol-\d) on port (\d+)", log.read_text()))
        pids = {rid: int(subprocess.check_output(["pgrep", "-f", "--", f"--port {port} "]).split()[0]) for rid, port in ports.items()}

        async def load() -> tuple[list[dict], list[int]]:
            async with httpx.AsyncClient(base_url=url, timeout=120) as client:
                started = asyncio.Event()
                streams = [asyncio.ensure_future(_stream(client, i, started)) for i in range(8)]
                await asyncio.wait_for(started.wait(), 60)
                await asyncio.sleep(0.3)
                os.kill(pids["smol-0"], signal.SIGKILL)
                # Sent after the kill: the gateway may still pick smol-0 before it knows.
                plain = [asyncio.ensure_future(_plain(client, i)) for i in range(8)]
                return await asyncio.gather(*streams), await asyncio.gather(*plain)

        streams, plain = asyncio.run(load())
        assert plain == [200] * 8
        assert all(s["status"] == 200 for s in streams)
        for s in streams:
            if s["events"][-1] == "[DONE]" and '"error"' not in s["events"][-2]:
                continue  # finished
            # Cut: only on the killed replica, after it had started, and said so.
            assert s["replica"] == "smol-0" and len(s["events"]) >= 2, s
            assert "broke off" in json.loads(s["events"][-2])["error"]["message"]
            assert s["events"][-1] == "[DONE]"
        assert any(s["replica"] == "smol-0" for s in streams)  # the kill did hit streams
        _wait_ready(url, 2, 180)  # the pool replaced the dead replica (min_replicas 2)
        assert httpx.post(f"{url}/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60).status_code == 200
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) == 2
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
        for pid in map(int, children):
            assert not Path(f"/proc/{pid}").exists() or "zombie" in Path(f"/proc/{pid}/status").read_text().lower()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
