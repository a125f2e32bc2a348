"""The gateway's edge in front of real ``inferd serve`` replicas: keys,
rate limits, validation, metrics, CORS and trace context."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai
import pytest

from inferd.gateway.config import AuthConfig
from inferd.gateway.ratelimit import RateLimits
from tests.gateway.conftest import smol
from tests.gateway.upstream import FakeUpstream

CHAT = {"model": "smol", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 2}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def gateway(gateway_factory, replicas):  # noqa: ANN001, ANN201
    live = gateway_factory([smol([r.url for r in replicas], tokenizer="default", max_tokens=32, max_prompt_tokens=200)])
    live.wait_ready("smol", 2)
    return live


def test_each_auth_failure_is_a_401_with_its_reason(gateway, keys):
    now = time.time()
    good, _ = keys.create("good")
    revoked, record = keys.create("revoked")
    keys.revoke(record.id)
    expired, _ = keys.create("expired", now=now - 100, expires_at=now - 50)
    cases = {
        "missing": {},
        "invalid": _bearer("sk-000000000000-" + "x" * 43),
        "revoked": _bearer(revoked),
        "expired": _bearer(expired),
    }
    for reason, headers in cases.items():
        res = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=headers)
        assert res.status_code == 401, reason
        assert res.json()["error"]["type"] == "authentication_error"
        assert res.json()["error"]["code"] == f"{reason}_api_key"
        assert res.headers["www-authenticate"].startswith("Bearer")
    # A bad body without a key is still a 401: the key is checked first.
    assert httpx.post(f"{gateway.url}/v1/chat/completions", content=b"{not json").status_code == 401
    assert httpx.get(f"{gateway.url}/health").status_code == 200
    assert httpx.get(f"{gateway.url}/metrics").status_code == 401
    ok = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=_bearer(good), timeout=60)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 2
    failures = httpx.get(f"{gateway.url}/metrics", headers=_bearer(good)).text
    counts = {"missing": 3, "invalid": 1, "revoked": 1, "expired": 1}  # missing: also the bad body and /metrics
    for reason, n in counts.items():
        assert f'inferd_gateway:auth_failures_total{{reason="{reason}"}} {n:.1f}' in failures


def test_a_key_limited_to_other_models_gets_403_and_sees_no_model(gateway, keys):
    key, _ = keys.create("other", models=["llama"])
    res = httpx.post(f"{gateway.url}/v1/chat/completions", json=CHAT, headers=_bearer(key))
    assert res.status_code == 403 and res.json()["error"]["code"] == "model_not_allowed"
    assert httpx.get(f"{gateway.url}/v1/models", headers=_bearer(key)).json()["data"] == []


def test_the_official_client_works_through_the_gateway_and_usage_is_recorded(gateway, keys):
    key, record = keys.create("client")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key=key, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["smol"]
    reply = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Hi"}], max_tokens=3)
    assert reply.usage.completion_tokens == 3
    chunks = list(client.completions.create(model="smol", prompt="One, two,", max_tokens=4, stream=True))
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) >= 1
    # The stream's usage is recorded as its relay closes, just after the client's last byte.
    deadline = time.monotonic() + 10
    while True:
        gateway.gateway.flush_usage()
        usage = keys.usage(record.id)
        if usage["requests"] == 2 or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert usage["requests"] == 2
    assert usage["prompt_tokens"] == reply.usage.prompt_tokens + 4  # "One, two," is 4 tokens
    assert usage["completion_tokens"] == 3 + 4


def test_bad_requests_never_reach_a_replica(gateway, keys):
    key, _ = keys.create("validation")
    cases = [
        (b"{not json", 400, None),
        (b'{"messages": "hi"}', 400, "messages"),
        (b'{"model": "smol", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 33}', 400, "max_tokens"),
        (b'{"model": "nope", "messages": [{"role": "user", "content": "hi"}]}', 404, "model"),
        (b'{"model": "smol", "messages": [{"role": "user", "content": "' + b"word " * 300 + b'"}]}', 400, "messages"),
        (b'{"model": "smol", "messages": [{"role": "user", "content": "' + b"x" * 3_000_000 + b'"}]}', 413, None),
    ]
    for body, status, param in cases:
        res = httpx.post(f"{gateway.url}/v1/chat/completions", content=body, headers=_bearer(key) | {"content-type": "application/json"})
        assert res.status_code == status, (body[:60], res.text)
        assert res.json()["error"]["param"] == param
    assert "context_length_exceeded" in httpx.post(
        f"{gateway.url}/v1/chat/completions", json=CHAT | {"messages": [{"role": "user", "content": "word " * 300}]},
        headers=_bearer(key),
    ).text
    metrics = httpx.get(f"{gateway.url}/metrics", headers=_bearer(key)).text
    assert "inferd_gateway:time_to_first_byte_seconds_count" not in metrics  # nothing was forwarded


def test_requests_per_minute_burst_gets_429_with_headers_and_the_bucket_refills(gateway, keys):
    key, _ = keys.create("rpm", rpm=30)
    body = {"model": "smol", "prompt": "Hi", "max_tokens": 1}

    async def burst() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=gateway.url, headers=_bearer(key), timeout=60) as c:
            return await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(33)))

    responses = asyncio.run(burst())
    statuses = sorted(r.status_code for r in responses)
    assert statuses == [200] * 30 + [429] * 3
    refused = next(r for r in responses if r.status_code == 429)
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert refused.json()["error"]["code"] == "rate_limit_requests"
    assert refused.headers["retry-after"] == "2"  # one request per 2 s
    assert refused.headers["x-ratelimit-limit-requests"] == "30"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in responses if r.status_code == 200)
    assert remaining == list(range(30))
    time.sleep(2.1)
    again = httpx.post(f"{gateway.url}/v1/completions", json=body, headers=_bearer(key), timeout=60)
    assert again.status_code == 200


def test_tokens_per_minute_count_prompt_first_and_completion_as_it_streams(gateway, keys):
    key, _ = keys.create("tpm", tpm=120)
    body = {"model": "smol", "prompt": "The capital of France is", "max_tokens": 30, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{gateway.url}/v1/completions", json=body, headers=_bearer(key), timeout=60) as res:
        assert res.status_code == 200
        # Taken at admission: the 5 prompt tokens (counted exactly with the model's tokenizer).
        assert int(res.headers["x-ratelimit-remaining-tokens"]) == 115
        text = res.read().decode()
    assert text.rstrip().endswith("data: [DONE]")
    # 35 of 120 used; a 90-token prompt must wait for 5 tokens at 2 per second.
    long = {"model": "smol", "prompt": "a " * 89, "max_tokens": 1}
    refused = httpx.post(f"{gateway.url}/v1/completions", json=long, headers=_bearer(key))
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_tokens"
    # Whatever refilled while the stream ran: the wait is the rest of the 90 at 2 tokens a second.
    remaining = int(refused.headers["x-ratelimit-remaining-tokens"])
    assert 0 <= remaining < 90
    assert abs(int(refused.headers["retry-after"]) - (90 - remaining) / 2) <= 1
    too_big = httpx.post(f"{gateway.url}/v1/completions", json={**long, "prompt": "a " * 150}, headers=_bearer(key))
    assert too_big.status_code == 429 and "will not pass" in too_big.json()["error"]["message"]


def test_concurrent_requests_per_key_are_capped(gateway_factory, replicas, keys):
    live = gateway_factory([smol([replicas[0].url])], limits=RateLimits(max_concurrent=2))
    live.wait_ready("smol", 1)
    key, _ = keys.create("concurrency")
    body = {"model": "smol", "prompt": "Count:", "max_tokens": 24, "ignore_eos": True}

    async def run() -> list[int]:
        async with httpx.AsyncClient(base_url=live.url, headers=_bearer(key), timeout=60) as c:
            return [r.status_code for r in await asyncio.gather(*(c.post("/v1/completions", json=body) for _ in range(4)))]

    assert sorted(asyncio.run(run())) == [200, 200, 429, 429]


def test_trace_context_and_request_id_reach_the_replica(gateway_factory):
    fake = FakeUpstream().start()
    try:
        live = gateway_factory([smol([fake.url], upstream_api_key="sk-upstream")], auth=AuthConfig(enabled=False))
        live.wait_ready("smol", 1)
        parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
        res = httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"},
                         headers={"traceparent": parent, "x-request-id": "req-42"})
        assert res.status_code == 200 and res.headers["x-request-id"] == "req-42"
        sent = fake.requests[-1]["headers"]
        assert sent["traceparent"] == parent and sent["x-request-id"] == "req-42"
        assert sent["authorization"] == "Bearer sk-upstream"  # the upstream's key, not the client's
        # Without a traceparent the gateway starts a trace.
        httpx.post(f"{live.url}/v1/completions", json={"prompt": "x"})
        assert fake.requests[-1]["headers"]["traceparent"].startswith("00-")
        assert fake.requests[-1]["body"]["model"] == "smol"  # filled in for the replica
    finally:
        fake.stop()


def test_cors_preflight_and_headers(gateway_factory, replicas):
    live = gateway_factory([smol([replicas[0].url])], cors_origins=["http://app.example"])
    pre = httpx.options(f"{live.url}/v1/chat/completions", headers={
        "Origin": "http://app.example", "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type",
    })
    assert pre.status_code == 200
    assert pre.headers["access-control-allow-origin"] == "http://app.example"
    other = httpx.options(f"{live.url}/v1/chat/completions", headers={
        "Origin": "http://evil.example", "Access-Control-Request-Method": "POST",
    })
    assert other.status_code == 400
