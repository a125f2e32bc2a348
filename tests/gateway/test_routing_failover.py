"""Routing over real replicas, and failover over scripted ones."""

from __future__ import annotations

import asyncio
import collections

import httpx
import pytest

from inferd.gateway.config import AuthConfig, HealthConfig
from tests.gateway.conftest import free_port, smol
from tests.gateway.upstream import FakeUpstream

OPEN = {"auth": AuthConfig(enabled=False)}
SYSTEM = "You are the support assistant of a bicycle shop. " * 8  # ~400 characters


def _chat(system: str, question: str) -> dict:
    return {"model": "smol", "max_tokens": 1,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]}


def test_shared_prefix_requests_stick_to_one_replica_and_distinct_ones_spread(gateway_factory, replicas):
    live = gateway_factory([smol([r.url for r in replicas])], **OPEN)
    live.wait_ready("smol", 2)
    with httpx.Client(base_url=live.url, timeout=60) as c:
        shared = {c.post("/v1/chat/completions", json=_chat(SYSTEM, f"Question {i}?")).headers["x-inferd-replica"]
                  for i in range(8)}
        distinct = collections.Counter(
            c.post("/v1/chat/completions", json=_chat(f"System prompt number {i}.", "Hi")).headers["x-inferd-replica"]
            for i in range(16)
        )
    assert len(shared) == 1
    assert set(distinct) == {"smol-0", "smol-1"}
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'inferd_gateway:routing_decisions_total{decision="affinity",model="smol"} 24.0' in metrics


def test_an_overloaded_affine_replica_sheds_to_the_least_loaded(gateway_factory, replicas):
    live = gateway_factory([smol([r.url for r in replicas])], **OPEN)
    live.wait_ready("smol", 2)
    body = _chat(SYSTEM, "Tell me a long story.") | {"max_tokens": 16, "ignore_eos": True}

    async def burst() -> list[str]:
        async with httpx.AsyncClient(base_url=live.url, timeout=120) as c:
            responses = await asyncio.gather(*(c.post("/v1/chat/completions", json=body) for _ in range(8)))
        assert all(r.status_code == 200 for r in responses)
        return [r.headers["x-inferd-replica"] for r in responses]

    served = collections.Counter(asyncio.run(burst()))
    # Same prefix: affine until it has 3 more in flight than the other (margin 2, factor 1.5).
    assert len(served) == 2 and max(served.values()) >= 4, served


@pytest.fixture
def fakes():  # noqa: ANN201
    started = [FakeUpstream(f"fake{i}").start() for i in range(2)]
    yield started
    for f in started:
        f.stop()


def test_a_dead_replica_is_taken_out_and_requests_go_to_the_live_one(gateway_factory, fakes):
    dead = f"http://127.0.0.1:{free_port()}"
    live = gateway_factory([smol([dead, fakes[0].url])], health=HealthConfig(interval_s=60), **OPEN)
    live.wait_ready("smol", 1)
    # Force the dead one in as "ready", as if it had died since its last check.
    pool = live.gateway.pools["smol"]
    pool._next_check["smol-0"] = float("inf")  # no health check: requests must find out
    pool.replicas[0].state = "ready"
    with httpx.Client(base_url=live.url, timeout=30) as c:
        results = [c.post("/v1/completions", json={"prompt": f"p{i}"}) for i in range(6)]
    assert [r.status_code for r in results] == [200] * 6
    assert {r.json()["choices"][0]["text"] for r in results} == {"from fake0"}
    assert pool.replicas[0].state == "unhealthy"
    metrics = httpx.get(f"{live.url}/metrics").text
    assert 'inferd_gateway:upstream_errors_total{kind="connect",model="smol",replica="smol-0"}' in metrics


def test_503_before_the_first_byte_is_retried_on_another_replica(gateway_factory, fakes):
    fakes[0].mode = "unavailable"
    live = gateway_factory([smol([f.url for f in fakes])], **OPEN)
    live.wait_ready("smol", 2)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        replies = [c.post("/v1/completions", json={"prompt": f"p{i}", "stream": i % 2 == 0}) for i in range(6)]
    assert [r.status_code for r in replies] == [200] * 6
    assert all(r.headers["x-inferd-replica"] == "smol-1" for r in replies)
    assert 'inferd_gateway:retries_total{model="smol"}' in httpx.get(f"{live.url}/metrics").text


def test_every_replica_failing_is_a_502_and_the_circuit_opens(gateway_factory, fakes):
    for f in fakes:
        f.mode = "unavailable"
    live = gateway_factory([smol([f.url for f in fakes])], health=HealthConfig(failure_threshold=2, cooldown_s=60), **OPEN)
    live.wait_ready("smol", 2)
    first = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert first.status_code == 502 and first.json()["error"]["type"] == "upstream_error"
    second = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert second.status_code == 502
    # Two failures each: both circuits are open, so the next request is refused without trying.
    before = sum(len(f.requests) for f in fakes)
    third = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"}, timeout=30)
    assert third.status_code == 503 and sum(len(f.requests) for f in fakes) == before
    assert [r.circuit for r in live.gateway.pools["smol"].replicas] == ["open", "open"]


def test_a_stream_cut_after_it_started_ends_with_an_error_event(gateway_factory, fakes):
    fakes[0].mode = "cut"
    live = gateway_factory([smol([fakes[0].url])], **OPEN)
    live.wait_ready("smol", 1)
    with httpx.stream("POST", f"{live.url}/v1/completions", json={"prompt": "x", "stream": True}, timeout=30) as res:
        assert res.status_code == 200
        events = [line.removeprefix("data: ") for line in res.iter_lines() if line.startswith("data: ")]
    assert events[:2] == [events[0], events[1]] and '"text": "a"' in events[0]
    assert '"error"' in events[-2] and "broke off" in events[-2]
    assert events[-1] == "[DONE]"


def test_a_replica_that_breaks_before_the_first_byte_is_failed_over(gateway_factory, fakes):
    fakes[0].mode = "cut_before_body"
    live = gateway_factory([smol([f.url for f in fakes])], **OPEN)
    live.wait_ready("smol", 2)
    with httpx.Client(base_url=live.url, timeout=30) as c:
        replies = [c.post("/v1/completions", json={"prompt": f"q{i}", "stream": True}) for i in range(4)]
    assert all(r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]") for r in replies)
    assert all('"error"' not in r.text for r in replies)
